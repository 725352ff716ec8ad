"""Search the layer-skip draft's sub-layers with Optuna (``quickdraft tune layer-skip``).

Draft & Verify's search, with a modelled objective instead of raw tokens/s (which is too
noisy on a shared CPU to rank 2^(2L) profiles): each trial picks, per layer, whether its
attention and its MLP are skipped; the trial's skip draft decodes the calibration prompts
greedily at ``probe_k`` (the target verifies, so the text is the target's) for its
per-position acceptance, and the cost model (:mod:`quickdraft.bench.cost_model`) predicts
the speedup at the best k from it and from step costs measured once:

- verify passes of 1..max_k+1 tokens (``StepCostSampler``, as auto-k measures them);
- one draft step = one target step minus what the skipped sub-layers cost: every layer has
  the same shapes, so the cost of one attention and of one MLP sub-layer come from timing
  1-token passes with all attention, then all MLP sub-layers skipped.

The study lives in an SQLite file: running the command again resumes it (``--trials`` is
the total). The best profiles are then decoded for real against plain decoding, and their
measured tokens/s recorded next to the prediction.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..decoding.engine import decode
from ..decoding.sampling import SamplingParams
from ..decoding.stats import GenerationStats
from ..decoding.stopping import StopConditions
from ..drafters import DraftModelDrafter
from ..drafters.layer_skip import LayerSkipLM, SkipProfile, model_fingerprint
from ..models.decode_linear import row_dependent_rounding
from ..models.lm import NativeLM
from ..policy.autok import StepCostSampler
from ..policy.cost_model import StepCosts, best_k, speedup_curve


@dataclass
class SublayerCosts:
    """Seconds of a 1-token target step and of the parts a skip removes from it."""

    t_ar: float
    attn: float  # one attention sub-layer
    mlp: float  # one MLP sub-layer

    def draft_step(self, profile: SkipProfile) -> float:
        saved = len(profile.skip_attn) * self.attn + len(profile.skip_mlp) * self.mlp
        return max(self.t_ar - saved, 0.05 * self.t_ar)

    def to_dict(self) -> dict:
        return {"t_ar": self.t_ar, "attn": self.attn, "mlp": self.mlp}


def skip_step_seconds(target: NativeLM, context: torch.Tensor, profiles: dict[str, tuple], repeats: int
                      ) -> dict[str, float]:
    """Median seconds of one 1-token step after ``context`` for each named (attn, mlp) skip
    set. The sets are timed in turn within every round, so a change in machine speed (a
    shared CPU) hits them alike, and the medians of their differences to the first set are
    what is returned for the others (the first: its own median)."""
    n_layers = target.config.n_layers
    views = {name: LayerSkipLM(target, SkipProfile("", "", n_layers, list(a), list(m)))
             for name, (a, m) in profiles.items()}
    length = context.numel()
    target.reset(length + 2)
    target.extend(context, logits="none")
    token = context[-1:]
    times: dict[str, list[float]] = {name: [] for name in views}
    for _ in range(repeats + 1):
        for name, view in views.items():
            view.reset()
            view.extend(context, logits="none")  # the target holds it: nothing to compute
            with row_dependent_rounding():  # the kernels DraftModelDrafter drafts with
                started = time.perf_counter()
                view.extend(token, logits="last")
                times[name].append(time.perf_counter() - started)
    first = next(iter(times))
    out = {first: statistics.median(times[first][1:])}
    for name in list(times)[1:]:
        out[name] = statistics.median(a - b for a, b in zip(times[first][1:], times[name][1:]))
    return out


def measure_costs(target: NativeLM, context: torch.Tensor, max_k: int, repeats: int = 15
                  ) -> tuple[StepCosts, SublayerCosts]:
    """Verify costs (1..max_k+1 tokens) and the per-sub-layer costs, measured once."""
    sampler = StepCostSampler(target, None, context, range(1, max_k + 2))
    sampler.sample(1, record=False)
    sampler.sample(repeats)
    verify = sampler.costs()
    layers = list(range(target.config.n_layers))
    steps = skip_step_seconds(target, context, {"full": ([], []), "attn": (layers, []), "mlp": ([], layers)},
                              4 * repeats)
    n = len(layers)
    sub = SublayerCosts(steps["full"], max(steps["attn"], 0.0) / n, max(steps["mlp"], 0.0) / n)
    return verify, sub


def calibration_acceptance(target: NativeLM, profile: SkipProfile, prompts: Sequence[torch.Tensor],
                           tokens: int, probe_k: int, eos: Sequence[int]) -> GenerationStats:
    """Greedy decoding of each prompt with the skip draft at ``probe_k``: pooled stats."""
    drafter = DraftModelDrafter(LayerSkipLM(target, profile), target.vocab_size)
    stats = GenerationStats()
    for ids in prompts:
        one = GenerationStats()
        for _ in decode(target, ids, StopConditions(tokens, eos), drafter=drafter, params=SamplingParams(),
                        num_speculative_tokens=probe_k, stats=one):
            pass
        stats.merge(one)
    return stats


@dataclass
class Prediction:
    speedup: float
    k: int
    per_position: list[float]
    t_draft: float


def predict(profile: SkipProfile, stats: GenerationStats, verify: StepCosts, sub: SublayerCosts,
            max_k: int) -> Prediction:
    """The cost model's speedup at its best k for this profile's measured acceptance."""
    per_position = stats.per_position_acceptance or [0.0]
    t_draft = sub.draft_step(profile)
    costs = StepCosts(t_ar=verify.t_ar, t_draft=t_draft, verify=dict(verify.verify))
    k = best_k(costs, per_position=per_position, max_k=max_k)
    return Prediction(speedup_curve(costs, per_position=per_position, max_k=max_k)[k], k, list(per_position), t_draft)


def profile_from_params(params: dict, n_layers: int, model: str, fingerprint: str) -> SkipProfile:
    attn = [i for i in range(n_layers) if params.get(f"attn_{i}")]
    mlp = [i for i in range(n_layers) if params.get(f"mlp_{i}")]
    return SkipProfile(model, fingerprint, n_layers, attn, mlp)


def first_guesses(n_layers: int) -> list[dict]:
    """Warm starts: every other layer's MLP, every other layer's attention, and both (the
    first and last layers kept: they matter most in every skip study)."""
    odd = [i for i in range(1, n_layers - 1, 2)]
    guesses = []
    for attn, mlp in ((False, True), (True, False), (True, True)):
        guesses.append({f"{kind}_{i}": int(i in odd and on) for i in range(n_layers)
                        for kind, on in (("attn", attn), ("mlp", mlp))})
    return guesses


def measured_speedup(target: NativeLM, profile: SkipProfile, k: int, prompts: Sequence[torch.Tensor],
                     tokens: int, eos: Sequence[int], rounds: int = 2) -> dict:
    """Decode tokens/s of plain decoding and of the skip draft at k, interleaved (ratios
    from one run)."""
    skip = DraftModelDrafter(LayerSkipLM(target, profile), target.vocab_size)
    seconds = {"ar": 0.0, "layer-skip": 0.0}
    counted = {"ar": 0, "layer-skip": 0}
    for _ in range(rounds):
        for ids in prompts:
            for name, drafter in (("ar", None), ("layer-skip", skip)):
                stats = GenerationStats()
                for _ in decode(target, ids, StopConditions(tokens, eos), drafter=drafter,
                                num_speculative_tokens=k, stats=stats):
                    pass
                seconds[name] += stats.decode_seconds + stats.prefill_seconds
                counted[name] += stats.new_tokens
    rate = {name: counted[name] / max(seconds[name], 1e-9) for name in seconds}
    return {"ar_tokens_per_second": rate["ar"], "layer_skip_tokens_per_second": rate["layer-skip"],
            "speedup": rate["layer-skip"] / rate["ar"] if rate["ar"] else None}


def run_study(target: NativeLM, model_name: str, prompts: Sequence[torch.Tensor], eos: Sequence[int],
              study_path: Path, trials: int, tokens: int = 40, probe_k: int = 8, max_k: int = 8,
              progress: Callable | None = None, seed: int = 0):
    """Run the Optuna study until it holds ``trials`` finished trials; returns (study,
    verify costs, sub-layer costs)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    fingerprint = model_fingerprint(target.model_dir)
    n_layers = target.config.n_layers
    storage = f"sqlite:///{Path(study_path).resolve()}"
    study = optuna.create_study(study_name=f"layer-skip-{model_name}-{fingerprint}", storage=storage,
                                direction="maximize", load_if_exists=True)
    # A resumed study gets a fresh seed: the same one would redraw the first run's random trials.
    study.sampler = optuna.samplers.TPESampler(seed=seed + len(study.trials))
    if not study.trials:
        for guess in first_guesses(n_layers):
            study.enqueue_trial(guess)
    context = prompts[0]
    verify, sub = measure_costs(target, context, max_k)
    study.set_user_attr("costs", {"verify": verify.to_dict(), "sublayers": sub.to_dict()})

    def objective(trial) -> float:
        params = {f"{kind}_{i}": trial.suggest_int(f"{kind}_{i}", 0, 1)
                  for i in range(n_layers) for kind in ("attn", "mlp")}
        profile = profile_from_params(params, n_layers, model_name, fingerprint)
        stats = calibration_acceptance(target, profile, prompts, tokens, probe_k, eos)
        pred = predict(profile, stats, verify, sub, max_k)
        trial.set_user_attr("k", pred.k)
        trial.set_user_attr("per_position", pred.per_position)
        trial.set_user_attr("t_draft", pred.t_draft)
        trial.set_user_attr("mean_accepted", stats.mean_accepted_tokens)
        return pred.speedup

    remaining = trials - len([t for t in study.trials if t.state.is_finished()])
    for _ in range(max(remaining, 0)):
        study.optimize(objective, n_trials=1)
        if progress:
            progress(study)
    return study, verify, sub

