"""The source's experiment: does training a prophet jointly with the main model, from
scratch, help the main model's own loss?

``python -m quickdraft.train.prophet_joint --out DIR`` trains a small main model twice per
seed on the embedded corpus, same data order, steps and init: once on its next-token
cross-entropy alone, once on that plus the prophet's (the prophet reading the main
model's final states undetached, so its loss reaches the main model, as in the source).
It records the main model's held-out cross-entropy along the way as TensorBoard event files
(``OUT/tensorboard/seed<S>/{with,without}``: ``eval/main_ce``, ``train/main_ce``,
``train/prophet_ce``) and writes ``results.json`` and ``val_loss.png``, the chart drawn from
those event files. A few CPU minutes at the defaults.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..models.config import ModelConfig
from ..models.kv_cache import TrainingKVCache
from ..models.prophet import Prophet, ProphetConfig
from ..models.transformer import Transformer
from .data import eval_windows, sample_batch
from .presets import Stage
from .prophet import prophet_batch
from .tracker import Tracker, read_scalars
from .trainer import lr_at, make_optimizer


def main_config(vocab_size: int, width: int, layers: int, seq_len: int) -> ModelConfig:
    return ModelConfig(family="llama", model_type="llama", vocab_size=vocab_size, hidden_size=width, n_layers=layers,
                       n_heads=width // 32, n_kv_heads=width // 32, head_dim=32, intermediate_size=3 * width,
                       max_position_embeddings=seq_len, tie_word_embeddings=True)


def main_forward(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and final states (before the norm) of ``tokens [B, T]``, from scratch."""
    cache = TrainingKVCache(model.config, tokens.shape[0], tokens.shape[1])
    out = model(tokens, 0, cache)
    return out.logits, out.hidden


