"""Benchmark output: rich tables for terminals (one per prompt category, then the headline
over all categories), the JSON file, and a Markdown report with the same tables."""

from __future__ import annotations

import json
from pathlib import Path

from ..models.registry import ASSETS_DIR
from .results import TOO_NOISY


def _model_label(path: str | None) -> str:
    """An embedded model by its name (its path differs per install), others by path."""
    if not path:
        return "-"
    if Path(path).parent == ASSETS_DIR:
        return f"`{Path(path).name}` (embedded)"
    return f"`{path}`"


def _backend(cfg: dict) -> str:
    """The runtime the models ran on, and why when it was not asked for."""
    backend = cfg.get("backend", "native")
    name = "transformers" if backend == "hf" else "native"
    if cfg.get("backend_requested") == "auto" and backend == "hf":
        return f"{name} runtime (auto: the native runtime does not support this checkpoint)"
    settings = [f"--{flag} {cfg[key]}" for flag, key in (("quantize", "quantize"), ("kv-cache", "kv_cache"))
                if cfg.get(key, "auto") != "auto"]
    return f"{name} runtime" + (f" ({', '.join(settings)})" if settings else "")


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:{spec}}{suffix}"


def _noisy(row: dict, figure: str) -> bool:
    """Whether a row's figure (``predicted_speedup``, ``overhead``) is too noisy to trust."""
    return figure in (row.get("too_noisy") or {})


def _predicted(row: dict) -> str:
    return "too noisy" if _noisy(row, "predicted_speedup") else _fmt(row["predicted_speedup"], ".2f", "x")


def _efficiency(row: dict) -> str:
    return "too noisy" if _noisy(row, "predicted_speedup") else _fmt(row["efficiency"])


def _lossless(row: dict) -> str:
    agreement = row.get("greedy_agreement")
    if agreement:  # llama.cpp: not ours to be lossless; how far its greedy text agrees with ar
        return f"{agreement['agreeing']}/{agreement['prompts']} agree"
    value = row["lossless"]
    return "n/a (sampled)" if value is None else ("yes" if value else "NO")


def agreement_lines(rows: list[dict]) -> list[str]:
    """One line per llama.cpp row whose greedy text diverges from ar's on some prompt."""
    lines = []
    for r in rows:
        a = r.get("greedy_agreement")
        if a and a["first_divergence"]:
            where = ", ".join(f"{pid} at token {pos}" for pid, pos in list(a["first_divergence"].items())[:5])
            lines.append(f"{r['label']}: greedy text agrees with ar on {a['agreeing']}/{a['prompts']} prompts; "
                         f"first divergence: {where}")
    return lines


def _settings(row: dict) -> str:
    """Settings for display (the JSON has all of them; constant ones are left out here)."""
    shown = {k: v for k, v in (row.get("settings") or {}).items() if k not in HIDDEN_SETTINGS}
    return ", ".join(f"{k}={v}" for k, v in shown.items()) or "-"


HIDDEN_SETTINGS = {"schedule", "confidence_threshold"}


def _with_range(row: dict, key: str, spec: str, suffix: str = "") -> str:
    """The median and, when runs differ, its min-max range: ``1.77x [1.50-2.10]``."""
    value = _fmt(row.get(key), spec, suffix)
    s = (row.get("spread") or {}).get(key)
    if value == "-" or not s or s["n"] < 2:
        return value
    return f"{value} [{s['min']:{spec}}-{s['max']:{spec}}]"


COLUMNS = [
    ("method", lambda r: r["method"]),
    ("settings", _settings),
    ("tok/s [min-max]", lambda r: _with_range(r, "tokens_per_second", ".1f")),
    ("speedup [min-max]", lambda r: _with_range(r, "speedup", ".2f", "x")),
    ("e2e speedup", lambda r: _fmt(r.get("e2e_speedup"), ".2f", "x")),
    ("tau", lambda r: _fmt(r["mean_accepted_tokens"])),
    ("accept", lambda r: _fmt(r["acceptance_rate"], ".0%")),
    ("lossless", _lossless),
    ("predicted", _predicted),
    ("efficiency", _efficiency),
]


OVERALL_COLUMNS = COLUMNS[:8]  # no cost model over all categories (step costs are per category)
CAPTION = "medians over prompts and repeats; [min-max] over the runs"


def table_rows(rows: list[dict], columns=COLUMNS) -> list[list[str]]:
    return [[fn(r) for _, fn in columns] for r in rows]


