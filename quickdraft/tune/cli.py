"""``quickdraft tune layer-skip``: search a skip profile for a model and write it as JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_tune_parser(sub) -> None:
    from ..argtypes import non_negative_int, positive_int
    from ..cli import add_placement_options

    tune = sub.add_parser("tune", help="fit a method to a model (layer-skip profiles)",
                          description="Search settings of a method for a model.")
    what = tune.add_subparsers(dest="what", required=True, metavar="WHAT")
    ls = what.add_parser(
        "layer-skip", help="search which sub-layers the layer-skip draft skips (Optuna)",
        description="Search the attention/MLP sub-layers the layer-skip draft skips with Optuna (TPE), "
        "maximising the cost model's predicted speedup from measured acceptance on calibration prompts "
        "and measured step costs. The study is kept in an SQLite file and resumes; the result is a JSON "
        "skip profile for `generate --method layer-skip --skip-profile FILE`, with PNG plots beside it.")
    ls.add_argument("--model", required=True, help="target: model name, HF directory, .gguf file or hub id")
    ls.add_argument("--trials", type=positive_int, default=60,
                    help="finished trials the study should hold (a resumed study runs the rest; default 60)")
    ls.add_argument("--prompts", metavar="FILE",
                    help="calibration prompts, JSONL with a `prompt` field per line (default: the auto-k "
                    "calibration prompts)")
    ls.add_argument("--tokens", type=positive_int, default=40, help="tokens decoded per prompt and trial (default 40)")
    ls.add_argument("--max-k", type=positive_int, default=8, help="largest k the cost model considers (default 8)")
    ls.add_argument("--out", metavar="FILE", help="the profile to write (default: layer-skip-<model>.json)")
    ls.add_argument("--study", metavar="DB", help="the Optuna SQLite study (default: the profile's name .db)")
    ls.add_argument("--measure-best", type=non_negative_int, default=3,
                    help="decode the best N profiles for real against plain decoding (default 3; 0 = none)")
    ls.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    add_placement_options(ls)
    ls.set_defaults(func=cmd_tune_layer_skip)


def calibration_prompts(args, tokenizer) -> list:
    import torch

    from ..cli import CliError
    from ..policy.autok import CALIBRATION_PROMPTS

    texts = list(CALIBRATION_PROMPTS)
    if args.prompts:
        from ..bench.prompts import load_prompts

        try:
            texts = [p.prompt for p in load_prompts(args.prompts)]
        except (OSError, ValueError) as exc:
            raise CliError(str(exc).splitlines()[0]) from None
        if not texts:
            raise CliError(f"{args.prompts} has no prompts")
    return [torch.tensor(tokenizer(t, verbose=False)["input_ids"][-512:], dtype=torch.long) for t in texts]


def cmd_tune_layer_skip(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..cli import CliError, notice, placement_of
    from ..drafters.layer_skip import model_fingerprint
    from ..jsonl import check_writable
    from ..models.lm import NativeLM, eos_token_ids, load_model
    from ..models.loading import resolve_model_dir
    from ..pair import load_tokenizer
    from ..quiet import quiet_transformers
    from .layer_skip import measured_speedup, profile_from_params, run_study

    placement = placement_of(args)  # an unusable device fails before anything loads
    model_dir = resolve_model_dir(args.model)
    with quiet_transformers():
        target = load_model(model_dir, "native", placement)
        tokenizer = load_tokenizer(model_dir)
    if not isinstance(target, NativeLM):
        raise CliError("layer skip needs the native runtime")
    name = model_dir.name if model_dir.is_dir() else model_dir.stem  # a GGUF file: no suffix
    out = Path(args.out or f"layer-skip-{name}.json")
    study_path = Path(args.study or out.with_suffix(".db"))
    check_writable(out, "--out", CliError)  # before the trials, not after them
    check_writable(study_path, "--study", CliError)
    prompts = calibration_prompts(args, tokenizer)
    eos = eos_token_ids(target, tokenizer)
    notice(f"study {study_path} (resumes if it exists); {args.trials} trials, {len(prompts)} prompts x "
           f"{args.tokens} tokens each")

    bar = tqdm(total=args.trials, desc="layer-skip trials", unit="trial", file=sys.stderr)

    def progress(study):
        finished = [t for t in study.trials if t.state.is_finished()]
        bar.n = len(finished)
        best = study.best_trial
        bar.set_postfix_str(f"best {best.value:.3f}x (k={best.user_attrs.get('k')}, trial {best.number})")
        bar.refresh()

    study, verify, sub = run_study(target, name, prompts, eos, study_path, args.trials, args.tokens,
                                   probe_k=args.max_k, max_k=args.max_k, progress=progress, seed=args.seed)
    progress(study)
    bar.close()
    fingerprint = model_fingerprint(model_dir)
    done = sorted((t for t in study.trials if t.value is not None), key=lambda t: -t.value)
    measured = []
    for trial in done[: max(args.measure_best, 0)]:
        profile = profile_from_params(trial.params, target.config.n_layers, name, fingerprint)
        figure = measured_speedup(target, profile, trial.user_attrs["k"], prompts, args.tokens, eos)
        measured.append({"trial": trial.number, "predicted_speedup": trial.value, "k": trial.user_attrs["k"],
                         "skip_attn": profile.skip_attn, "skip_mlp": profile.skip_mlp, **figure})
        notice(f"trial {trial.number}: predicted {trial.value:.3f}x, measured {figure['speedup']:.3f}x "
               f"({profile.describe()}, k={trial.user_attrs['k']})")
    best = done[0]
    profile = profile_from_params(best.params, target.config.n_layers, name, fingerprint)
    profile.k = int(best.user_attrs["k"])
    profile.predicted_speedup = float(best.value)
    profile.info = {
        "study": str(study_path), "study_name": study.study_name, "trials": len(done), "best_trial": best.number,
        "objective": "cost-model predicted speedup at the best k (measured acceptance, measured step costs)",
        "calibration": {"prompts": len(prompts), "tokens_per_prompt": args.tokens, "probe_k": args.max_k,
                        "source": args.prompts or "auto-k calibration prompts"},
        "per_position_acceptance": best.user_attrs.get("per_position"),
        "costs": {"verify": verify.to_dict(), "sublayers": sub.to_dict(), "t_draft": best.user_attrs.get("t_draft")},
        "measured_best": measured,
    }
    profile.save(out)
    plots = save_plots(study, out)
    notice(f"wrote {out}: {profile.describe()}, k={profile.k}, predicted {profile.predicted_speedup:.3f}x"
           + (f"; plots {', '.join(str(p) for p in plots)}" if plots else ""))
    return 0


def save_plots(study, out: Path) -> list[Path]:
    """Optuna's optimisation history and parameter importances, as PNGs beside the profile."""
    import warnings

    import matplotlib
    from optuna.exceptions import ExperimentalWarning

    warnings.filterwarnings("ignore", category=ExperimentalWarning)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.importance import PedAnovaImportanceEvaluator
    from optuna.visualization import matplotlib as vis

    paths = []
    for suffix, draw in (("history", lambda: vis.plot_optimization_history(study)),
                         ("importance", lambda: vis.plot_param_importances(
                             study, evaluator=PedAnovaImportanceEvaluator()))):
        path = out.with_name(f"{out.stem}-{suffix}.png")
        try:
            ax = draw()
        except (ValueError, RuntimeError, ImportError) as exc:  # e.g. too few trials for importances
            from ..cli import notice

            notice(f"no {suffix} plot: {str(exc).splitlines()[0]}")
            continue
        fig = ax.figure
        fig.set_size_inches(8, 5 if suffix == "history" else 7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