def prophet_ce(prophet: Prophet, batch: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The prophet's mean cross-entropy on the text at every position of every sequence."""
    cfg = prophet.config
    states, inputs, positions, rows = prophet_batch(batch, hidden, cfg.n_start, cfg.gamma)
    logits = prophet(states, inputs)
    return F.cross_entropy(logits.flatten(0, 1), batch[rows, positions + 1].flatten())


@torch.no_grad()
def heldout_ce(model: Transformer, windows: list[torch.Tensor]) -> float:
    nats = count = 0.0
    for w in windows:
        logits, _ = main_forward(model, w[:, :-1])
        nats += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    return nats / count


def run(train: np.ndarray, heldout: np.ndarray, vocab_size: int, *, with_prophet: bool, steps: int, width: int,
        layers: int, seq_len: int, batch_size: int, lr: float, seed: int, eval_every: int, eval_tokens: int,
        gamma: int = 4, weight: float = 1.0, log=print, tracker: Tracker | None = None) -> dict:
    """One training run; ``{"steps": [...], "val_loss": [...], "prophet_loss": [...], "seconds"}``,
    the same curves written to ``tracker`` when given."""
    torch.manual_seed(seed)
    model = Transformer(main_config(vocab_size, width, layers, seq_len))
    with torch.no_grad():  # GPT-2-style init: embeddings at 0.02, not nn.Embedding's N(0, 1)
        model.embed.weight.normal_(0, 0.02)
    params = torch.nn.ModuleDict({"main": model})
    prophet = None
    if with_prophet:  # built after the main model: its init leaves the main model's unchanged
        prophet = Prophet(ProphetConfig(width, vocab_size, width, n_layers=1, n_heads=width // 32, gamma=gamma,
                                        intermediate_size=3 * width))
        with torch.no_grad():
            prophet.decoder.embed.weight.normal_(0, 0.02)
        params["prophet"] = prophet
    stage = Stage(steps=steps, batch_size=batch_size, lr=lr, warmup=max(1, steps // 20))
    opt = make_optimizer(params, stage)
    windows = eval_windows(heldout, seq_len, eval_tokens)
    record: dict = {"steps": [], "val_loss": [], "prophet_loss": []}
    started = time.perf_counter()
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            record["steps"].append(step)
            record["val_loss"].append(round(heldout_ce(model, windows), 5))
            if tracker is not None:
                tracker.scalars(step, "eval", {"main_ce": record["val_loss"][-1]})
            log(f"[{'with' if with_prophet else 'without'} prophet] step {step}: held-out CE "
                f"{record['val_loss'][-1]:.4f}")
        if step == steps:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, stage)
        batch = sample_batch(train, batch_size, seq_len, seed, step)
        logits, hidden = main_forward(model, batch[:, :-1])
        loss = main_ce = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        extra = None
        if prophet is not None:
            extra = prophet_ce(prophet, batch, hidden)
            loss = loss + weight * extra
            if step % eval_every == 0:
                record["prophet_loss"].append(round(extra.item(), 5))
        if tracker is not None:
            tracker.scalars(step + 1, "train", {"main_ce": main_ce.item(),
                                                **({} if extra is None else {"prophet_ce": extra.item()})})
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # Clipped apart: one norm over both would shrink the main model's step whenever the
        # prophet's gradient is large, which alone could change its loss curve.
        for part in params.values():
            torch.nn.utils.clip_grad_norm_(part.parameters(), stage.grad_clip)
        opt.step()
    record["seconds"] = round(time.perf_counter() - started, 1)
    return record


def plot(results: dict, tb_dir: Path, path: Path) -> None:
    """The main model's held-out CE with and without the prophet term, one line per seed,
    read back from the runs' TensorBoard event files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    seeds = results["settings"]["seeds"]
    for name, label, color in (("without", "main CE only", "tab:blue"),
                               ("with", "main CE + prophet CE (joint)", "tab:orange")):
        for i, seed in enumerate(seeds):
            steps, values = zip(*read_scalars(tb_dir / f"seed{seed}" / name)["eval/main_ce"])
            ax.plot(steps, values, color=color, marker="o", markersize=2, linewidth=1, alpha=0.8,
                    label=label if i == 0 else None)
    s = results["settings"]
    ax.set_xlabel("step")
    ax.set_ylabel("main model held-out cross-entropy (nats/token)")
    ax.set_title(f"Prophet term, main model {s['layers']}x{s['width']} from scratch "
                 f"(seeds {', '.join(map(str, seeds))})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m quickdraft.train.prophet_joint", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where results.json and val_loss.png go")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                   help="one pair of runs per seed (init and batch order; default 0 1 2)")
    p.add_argument("--eval-every", type=int, default=15)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    from ..models.loading import resolve_model_dir
    from ..pair import load_tokenizer
    from .distill import tokenize
    from .textdata import read_text_data

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(resolve_model_dir("qd-stdlib-target"))
    tokens = tokenize(read_text_data(["stdlib"]), tok, args.seq_len)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "threads")}
    results: dict = {"settings": settings, "data": {"train_tokens": int(tokens.train.size),
                                                    "heldout_tokens": int(tokens.heldout.size)}}
    common = dict(steps=args.steps, width=args.width, layers=args.layers, seq_len=args.seq_len,
                  batch_size=args.batch_size, lr=args.lr, eval_every=args.eval_every,
                  eval_tokens=args.eval_tokens, gamma=args.gamma)
    tb_dir = args.out / "tensorboard"
    results["runs"] = {}
    for seed in args.seeds:
        pair = results["runs"][str(seed)] = {}
        for name in ("without", "with"):
            with Tracker(tb_dir / f"seed{seed}" / name) as tracker:
                pair[name] = run(tokens.train, tokens.heldout, len(tok), with_prophet=name == "with", seed=seed,
                                 tracker=tracker, **common)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, tb_dir, args.out / "val_loss.png")
    gaps = []
    for seed, pair in results["runs"].items():
        wo, w = pair["without"]["val_loss"][-1], pair["with"]["val_loss"][-1]
        gaps.append(wo - w)
        print(f"seed {seed}: final held-out CE of the main model {wo:.4f} without the prophet term, {w:.4f} with it")
    print(f"mean gain from the prophet term: {sum(gaps) / len(gaps):+.4f} nats/token over {len(gaps)} seeds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