def _kinds(cfg: dict, category: str) -> str:
    """The prompts' kinds, with their sizes where a category has both (out-of-domain)."""
    prompts = [p for p in cfg["prompts"] if p.get("category") == category]
    sized = len({p.get("size") for p in prompts}) > 1
    return ", ".join(dict.fromkeys(f"{p.get('size') or '?'} {p['kind']}" if sized else p["kind"] for p in prompts))


def group_title(result: dict, group: dict) -> str:
    """``long: 9 prompts (function-body, ...), 9 cut to their last 374 tokens (context 512)``."""
    cfg = result["config"]
    title = f"{group['category']}: {len(group['prompts'])} prompts ({_kinds(cfg, group['category'])})"
    return title + (f"; {truncation_note(result, group)}" if group.get("truncated_prompts") else "")


def truncation_note(result: dict, group: dict) -> str:
    cfg = result["config"]
    return (f"{group['truncated_prompts']} of {len(group['prompts'])} longer than the model's "
            f"{cfg['context_length']}-token context allows with {cfg['max_new_tokens']} new tokens: "
            f"kept their last {cfg['max_prompt_tokens']} tokens")


def _headline(result: dict) -> str:
    cfg = result["config"]
    return (f"quickdraft bench: {Path(cfg['model_dir']).name} "
            f"(draft {Path(cfg['draft_dir']).name if cfg.get('draft_dir') else '-'}), {_backend(cfg)}, "
            f"k = {cfg['k']} ({cfg['k_source']}), {cfg['repeats']} repeat{'s' if cfg['repeats'] != 1 else ''}, "
            f"{cfg['max_new_tokens']} new tokens, "
            f"T={cfg['temperature']}")


