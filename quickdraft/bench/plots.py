"""PNG plots of a benchmark result (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from ..policy.cost_model import StepCosts, predicted_speedup


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_speedup_vs_k(result: dict, path: Path) -> Path | None:
    """Measured speedup of the draft rows against k, one line per prompt category, with the
    cost model's prediction for that category (from its measured step costs and the
    per-position acceptance of its largest-k row, extrapolated geometrically past it)."""
    groups = [(g, sorted((r for r in g["rows"] if r["method"] == "draft" and r["speedup"] is not None),
                         key=lambda r: r["k"])) for g in result["results"]]
    groups = [(g, rows) for g, rows in groups if rows]
    if not groups:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (group, rows) in enumerate(groups):
        color = f"C{i}"
        ks = [r["k"] for r in rows]
        ax.plot(ks, [r["speedup"] for r in rows], "o-", color=color, label=f"{group['category']}: measured")
        widest = max(rows, key=lambda r: len(r.get("per_position_acceptance") or []))
        per_position = widest.get("per_position_acceptance") or []
        if per_position:
            costs = StepCosts.from_dict(group["step_costs"])
            pred_k = list(range(1, max(max(ks), 8) + 1))
            ax.plot(pred_k, [predicted_speedup(k, costs, per_position=per_position) for k in pred_k], "--",
                    color=color, alpha=0.7, label=f"{group['category']}: cost model")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("speedup vs ar (decode tokens/s)")
    ax.set_title("draft-model speculative decoding: speedup vs k")
    ax.legend(fontsize=7)
    return _save(plt, fig, ax, path)


def plot_per_position(result: dict, path: Path) -> Path | None:
    """Per-position acceptance of each drafting row, over all categories."""
    rows = [r for r in result["overall"]["rows"] if r.get("per_position_acceptance")]
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
    ax.set_title("per-position acceptance (all categories)")
    ax.legend(fontsize=7)
    return _save(plt, fig, ax, path)


def plot_tokens_per_second(result: dict, path: Path) -> Path | None:
    """Median tokens/s of each row over all categories, its speedup on top."""
    rows = [r for r in result["overall"]["rows"] if r["tokens_per_second"] is not None]
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
