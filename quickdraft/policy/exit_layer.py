"""The cost model applied to early exit: which exit layer L (and k) pays most.

For each L, :func:`measure_exit_layer` times the calls one early-exit step is made of
(a draft step = layers [0, L) + the exit head over one token; the base pass of the last
drafted token = layers [0, L) alone; verification = layers [L, N) over k + 1 tokens
resuming from cached hidden states, or all N layers without sharing) and measures the
per-position acceptance of the head on the calibration prompts. The cost model
(:func:`.cost_model.predicted_speedup`) then predicts the speedup of every (L, k).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..decoding.engine import PLAIN_CHAIN, decode
from ..decoding.stats import GenerationStats
from ..decoding.stopping import StopConditions
from ..drafters.early_exit import EarlyExitDrafter, step_head
from ..models.exit_head import ExitHead
from ..models.lm import NativeLM, eos_token_ids
from . import cache
from .autok import CALIBRATION_PROMPTS, plain_token_seconds
from .cost_model import StepCosts, best_k, speedup_curve
from .timing import device_clock


@dataclass
class ExitLayerChoice:
    """Measured costs, acceptance and predictions per exit layer; ``layer``/``k``: the best."""

    layer: int
    k: int
    per_layer: dict[int, dict] = field(default_factory=dict)

    @property
    def predicted_speedup(self) -> float:
        return self.per_layer[self.layer]["predicted"][self.k]


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        started = device_clock()
        fn()
        times.append(device_clock() - started)
    return statistics.median(times)


@torch.inference_mode()
def step_costs(target: NativeLM, head: ExitHead, context: torch.Tensor, max_k: int, share_kv: bool = True,
               repeats: int = 7) -> StepCosts:
    """StepCosts of early exit at ``head.exit_layer`` after ``context`` (token ids): t_ar is a
    plain step (a token of a plain greedy chain where the target runs one), t_draft a draft step, verify[n] the verify pass over n tokens (from layer L
    with ``share_kv``); the base pass of the last drafted token is per-step overhead."""
    model, n_layers, layer = target.model, target.config.n_layers, head.exit_layer
    length = context.numel()
    target.reset(length + max(max_k + 2, PLAIN_CHAIN + 1))
    target.extend(context, logits="none")
    one = context[-1:].view(1, 1).to(target.device)  # fed to the model directly, not through target.extend
    # As the drafter runs them: int positions (slice writes, no gathers) and the extra
    # block's cache allocated once per generation, not per step.
    head = step_head(target, head)
    head_cache = head.new_cache(1, length + 2, model.embed.weight)

    def run(tokens, layers, hidden=None, logits="all"):
        return model(None if hidden is not None else tokens, length, target.cache, hidden=hidden,
                     layers=layers, logits=logits)

    # A plain step as the engine decodes plain greedy text: a token of a chain in one call
    # where the target runs them, else one pass.
    chained = [plain_token_seconds(target, context[-1:], device_clock) for _ in range(repeats)]
    t_ar = (statistics.median(chained) if None not in chained
            else _median_seconds(lambda: run(one, (0, n_layers)), repeats))

    def draft_step():
        h = run(one, (0, layer), logits="none").hidden
        head.logits(head.transform(h, model, length, head_cache), model)
    t_draft = _median_seconds(draft_step, repeats)
    base = _median_seconds(lambda: run(one, (0, layer), logits="none"), repeats) if share_kv else 0.0
    verify = {}
    for n in range(1, max_k + 2):
        tokens = context[-n:].view(1, -1).to(target.device) if n <= length else one.repeat(1, n)
        hidden = (torch.zeros(1, n, model.config.hidden_size, dtype=model.embed.weight.dtype,
                              device=target.device) if share_kv else None)
        verify[n] = _median_seconds(lambda t=tokens, h=hidden: run(t, (layer if share_kv else 0, n_layers), h), repeats)
    return StepCosts(t_ar=t_ar, t_draft=t_draft, verify=verify, overhead=base)


def measure_exit_layer(target: NativeLM, tokenizer, heads: dict[int, ExitHead] | None = None,
                       max_k: int = 6, calibration_tokens: int = 48, share_kv: bool = True,
                       repeats: int = 7) -> ExitLayerChoice:
    """Costs and greedy acceptance of early exit at every layer (the shared head unless
    ``heads`` gives one per layer); the (L, k) with the best predicted speedup."""
    n_layers = target.config.n_layers
    heads = heads or {layer: ExitHead(target.config, layer, trained=False) for layer in range(1, n_layers)}
    prompts = [torch.tensor(tokenizer(p, verbose=False)["input_ids"]) for p in CALIBRATION_PROMPTS]
    eos = eos_token_ids(target, tokenizer)
    per_layer: dict[int, dict] = {}
    best = (0.0, 0, 0)
    for layer, head in sorted(heads.items()):
        drafter = EarlyExitDrafter(target, head, share_kv=share_kv)
        stats, context = GenerationStats(), None
        for ids in prompts:
            one = GenerationStats()
            out = [t for s in decode(target, ids, StopConditions(calibration_tokens, eos), drafter=drafter,
                                     num_speculative_tokens=max_k, stats=one) for t in s.tokens]
            stats.merge(one)
            context = context if context is not None else torch.cat([ids, torch.tensor(out, dtype=torch.long)])
        per_position = stats.per_position_acceptance or [0.0]
        costs = step_costs(target, head, context, max_k, share_kv, repeats)
        curve = speedup_curve(costs, per_position=per_position, max_k=max_k)
        k = best_k(costs, per_position=per_position, max_k=max_k)
        per_layer[layer] = {"per_position": list(per_position), "costs": costs.to_dict(), "predicted": curve,
                            "k": k, "draft_cost_ratio": costs.t_draft / costs.t_ar,
                            "verify_ratio": costs.t_verify(k + 1) / costs.t_ar}
        if curve[k] > best[0]:
            best = (curve[k], layer, k)
    return ExitLayerChoice(best[1], best[2], per_layer)


#: Bumped when what :func:`cached_exit_k` measures changes meaning (entries measured again).
EXIT_K_VERSION = 2  # 2: t_ar a plain greedy chain's token (autok.plain_token_seconds)
#: The longest chain early exit's k is chosen among (the bench's heuristic stop drafted
#: 7-8 tokens a step with the embedded target's default head).
EXIT_MAX_K = 8


def cached_exit_k(target: NativeLM, tokenizer, head: ExitHead, share_kv: bool = True, remeasure: bool = False,
                  log: Callable[[str], None] | None = None) -> tuple[int, bool]:
    """Early exit's k for this target, exit head and machine, and whether it was measured
    now: the cost model's best k (:func:`measure_exit_layer` at the head's layer, up to
    :data:`EXIT_MAX_K`), 0 (plain decoding) when even that is predicted no faster than
    plain decoding; cached beside the auto-k choices, measured (seconds) when missing or
    with ``remeasure``. ``log`` gets a line before a measurement."""
    calibration = [tokenizer(text, verbose=False)["input_ids"] for text in CALIBRATION_PROMPTS]
    # The head's weights, layer, kind and draft vocabulary: a retrained head, or another
    # --draft-vocab, is measured again.
    drafting = (head.exit_layer, head.kind, None if head.draft_ids is None else head.draft_ids.tolist())
    entry = cache.entry("exit-k", EXIT_K_VERSION, {"target": target}, head=cache.module_digest(head, *drafting),
                        share_kv=share_kv, max_k=EXIT_MAX_K, calibration=cache.digest(calibration))
    def measure() -> dict:
        choice = measure_exit_layer(target, tokenizer, {head.exit_layer: head}, max_k=EXIT_MAX_K, share_kv=share_kv,
                                    repeats=5)
        return {"k": choice.k if choice.predicted_speedup > 1.0 else 0,
                "predicted": choice.per_layer[choice.layer]["predicted"]}

    data, measured = cache.measured_once(entry, "early exit's k for this target and exit head", measure,
                                         lambda d: isinstance(d.get("k"), int), remeasure, log)
    return data["k"], measured
