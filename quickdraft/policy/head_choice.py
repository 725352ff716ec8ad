"""What ``--method auto`` knows of the head methods (Medusa, prophet, EAGLE): their
acceptance and their drafting cost, measured by running them.

A draft model's acceptance can be replayed from one teacher-forced pass (its rank of each
target token: :mod:`.method_choice`), but a head's proposals depend on the target's hidden
states and, for EAGLE and the prophet, on the head's own outputs fed back, so nothing
short of drafting tells what it would propose. Auto therefore decodes each calibration
prompt greedily with the head method itself (lossless: the output is the reference
trace's), records every proposal's size and how long the head took to propose it, and
prices the step as the engine runs it: the head's measured drafting time plus the
target's verify pass over the proposal + 1 (the same measured costs the draft methods
are priced with). Only heads shipped for the target are weighed; ``--heads DIR`` names a
method explicitly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..decoding.engine import decode
from ..decoding.stats import GenerationStats
from ..decoding.stopping import StopConditions
from ..drafters.factory import HYBRID_EAGLE_CHAIN, HYBRID_EAGLE_K, DraftOptions, make_drafter
from ..drafters.per_row import HEAD_BATCH_K
from ..models.draft_vocab import VOCAB_FILE
from ..models.lm import CausalLM, NativeLM, eos_token_ids
from . import cache
from .autok import CALIBRATION_PROMPTS, measure_quiet_step_costs
from .cache import file_digest
from .cost_model import StepCosts

#: The head methods auto weighs, each at the k it runs with by default (the same table as
#: batched rows'): one k each, as every k costs a decode of each calibration prompt.
HEAD_KS = {method: (k,) for method, k in HEAD_BATCH_K.items()}

#: Further shapes auto weighs, as (k, tree): EAGLE one token ahead (a chain of 1). Where a
#: verify pass costs nearly k + 1 steps (SmolLM2's compute-bound int4 products on a 2-core
#: AVX2 CPU) only that pays: 1.14x / 1.31x over plain decoding on chat / code, where the
#: default dynamic tree ran at 0.5x (docs/llama_cpp.md). Chains of 2 and 3, where a pass of
#: 3-4 tokens costs little more than one (SmolLM2's int4 blocks on AVX-512 VNNI: on the
#: bench's chat prompts, in one process, chains of 1 / 2 / 3 / 5 made 1.21 / 1.32 / 1.23 /
#: 1.16x plain decoding, and auto, weighing 1 and 5 only, chose 5). And a chain of 5, whose
#: levels cost no mask or full-vocabulary scores (drafters/eagle.py): beside the embedded
#: target 1.80x plain decoding where the dynamic tree of 8 made 1.02x (one bench run).
HEAD_SHAPES: dict[str, tuple[tuple[int, tuple[int, ...]], ...]] = {
    method: tuple((k, ()) for k in ks) for method, ks in HEAD_KS.items()}
HEAD_SHAPES["eagle"] += tuple((k, (1,) * k) for k in (1, 2, 3, 5))
#: Prompt lookup, else the EAGLE drafter's chain, at its defaults: SmolLM2's code prompts
#: 2.07-2.17x plain decoding where the n-gram alone made 1.74-1.84x (docs/smollm2/bench.md,
#: "Session 37").
HEAD_SHAPES["hybrid-eagle"] = ((HYBRID_EAGLE_K, (1,) * HYBRID_EAGLE_CHAIN),)


def head_methods_weighed(shipped: dict[str, str]) -> list[str]:
    """The head methods auto runs for a target with ``shipped`` heads
    (:func:`shipped_head_methods`): each of them, and hybrid-eagle beside an EAGLE drafter."""
    return [*shipped, *(["hybrid-eagle"] if "eagle" in shipped else [])]


def shipped_head_methods(target: CausalLM) -> dict[str, str]:
    """The head methods with heads shipped for ``target`` (native runtime only): method ->
    the heads' directory name and weights' digest, and their draft vocabulary's where they
    have one (part of auto's cache key: new heads, heads retrained under the same name, or
    a new default ``--draft-vocab`` are weighed again)."""
    if not isinstance(target, NativeLM):
        return {}
    from ..drafters.eagle import shipped_eagle
    from ..drafters.medusa import shipped_medusa
    from ..drafters.prophet import shipped_prophet

    found = {"medusa": shipped_medusa(target), "prophet": shipped_prophet(target), "eagle": shipped_eagle(target)}
    return {method: f"{path.name}@{file_digest(path / 'model.safetensors')[:16]}"
                    + (f"+{file_digest(path / VOCAB_FILE)[:8]}" if (path / VOCAB_FILE).exists() else "")
            for method, path in found.items() if path is not None}


class _TimedDrafter:
    """A drafter whose proposals are timed and sized, for pricing its steps."""

    greedy_rounds = None  # every round through propose, to be timed (not several in one C call)

    def __init__(self, drafter) -> None:
        self.inner, self.seconds, self.sizes = drafter, 0.0, []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def propose(self, slots, sequences, ks):
        started = time.perf_counter()
        proposals = self.inner.propose(slots, sequences, ks)
        self.seconds += time.perf_counter() - started
        self.sizes.extend(p.tokens.numel() for p in proposals)
        return proposals


def measure_head_method(method: str, k: int, target: CausalLM, prompts: Sequence[torch.Tensor],
                        outputs: Sequence[list[int]], costs: StepCosts, repeats: int = 1,
                        tree: tuple[int, ...] = (), heads=None) -> tuple[float, float]:
    """(predicted speedup over plain decoding, tokens per target pass) of ``method`` at
    ``k`` (and ``tree`` widths; () = the method's default shape) on the calibration
    ``prompts``, whose greedy references are ``outputs``, with ``heads`` (loaded; None:
    those shipped for the target). Each prompt is decoded ``repeats`` times; the least
    drafting time is kept (timings only grow with noise)."""
    options = DraftOptions(tree=",".join(map(str, tree)) if tree else None, heads=heads)
    drafter = make_drafter(method, None, target.vocab_size, options, target=target)
    seconds = tokens = passes = 0.0
    for prompt, reference in zip(prompts, outputs):
        best: tuple[_TimedDrafter, int] | None = None
        for _ in range(repeats):
            timed, stats = _TimedDrafter(drafter), GenerationStats()
            out = [t for step in decode(target, prompt, StopConditions(len(reference), []), timed,
                                        num_speculative_tokens=k, stats=stats) for t in step.tokens]
            if out != reference:  # greedy speculation is lossless: anything else is a bug
                raise RuntimeError(f"{method} changed the greedy output while auto measured it")
            if best is None or timed.seconds < best[0].seconds:
                best = timed, stats.target_forward_passes
        timed, step_passes = best
        # Passes the drafter was not asked to fill (no room left to draft) are plain steps.
        plain = step_passes - len(timed.sizes)
        seconds += timed.seconds + sum(costs.t_verify(size + 1) for size in timed.sizes) + plain * costs.t_ar
        passes += step_passes
        tokens += len(reference)
    if not seconds:
        return 1.0, 1.0
    return tokens * costs.t_ar / seconds, tokens / passes


#: Bumped when what :func:`cached_eagle_k` measures changes meaning (entries measured again).
EAGLE_K_VERSION = 4  # 2: plain steps timed after plain steps (autok.StepCostSampler); 3: after 16;
#                     4: t_ar a plain greedy chain's token (autok.plain_token_seconds)
#: Tokens of each calibration prompt's greedy run the chains are timed on.
CHAIN_TOKENS = 64


def cached_eagle_k(target: NativeLM, tokenizer, head, max_k: int, remeasure: bool = False,
                   log: Callable[[str], None] | None = None) -> tuple[int, bool]:
    """How long an EAGLE chain drafts on this target, drafter and machine, and whether it
    was measured now: the chain of 1..``max_k`` with the best predicted speedup
    (:func:`measure_head_method` on the calibration prompts with the target's measured
    step costs), 0 (plain decoding) when none is predicted faster than plain decoding;
    cached beside the auto-k choices, measured (seconds) when missing or with
    ``remeasure``. Chains, because a wide verify pass costs several steps on a CPU; how
    long pays depends on the target (SmolLM2's int4 passes: a chain of 1-2; the embedded
    target: 8). ``log`` gets a line before a measurement."""
    calibration = [tokenizer(text, verbose=False)["input_ids"] for text in CALIBRATION_PROMPTS]
    entry = cache.entry("eagle-k", EAGLE_K_VERSION, {"target": target}, head=cache.module_digest(head),
                        max_k=max_k, calibration=cache.digest(calibration))

    def measure() -> dict:
        eos = eos_token_ids(target, tokenizer)
        prompts = [torch.tensor(ids, dtype=torch.long) for ids in calibration]
        outputs = [[t for s in decode(target, ids, StopConditions(CHAIN_TOKENS, eos)) for t in s.tokens]
                   for ids in prompts]
        longest = max(range(len(prompts)), key=lambda i: prompts[i].numel() + len(outputs[i]))
        context = torch.cat([prompts[longest], torch.tensor(outputs[longest], dtype=torch.long)])
        costs, _ = measure_quiet_step_costs(target, None, context, range(1, max_k + 2), repeats=5, log=log)
        predicted: dict[int, float] = {}
        best = 1
        for n in range(1, max_k + 1):
            predicted[n] = measure_head_method("eagle", n, target, prompts, outputs, costs, tree=(1,) * n,
                                               heads=head)[0]
            best = n if round(predicted[n], 12) > round(predicted[best], 12) else best
            if n >= best + 2:  # two longer chains in a row no better: longer ones only cost more (SmolLM2: 1 > 2 > 3)
                break
        return {"k": best if predicted[best] > 1.0 else 0, "predicted": predicted}

    data, measured = cache.measured_once(entry, "how long an EAGLE chain pays for this target and drafter",
                                         measure, lambda d: isinstance(d.get("k"), int), remeasure, log)
    return data["k"], measured
