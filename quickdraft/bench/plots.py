"""PNG plots of a benchmark result (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from .cost_model import StepCosts, predicted_speedup


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_speedup_vs_k(result: dict, path: Path) -> Path | None:
    """Measured speedup of the draft rows against k, with the cost model's prediction
    (from the measured step costs and the per-position acceptance of the largest-k row,
    extrapolated geometrically past it) overlaid."""
    rows = sorted((r for r in result["results"] if r["method"] == "draft" and r["speedup"] is not None),
                  key=lambda r: r["k"])
    if not rows:
        return None
    plt = _plt()
    costs = StepCosts.from_dict(result["step_costs"])
    widest = max(rows, key=lambda r: len(r.get("per_position_acceptance") or []))
    per_position = widest.get("per_position_acceptance") or []
    ks = [r["k"] for r in rows]
    max_k = max(max(ks), 8)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(ks, [r["speedup"] for r in rows], "o-", label="measured")
    if per_position:
        pred_k = list(range(1, max_k + 1))
        ax.plot(pred_k, [predicted_speedup(k, costs, per_position=per_position) for k in pred_k], "--",
                label=f"cost model (a_i from k={widest['k']})")
    own = [(r["k"], r["predicted_speedup"]) for r in rows if r["predicted_speedup"] is not None]
    if own:
        ax.scatter(*zip(*own, strict=True), marker="x", color="gray", label="cost model (each row's own a_i)")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("speedup vs ar (decode tokens/s)")
    ax.set_title("draft-model speculative decoding: speedup vs k")
    ax.legend()
    return _save(plt, fig, ax, path)


def plot_per_position(result: dict, path: Path) -> Path | None:
    rows = [r for r in result["results"] if r.get("per_position_acceptance")]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in rows:
        pp = r["per_position_acceptance"]
        ax.plot(range(1, len(pp) + 1), pp, "o-", label=r["label"], alpha=1.0 if r.get("primary") else 0.5)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(position i accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("per-position acceptance")
    ax.legend(fontsize=7)
    return _save(plt, fig, ax, path)


def plot_tokens_per_second(result: dict, path: Path) -> Path | None:
    rows = [r for r in result["results"] if r["tokens_per_second"] is not None]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.4, 0.7 * len(rows) + 2), 4.2))
    labels = [r["label"].replace(",schedule=constant", "") for r in rows]
    colors = ["tab:blue" if r.get("implementation") == "quickdraft" else "tab:orange" for r in rows]
    bars = ax.bar(range(len(rows)), [r["tokens_per_second"] for r in rows], color=colors)
    for bar, r in zip(bars, rows, strict=True):
        if r["speedup"] is not None:
            ax.annotate(f"{r['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title("tokens/s by method (blue: quickdraft, orange: transformers)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(result: dict, out_dir: str | Path) -> list[str]:
    """All plots into ``out_dir``; returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fn in [("speedup_vs_k.png", plot_speedup_vs_k),
                     ("per_position_acceptance.png", plot_per_position),
                     ("tokens_per_second.png", plot_tokens_per_second)]:
        p = fn(result, out_dir / name)
        if p is not None:
            written.append(str(p))
    return written


def _save(plt, fig, ax, path: Path) -> Path:
    """Grid, tight layout, write the PNG, free the figure."""
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