def print_table(result: dict, console=None) -> None:
    """A table per category with its step costs, the headline table over all categories,
    then any mismatches."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 140))

    def show(title: str, rows: list[dict], columns) -> None:
        table = Table(title=escape(title), caption=escape(CAPTION))
        for name, _ in columns:
            table.add_column(escape(name), justify="left" if name in ("method", "settings") else "right",
                             overflow="fold")
        for r, cells in zip(rows, table_rows(rows, columns), strict=True):
            style = None if r.get("primary", True) else "dim"
            if r["lossless"] is False:
                style = "bold red"
            table.add_row(*(escape(c) for c in cells), style=style)
        console.print(table)

    console.print(_headline(result), highlight=False)
    for group in result["results"]:
        show(group_title(result, group), group["rows"], COLUMNS)
        for line in summary_lines(result, group):
            console.print(line, highlight=False)
    show(f"all categories ({', '.join(g['category'] for g in result['results'])}): "
         f"{len(result['config']['prompts'])} prompts", result["overall"]["rows"], OVERALL_COLUMNS)
    for line in result.get("mismatches", []):
        console.print(f"[bold red]{escape(line)}[/]")
    for line in agreement_lines(result["overall"]["rows"]):
        console.print(line, highlight=False)


def summary_lines(result: dict, group: dict) -> list[str]:
    """Step costs of a category and where a step's time goes (an overhead too noisy to
    trust is said so, not printed)."""
    costs = group["step_costs"]
    k = result["config"]["k"]
    verify = costs["t_verify"]
    lines = [
        f"step costs (median): target 1 token {costs['t_ar'] * 1e3:.2f} ms, draft step "
        f"{costs['t_draft'] * 1e3:.2f} ms, target verify of {k + 1} tokens "
        f"{float(verify.get(str(k + 1), float('nan'))) * 1e3:.2f} ms",
    ]
    for r in group["rows"]:
        b = r.get("step_breakdown")
        if not b or "measured_step_seconds" not in b:
            continue
        overhead = f"overhead {TOO_NOISY}" if _noisy(r, "overhead") else (
            f"overhead {b['overhead_seconds'] * 1e3:.2f} ms")
        if r["method"] == "draft" and r.get("primary"):
            lines.append(
                f"draft k={b['k']} step: {b['measured_step_seconds'] * 1e3:.2f} ms measured = draft "
                f"{b['draft_seconds'] * 1e3:.2f} + verify {b['verify_seconds'] * 1e3:.2f} ms + {overhead}"
            )
        if r["method"] == "ar":
            lines.append(
                f"ar step: {b['measured_step_seconds'] * 1e3:.2f} ms measured = target "
                f"{b['verify_seconds'] * 1e3:.2f} ms + {overhead}"
            )
    return lines


def write_json(result: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")


def markdown_table(rows: list[dict], columns=COLUMNS) -> list[str]:
    lines = ["| " + " | ".join(n for n, _ in columns) + " |",
             "|" + "|".join("---" if n in ("method", "settings") else "---:" for n, _ in columns) + "|"]
    for cells in table_rows(rows, columns):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def _step_table(group: dict) -> list[str]:
    steps = [r for r in group["rows"] if r.get("step_breakdown") and "measured_step_seconds" in r["step_breakdown"]]
    if not steps:
        return []
    lines = ["", "Per step (ms; overhead = measured step - modelled draft and verify calls):", "",
             "| row | draft | verify | overhead | measured step | tau | speedup | predicted |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in steps:
        b = r["step_breakdown"]
        overhead = "too noisy" if _noisy(r, "overhead") else f"{b['overhead_seconds'] * 1e3:.2f}"
        lines.append(
            f"| {r['label']} | {b.get('draft_seconds', 0.0) * 1e3:.2f} | {b['verify_seconds'] * 1e3:.2f} | "
            f"{overhead} | {b['measured_step_seconds'] * 1e3:.2f} | "
            f"{_fmt(r['mean_accepted_tokens'])} | {_fmt(r['speedup'], '.2f', 'x')} | {_predicted(r)} |")
    costs = group["step_costs"]
    lines += ["", "Target pass over n tokens (ms): " + ", ".join(
        f"{n}: {float(v) * 1e3:.2f}" for n, v in costs["t_verify"].items())]
    if costs.get("draft_burst"):
        lines.append("j consecutive draft steps after a target pass (ms): " + ", ".join(
            f"{n}: {float(v) * 1e3:.2f}" for n, v in costs["draft_burst"].items()))
    return lines


def markdown_report(result: dict, plots: list[str] | None = None, command: str | None = None) -> str:
    cfg = result["config"]
    m = result["machine"]
    groups = result["results"]
    counts = ", ".join(f"{g['category']} {len(g['prompts'])}" for g in groups)
    lines = [
        "# quickdraft benchmark",
        "",
        f"- target: {_model_label(cfg['model_dir'])}",
        f"- draft: {_model_label(cfg.get('draft_dir'))}",
        f"- runtime: {_backend(cfg)}",
        f"- machine: {m.get('cpu', m['processor'])}, {m['cpu_count']} CPUs, "
        f"{m.get('threads', m.get('torch_threads'))} torch threads, "
        f"{m['platform']}; python {m['python']}, torch {m['torch']}, transformers {m['transformers']}",
        f"- date: {m['date_utc']}",
        f"- prompts: {len(cfg['prompts'])} in {len(groups)} categories "
        f"({counts}), "
        f"repeats {cfg['repeats']}, max new tokens {cfg['max_new_tokens']}, temperature {cfg['temperature']}, "
        f"k = {cfg['k']} ({cfg['k_source']}), batch 1",
    ]
    if command:
        lines.append(f"- command: `{command}`")
    lines += ["", f"{CAPTION[0].upper()}{CAPTION[1:]} (the JSON has the quartiles too).",
              "", "## All categories (headline)", ""]
    lines += markdown_table(result["overall"]["rows"], OVERALL_COLUMNS)
    for group in groups:
        lines += ["", f"## {group_title(result, group)}", ""]
        lines += markdown_table(group["rows"])
        lines += [""] + [f"- {line}" for line in summary_lines(result, group)]
        lines += _step_table(group)
    pp = [r for r in result["overall"]["rows"] if r.get("per_position_acceptance")]
    if pp:
        lines += ["", "## Per-position acceptance (all categories)", ""]
        for r in pp:
            lines.append(f"- {r['label']}: " + ", ".join(f"{a:.2f}" for a in r["per_position_acceptance"]))
    if agreement_lines(result["overall"]["rows"]):
        lines += ["", "## llama.cpp against ar (greedy text)", ""]
        lines += [f"- {x}" for x in agreement_lines(result["overall"]["rows"])]
    if result.get("llama_cpp"):
        lc = result["llama_cpp"]
        lines += ["", f"llama.cpp: {lc['version']}, {lc['threads']} threads, KV cache {lc['kv_cache']}; "
                      f"target `{lc['target_gguf']}`, draft `{lc['draft_gguf']}`"]
    if result.get("warnings"):
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in result["warnings"]]
    if result.get("mismatches"):
        lines += ["", "## Mismatches against ar", ""] + [f"- {x}" for x in result["mismatches"]]
    lines += ["", "## Definitions", ""]
    lines += [f"- **{k}**: {v}" for k, v in cfg.get("definitions", {}).items()]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def write_markdown(result: dict, path: str | Path, plots: list[str] | None = None,
                   command: str | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown_report(result, plots, command))
