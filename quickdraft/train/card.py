"""Model cards (``README.md``), registry metadata (``quickdraft.json``) and loss curves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .presets import DRAFT_NAME, TARGET_NAME
from .tracker import TB_DIR, log_scalars, read_scalars

DESCRIPTIONS = {
    "target": "Llama-architecture target trained by quickdraft on the Python standard library "
              "(default embedded target; offline speculative decoding).",
    "draft": f"1-layer Llama-architecture draft distilled from {TARGET_NAME} "
             "(KL(target || draft)) on the Python standard library.",
}

TOKENIZER_WHY = (
    "Byte-level BPE, vocabulary 8192, trained with `tokenizers` on the train split. "
    "Python source has a small alphabet and very regular lexemes, so 8192 merges already "
    "capture indentation runs, keywords and common identifiers; a small vocabulary keeps the "
    "(tied) embedding table small, so most of a ~20M-parameter model's weights sit in the "
    "transformer blocks rather than in embeddings, and the output softmax stays cheap for "
    "CPU decoding. One special token, `<|endoftext|>` (id 0), is bos, eos and pad and "
    "separates documents. No normalizer, byte-level pre-tokenizer without prefix space and "
    "byte-level decoder: `decode(encode(s)) == s` for any string; no bos is added by default."
)

CORPUS_WHY = (
    "The `.py` files of the interpreter's standard library (excluding `site-packages`). The "
    "test suites (`test/`, `tests/`, `idlelib/idle_test/`) are excluded: they are about 62% "
    "of the stdlib's `.py` bytes (19.4 of 31.5 MB in CPython 3.11), highly repetitive (assertion tables, generated data, "
    "deliberately malformed code) and would dominate a training budget of a few million "
    "tokens, while library code is closer to what users ask a drafting model to continue."
)


def _axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, 3.6), dpi=100)


def _save(fig, ax, png_path: Path, title: str, xlabel: str, ylabel: str) -> None:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)


LOG_FILE = "train_log.jsonl"


def read_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """A run's curves as ``{"train/loss": [(step, value), ...], ...}``: from its TensorBoard
    event files (``run_dir/tensorboard``), or from ``train_log.jsonl`` for runs logged
    before the tracker (the shipped embedded models')."""
    run_dir = Path(run_dir)
    if (run_dir / TB_DIR).is_dir():
        return read_scalars(run_dir / TB_DIR)
    curves: dict[str, list[tuple[int, float]]] = {}
    for line in (run_dir / LOG_FILE).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            group = rec.pop("event", "train")
            step = rec.pop("step", 0)
            for name, value in rec.items():
                if isinstance(value, (int, float)):
                    curves.setdefault(f"{group}/{name}", []).append((step, float(value)))
    return curves


def copy_run_log(work: Path, out: Path) -> None:
    """Put a run's log (JSON lines and TensorBoard event files) beside what it trained."""
    shutil.copyfile(Path(work) / LOG_FILE, Path(out) / LOG_FILE)
    if (Path(work) / TB_DIR).is_dir():
        shutil.copytree(Path(work) / TB_DIR, Path(out) / TB_DIR, dirs_exist_ok=True)


def log_eval(run_dir: Path, step: int, values: dict[str, float]) -> None:
    """Held-out figures after training, as ``eval/<name>`` at ``step`` in both logs."""
    with (Path(run_dir) / LOG_FILE).open("a") as f:
        f.write(json.dumps({"event": "eval", "step": step, **values}) + "\n")
    log_scalars(Path(run_dir) / TB_DIR, step, "eval", values)


def plot_loss(run_dir: Path, png_path: Path, title: str) -> None:
    """Training loss (cross-entropy, or its KL and CE parts when distilling) and the held-out
    loss, read from the run's logs in ``run_dir``."""
    curves = read_curves(run_dir)
    fig, ax = _axes()
    parts = [("train/ce", "train cross-entropy"), ("train/kl", "train KL(target||draft)")]
    for tag, label in parts if "train/kl" in curves else [("train/loss", "train cross-entropy")]:
        steps, values = zip(*curves[tag]) if curves.get(tag) else ((), ())
        ax.plot(steps, values, lw=1, label=label)
    for _, value in curves.get("eval/loss", []):
        ax.axhline(value, color="C3", ls="--", lw=1, label=f"val cross-entropy {value:.3f}")
    _save(fig, ax, png_path, title, "step", "nats / token")


def plot_charts(out: Path, title: str) -> None:
    """``loss_curve.png``, and ``acceptance_curve.png`` when the run probed its drafter."""
    plot_loss(out, out / "loss_curve.png", title)
    plot_acceptance(out, out / "acceptance_curve.png", title)


def log_lines(out: Path, report_json: bool = True) -> list[str]:
    """The card's lines that point at the run's logs and charts."""
    tb = f"; TensorBoard event files: `{TB_DIR}/` (`tensorboard --logdir {TB_DIR}`)" if (out / TB_DIR).is_dir() else ""
    report = "; every figure: `train_report.json`" if report_json else ""
    lines = [f"- log: `{LOG_FILE}`{tb}; loss curve: `loss_curve.png`{report}", "", "![loss curve](loss_curve.png)"]
    if (out / "acceptance_curve.png").exists():
        lines += ["", "Acceptance while training (greedy decoding of held-out prompts with the drafter "
                  "as it was at each step):", "", "![acceptance while training](acceptance_curve.png)"]
    return lines


def plot_acceptance(run_dir: Path, png_path: Path, title: str) -> bool:
    """Acceptance while training (``probe/*``): mean accepted tokens per target pass, and
    how often each draft position is accepted. False (no chart) when the run did not probe."""
    curves = read_curves(run_dir)
    if not curves.get("probe/mean_accepted_tokens"):
        return False
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    left.plot(*zip(*curves["probe/mean_accepted_tokens"]), marker="o", ms=3)
    left.set(xlabel="step", ylabel="tokens per target pass", title="mean accepted tokens")
    positions = sorted((t for t in curves if t.startswith("probe/accept_rate/pos")), key=lambda t: int(t[21:]))
    for tag in positions:
        right.plot(*zip(*curves[tag]), lw=1, label=f"position {tag[21:]}")
    right.set(xlabel="step", ylabel="accepted when drafted", title="acceptance per draft position", ylim=(0, 1))
    if positions:  # a probe that drafted nothing has no position to label
        right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return True


def position_table(buckets: list[dict], before: list[dict] | None = None,
                   before_label: str = "before") -> list[str]:
    """Markdown rows of loss by position in the context window (optionally against ``before``)."""
    head = "| positions | tokens | cross-entropy |" + (f" {before_label} |" if before else "")
    rows = [head, "|---|---:|---:|" + ("---:|" if before else "")]
    for i, b in enumerate(buckets):
        extra = f" {_fmt(before[i]['loss'])} |" if before and i < len(before) else ""
        rows.append(f"| {b['start']}-{b['end']} | {b['tokens']:,} | {_fmt(b['loss'])} |{extra}")
    return rows


def plot_position_buckets(curves: dict[str, list[dict]], png_path: Path, title: str) -> None:
    """Validation loss per position bucket, one line per model: is long context learned?"""
    fig, ax = _axes()
    for label, buckets in curves.items():
        names = [f"{b['start']}-{b['end']}" for b in buckets]
        ax.plot(names, [b["loss"] for b in buckets], marker="o", label=label)
    _save(fig, ax, png_path, title, "position in the context window (tokens)",
          "validation nats / token")


EVAL_KEYS = ("tokens", "loss", "bpb", "greedy_agreement", "kl_from_target", "position_buckets")


def record_eval(model_dir: Path, evaluation: dict, seq_len: int) -> None:
    """Keep a model's held-out figures in its ``quickdraft.json`` (``eval``): what the card
    reports, readable by tools and tests (e.g. which context length was measured)."""
    path = Path(model_dir) / "quickdraft.json"
    meta = json.loads(path.read_text()) if path.exists() else {}
    meta["eval"] = {"seq_len": seq_len, **{k: evaluation[k] for k in EVAL_KEYS if k in evaluation}}
    path.write_text(json.dumps(meta, indent=2) + "\n")


def write_meta(model_dir: Path, role: str, params: int, description: str) -> None:
    meta = {
        "name": model_dir.name,
        "role": role,
        "default": role == "target",
        "draft": DRAFT_NAME if role == "target" else None,
        "params": int(params),
        "description": description,
    }
    if role == "draft":
        meta["target"] = TARGET_NAME
    (model_dir / "quickdraft.json").write_text(json.dumps(meta, indent=2) + "\n")


def _fmt_arch(cfg: dict) -> str:
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings"]
    return "\n".join(f"| {k} | {cfg.get(k)} |" for k in keys)


def write_card(model_dir: Path, role: str, results: dict) -> None:
    """README.md for one model of the embedded family from the shared ``results`` dict (see
    pipeline), and its loss-by-position plot when the results have one."""
    cfg = json.loads((model_dir / "config.json").read_text())
    _plot_position_loss(model_dir, role, results)
    text = _join_sections(
        _intro_section(model_dir.name, role, results),
        _architecture_section(results[role]["params"], cfg),
        _results_section(role, results),
        _decode_cost_section(results.get("decode_ms", {})),
        _training_section(role, results, cfg),
        ["## Tokenizer", "", TOKENIZER_WHY],
        _corpus_section(results),
    )
    (model_dir / "README.md").write_text(text)


def _join_sections(*sections: list[str]) -> str:
    """Markdown lines of each section, a blank line after each (so the file ends in one)."""
    return "\n".join(line for section in sections for line in (*section, ""))


def _intro_section(name: str, role: str, results: dict) -> list[str]:
    """Title, which model of the pair this is, and what the family is for."""
    what = (f"The default **target** model of quickdraft's embedded family; its paired draft is "
            f"`{DRAFT_NAME}`." if role == "target" else
            f"The **draft** model of quickdraft's embedded family, distilled from `{TARGET_NAME}` "
            "(loss = KL(target || draft) at temperature 1"
            f" + {results['preset']['ce_weight']} x CE; target frozen).")
    return [
        f"# {name}",
        "",
        what,
        "",
        "A small Llama-architecture causal LM trained by `quickdraft train` on the Python "
        "standard library, so speculative decoding works offline. It continues code with "
        "Python-shaped text (indentation, `def`/`class`, stdlib identifiers); at this size and "
        "a CPU training budget of about an hour it is not a useful code generator on its own, "
        "and it is not a general-purpose model. Its job is to be a cheap, real target/draft pair.",
    ]


def _architecture_section(params: int, cfg: dict) -> list[str]:
    """Parameter count, the embedding table's share of it, and the config's shape fields."""
    embedding = cfg["vocab_size"] * cfg["hidden_size"]
    return [
        "## Architecture",
        "",
        f"`LlamaForCausalLM`, **{params:,} parameters** (all, embeddings included; "
        "tied input/output embeddings), weights stored as bf16 safetensors, trained in fp32. "
        f"The embedding table is {embedding:,} of them ({embedding / params:.0%}).",
        "",
        "| field | value |", "|---|---|", _fmt_arch(cfg),
    ]


def _results_section(role: str, results: dict) -> list[str]:
    """The metrics table, loss by position (when measured) and how bits per byte are counted."""
    lines = ["## Results", "", *_metrics_table(role, results)]
    buckets = results[role].get("val", {}).get("position_buckets")
    if buckets:
        lines += ["", *_position_subsection(buckets, _buckets_before(role, results),
                                            results["preset"]["seq_len"])]
    return [*lines, "", _bpb_note(results)]


def _metrics_table(role: str, results: dict) -> list[str]:
    """Validation and train loss and bits per byte; a draft's agreement with the target; the
    code-only validation rows when the results have them."""
    ev, tr = results[role].get("val", {}), results[role].get("train_eval", {})
    rows = [
        "| metric | value |", "|---|---|",
        f"| validation loss (nats/token) | {ev.get('loss', float('nan')):.4f} |",
        f"| validation bits per byte | {ev.get('bpb', float('nan')):.4f} |",
        f"| train loss (nats/token, {tr.get('tokens', 0):,} sampled train tokens) | "
        f"{tr.get('loss', float('nan')):.4f} |",
        f"| train bits per byte | {tr.get('bpb', float('nan')):.4f} |",
        f"| validation tokens scored | {ev.get('tokens', 0):,} ({ev.get('bytes', 0):,} bytes) |",
    ]
    if role == "draft" and "kl_from_target" in ev:
        rows += [
            f"| KL(target \\|\\| draft) on validation | {ev['kl_from_target']:.4f} |",
            f"| greedy agreement with target (validation, teacher-forced) | "
            f"{ev['greedy_agreement']:.2%} |",
        ]
    return rows + _code_only_rows(role, results.get("val_code_only", {}))


def _code_only_rows(role: str, code: dict) -> list[str]:
    """Metrics rows on the validation split without its generated documentation file."""
    if role not in code:
        return []
    c = code[role]
    rows = [
        f"| validation loss, code only ({code['files']} files, {code['bytes']:,} bytes; "
        f"shipped bf16 weights) | {c['loss']:.4f} |",
        f"| validation bits per byte, code only | {c['bpb']:.4f} |",
    ]
    if "greedy_agreement" in c:
        rows += [f"| greedy agreement with target, code only | {c['greedy_agreement']:.2%} |"]
    return rows


def _buckets_before(role: str, results: dict) -> list[dict] | None:
    """Loss by position of the model this one was continued from (None: trained from scratch)."""
    return results.get(f"{role}_init_val", {}).get("position_buckets")


def _plot_position_loss(model_dir: Path, role: str, results: dict) -> None:
    """``position_loss.png`` for the card: this model's validation loss by position, and the
    model it was continued from; nothing when the results have no buckets."""
    buckets = results[role].get("val", {}).get("position_buckets")
    if not buckets:
        return
    before = _buckets_before(role, results)
    curves = {model_dir.name: buckets}
    if before:
        curves[f"before ({results.get(f'{role}_init', 'init')})"] = before
    plot_position_buckets(curves, model_dir / "position_loss.png",
                          f"{model_dir.name}: validation loss by position")


def _position_subsection(buckets: list[dict], before: list[dict] | None, seq_len: int) -> list[str]:
    """Loss by position in the context window: the table and the plot."""
    return [
        f"### Loss by position (windows of {seq_len} tokens)",
        "",
        "Validation cross-entropy by position in the context window: flat or falling means "
        "the model uses the longer context instead of degrading past a shorter training "
        "window." + (" The last column is the model this one was continued from, scored "
                     "the same way." if before else ""),
        "",
        *position_table(buckets, before, "before"),
        "",
        "![loss by position](position_loss.png)",
    ]


def _bpb_note(results: dict) -> str:
    """How bits per byte are counted, and why there are code-only rows."""
    code, split = results.get("val_code_only", {}), results["corpus"]["split"]
    note = ("bits per byte = total validation nats / (ln 2 x UTF-8 bytes of the predicted "
            "tokens); over the whole validation split the byte count is its UTF-8 size.")
    if not code.get("excluded"):
        return note
    return (note + f" The split is {split['val_files']} whole files; "
            f"{', '.join(code['excluded'])} (generated English documentation inside a Python "
            f"string, {split['val_bytes'] - code['bytes']:,} bytes) is most of it, "
            "so the code-only rows report the remaining files separately.")


def _decode_cost_section(timing: dict) -> list[str]:
    """Per-token decode time of both models and their ratio, once the draft is timed."""
    if not timing:
        return ["## Decode cost", "", "(measured once the draft is trained)"]
    return [
        "## Decode cost",
        "",
        "Per-token cached decode step (batch 1, KV cache, fp32, "
        f"{timing.get('threads')} threads, {timing.get('steps')} steps after a "
        f"{timing.get('prompt_len')}-token prompt, median of {timing.get('repeats')} "
        "interleaved rounds), measured by `quickdraft.train.trainer.measure_decode` on the "
        "training machine:",
        "",
        "| model | ms / token |", "|---|---|",
        f"| {TARGET_NAME} | {timing['target']:.3f} |",
        f"| {DRAFT_NAME} | {timing['draft']:.3f} |",
        "",
        f"draft / target cost ratio: **{timing['draft'] / timing['target']:.3f}** "
        f"(target is {timing['target'] / timing['draft']:.2f}x the draft).",
    ]


def _training_section(role: str, results: dict, cfg: dict) -> list[str]:
    """What was trained how: init, schedule, time, hardware, the command and the log."""
    r = results[role]
    # Each model records the command that trained it: re-running one stage must not stamp
    # its command on the other model's card.
    command = r.get("command", results["command"])
    seq_len = results["preset"]["seq_len"]
    init = results.get(f"{role}_init")
    return [
        "## Training",
        "",
        *([f"- continued from `{init}` (its weights and tokenizer) at windows of {seq_len} "
           f"tokens, so that every position of the {cfg['max_position_embeddings']}-token "
           "context is trained"] if init else []),
        f"- steps: {r['steps']}, batch {r['batch_size']} x {seq_len} tokens "
        f"({r['tokens']:,} tokens seen), AdamW (betas 0.9/0.95, weight decay "
        f"{r['weight_decay']}), peak lr {r['lr']}, {r['warmup']} warmup steps then cosine to "
        f"10%, grad clip {r['grad_clip']}, seed {results['seed']}",
        _training_time_line(role, results),
        _hardware_line(results["hardware"], command),
        f"- command: `{command}`",
        "- training log: `train_log.jsonl`; loss curve: `loss_curve.png`",
        "",
        "![loss curve](loss_curve.png)",
    ]


def _training_time_line(role: str, results: dict) -> str:
    """Optimizer time and the final train-batch loss; the stage's wall time when recorded."""
    r = results[role]
    wall = results.get("stage_wall_s", {})
    return (f"- training time: {r['train_time_s'] / 60:.1f} min of optimizer steps "
            f"(final train-batch {'loss' if role == 'target' else 'objective KL + CE term'} "
            f"{r['final_train_loss']:.4f})"
            + (f"; whole stage incl. data loading and evaluation: {wall[role] / 60:.1f} min wall"
               if role in wall else ""))


def _hardware_line(hw: dict, command: str) -> str:
    """The machine and library versions; how ``--threads auto`` ran when the command used it."""
    return (f"- hardware: {hw['platform']}, {hw['processor'] or hw['machine']}, "
            f"{hw['cpu_count']} CPUs, torch {hw['torch']} ({hw['threads']} threads), "
            f"transformers {hw['transformers']}, Python {hw['python']}"
            + ("; `--threads auto`: each step ran with 1 or 2 threads, whichever was measured "
               "faster (the machine was shared; the `threads` field of each log line records it)"
               if "--threads auto" in command else ""))


def _corpus_section(results: dict) -> list[str]:
    """Why the stdlib, how it is split, its manifest and the packed token counts."""
    manifest = results["corpus"]
    return [
        "## Corpus",
        "",
        CORPUS_WHY,
        " Split: whole files, validation iff `sha256(relative path)` (first 8 bytes as a "
        f"fraction of 2^64) < {manifest['split']['method'].split('< ')[-1]}.",
        "",
        "```json",
        json.dumps(manifest, indent=2),
        "```",
        "",
        f"Packed streams: {results['stream']['train_tokens']:,} train tokens, "
        f"{results['stream']['val_tokens']:,} validation tokens.",
    ]


def _fmt(v, spec: str = ".4f") -> str:
    return "n/a" if v is None else format(v, spec)


def write_distill_card(out: Path, r: dict) -> None:
    """README.md of a student distilled by ``quickdraft train draft`` (see ``draft.py``)."""
    cfg = json.loads((out / "config.json").read_text())
    tr, data, hw = r["train"], r["data"], r["hardware"]
    st = r["stage"]
    ev, ms = r.get("heldout"), r.get("decode_ms")
    status = (f"**Stopped by Ctrl-C at step {tr['steps_done']} of {st['steps']}** (resume with "
              "the same command and `--resume`); held-out figures are measured at the end."
              if tr["interrupted"] else f"{tr['steps_done']} of {st['steps']} steps done.")
    lines = [
        f"# {out.name}",
        "",
        f"A {r['kind']} model for the target `{r['target']}` ({r['target_params']:,} "
        f"parameters), distilled by `quickdraft train draft`: "
        + (f"loss = {r['kl_weight']} x KL(target || draft) at temperature 1 + {r['ce_weight']} x CE, the "
           "target frozen in fp32. " if r["kl_weight"] else
           "hard-label cross-entropy on the data's own next tokens (no target pass; on text the target "
           "generated itself, `quickdraft train data`), the head scoring only the draft vocabulary. ")
        + (f"Its loss {answers_only(r).removeprefix(', ')}. " if answers_only(r) else "")
        + "It uses the target's tokenizer (files copied verbatim). "
        + ("Initialised from `" + r["init"] + "`." if r["init"] else
           f"Initialised from the target's own weights ({r['from_target']}); its embedding / LM-head "
           "matrix is the target's, frozen while training and not stored here: loading fills it "
           "from the loaded target (same tensor; `quickdraft.json` `shared_embeddings` holds its "
           "sha256, and another target is refused)." if r.get("from_target") else
           "Trained from a random initialisation.") + f" {status}",
        "",
        "`quickdraft.json` names the target; `quickdraft generate --model TARGET` finds this "
        "draft through it and the user's pairing file (see `models/registry.find_draft_dir`).",
        "",
        "## Architecture",
        "",
        f"`{cfg.get('architectures', ['?'])[0]}`, **{r['params']:,} parameters** (tied "
        "embeddings counted once" + (f"; {r['stored_params']:,} of them stored here, the rest are the "
                                     "target's embeddings" if r.get("stored_params") else "")
        + "), stored as bf16 safetensors, trained in fp32.",
        "",
        "| field | value |", "|---|---|", _fmt_arch(cfg),
        "",
        "## Held-out results",
        "",
    ]
    if ev:
        lines += [
            f"Teacher-forced on {ev['tokens']:,} held-out tokens in windows of {r['seq_len']}, "
            "with the saved weights:",
            "",
            "| metric | value |", "|---|---|",
            f"| greedy agreement with the target (argmax equal) | {ev['greedy_agreement']:.2%} |",
            *([f"| the same, scoring only the draft vocabulary ({r['draft_vocab']['size']:,} most frequent "
               f"tokens, {r['draft_vocab']['covers']:.1%} of the training tokens; what the runtime drafts with) | "
               f"{ev['greedy_agreement_draft_vocab']:.2%} |"] if "greedy_agreement_draft_vocab" in ev else []),
            f"| KL(target \\|\\| draft) (nats/token) | {ev['kl_from_target']:.4f} |",
            f"| cross-entropy (nats/token) | {ev['loss']:.4f} |",
            "",
            *position_table(ev["position_buckets"]),
        ]
    else:
        lines += ["(not measured: training was stopped)"]
    lines += ["", "## Decode cost", ""]
    if ms:
        lines += [
            f"Cached decode step, batch 1, fp32, {ms['threads']} threads, {ms['steps']} steps "
            f"after a {ms['prompt_len']}-token prompt, median of {ms['repeats']} interleaved "
            "rounds (`trainer.measure_decode`, transformers) on the training machine:",
            "",
            "| model | ms / token |", "|---|---:|",
            f"| target | {ms['target']:.3f} |", f"| draft | {ms['draft']:.3f} |",
            "",
            f"draft / target cost ratio: **{ms['ratio']:.3f}**",
        ]
    else:
        lines += ["(not measured: training was stopped)"]
    lines += [
        "",
        "## Training",
        "",
        f"- {tr['steps_done']} steps of batch {st['batch_size']} x {r['seq_len']} tokens "
        f"({tr['tokens']:,} tokens), AdamW (betas 0.9/0.95, weight decay "
        f"{st['weight_decay']}), peak lr {st['lr']}, {st['warmup']} warmup steps then cosine "
        f"to {st['min_lr_ratio']:.0%}, grad clip {st['grad_clip']}, seed {r['seed']}",
        f"- time: {tr['train_time_s'] / 60:.1f} min of optimizer steps; final train objective "
        f"{_fmt(tr['final_train_loss'])}",
        f"- hardware: {hw['platform']}, {hw['cpu_count']} CPUs, torch {hw['torch']}, "
        f"transformers {hw['transformers']}, Python {hw['python']}",
        f"- command: `{r['command']}`",
        *log_lines(out, report_json=False),
        "",
        "## Data",
        "",
        f"{data['files']:,} files, {data['bytes']:,} bytes from {', '.join(data['sources'])} "
        f"({data['skipped']} files or JSONL lines skipped: not UTF-8, binary or without a "
        "`text` field). Held-out documents are never trained on.",
        "",
        "| split | documents | bytes | tokens |", "|---|---:|---:|---:|",
        f"| train | {data['split']['train_documents']:,} | {data['split']['train_bytes']:,} | "
        f"{data['split']['train_tokens']:,} |",
        f"| held-out | {data['split']['heldout_documents']:,} | "
        f"{data['split']['heldout_bytes']:,} | {data['split']['heldout_tokens']:,} |",
        "",
        f"Split: {data['split']['method']}. sha256 of the documents: `{data['sha256']}`. "
        "Every file with its size: `data_manifest.json`.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def write_exit_head_card(out: Path, r: dict) -> None:
    """README.md of an exit head trained by ``quickdraft train exit-head`` (see ``exit_head.py``)."""
    tr, st = r["train"], r["stage"]
    ev, base = r.get("heldout"), r.get("heldout_shared_head")
    parts = ("one extra transformer block (initialised from the target's layer "
             f"{r['exit_layer']}), then " if r["extra_block"] else "")
    status = (f"**Stopped by Ctrl-C at step {tr['steps_done']} of {st['steps']}** (resume with the same "
              "command and `--resume`)." if tr["interrupted"] else f"{tr['steps_done']} of {st['steps']} steps done.")
    lines = [
        f"# {out.name}",
        "",
        f"An early-exit head for the target `{r['target']}` ({r['target_params']:,} parameters, "
        f"{r['n_layers']} layers): it reads the target's residual stream after layer {r['exit_layer']} and "
        f"predicts the next token with {parts}a tuned-lens translator (h + A h + b) and its own final norm in "
        "front of the target's LM head (shared, not stored here). "
        f"**{r['params']:,} parameters**, stored as bf16 safetensors; distilled with loss = {r['kl_weight']} x "
        f"KL(target || head) at temperature 1 + {r['ce_weight']} x CE, the target frozen{teacher_passes(r)}"
        f"{answers_only(r)}. {status}",
        "",
        "`config.json` records the exit layer and the target's name and fingerprint; "
        "`quickdraft generate --method early-exit --draft THIS_DIR` uses it and refuses it for another target."
        + (f" Its draft steps score only the {r['draft_vocab']['size']:,} tokens most frequent in the training "
           f"text (`draft_vocab.json`, {r['draft_vocab']['covers']:.1%} of it), through the target's LM head rows "
           "for them: a cheaper step, the same output (`--draft-vocab N` picks another size, 0 all)."
           if r.get("draft_vocab", {}).get("size") else ""),
        "",
        "## Held-out results",
        "",
    ]
    if ev:
        lines += [
            f"Teacher-forced on {ev['tokens']:,} held-out tokens in windows of {r['seq_len']}, saved weights:",
            "",
            f"| head after layer {r['exit_layer']} | greedy agreement with the target | KL(target \\|\\| head) | "
            "cross-entropy |",
            "|---|---:|---:|---:|",
            f"| this head | {ev['greedy_agreement']:.2%} | {ev['kl_from_target']:.4f} | {ev['loss']:.4f} |",
            f"| shared final norm + LM head (untrained) | {base['greedy_agreement']:.2%} | "
            f"{base['kl_from_target']:.4f} | {base['loss']:.4f} |",
            "",
        ]
    else:
        lines += ["(not measured: training was stopped)", ""]
    lines += training_and_data_sections(r, out)
    (out / "README.md").write_text("\n".join(lines))


def training_and_data_sections(r: dict, out: Path) -> list[str]:
    """The "Training" and "Data" sections of a card in ``out`` for a part trained on a frozen
    target (an exit head, heads): steps, optimizer, time, hardware, command, logs, data."""
    tr, data, hw, st = r["train"], r["data"], r["hardware"], r["stage"]
    return [
        "## Training",
        "",
        f"- {tr['steps_done']} steps of batch {st['batch_size']} x {r['seq_len']} tokens ({tr['tokens']:,} tokens), "
        f"AdamW (betas 0.9/0.95, weight decay {st['weight_decay']}), peak lr {st['lr']}, {st['warmup']} warmup "
        f"steps then cosine to {st['min_lr_ratio']:.0%}, grad clip {st['grad_clip']}, seed {r['seed']}",
        f"- time: {tr['train_time_s'] / 60:.1f} min of optimizer steps; final train objective "
        f"{_fmt(tr['final_train_loss'])}",
        f"- hardware: {hw['platform']}, {hw['cpu_count']} CPUs{', ' + hw['gpu'] if hw.get('gpu') else ''}, "
        f"torch {hw['torch']}, Python {hw['python']}",
        f"- command: `{r['command']}`",
        *log_lines(out),
        "",
        "## Data",
        "",
        f"{data['files']:,} files, {data['bytes']:,} bytes from {', '.join(data['sources'])}; "
        f"{data['split']['train_tokens']:,} train / {data['split']['heldout_tokens']:,} held-out tokens "
        f"(split: {data['split']['method']}; held-out documents are never trained on). "
        + (f"{len(data['held_out'])} documents that ask a bench prompt were left out (quickdraft/train/holdout.py). "
           if data.get("held_out") else "")
        + "Every file: `data_manifest.json`.",
        "",
    ]


def _before_header(r: dict) -> str:
    """The held-out table's extra column for heads trained on from ``--init``: the same
    held-out windows scored with the starting weights."""
    if not r.get("init_heldout_agreement"):
        return ""
    name = Path(r["init"]["path"]).name
    return f" at the start (`{name}`'s own proposals) |" if r["init"].get("draft") else f" before (`--init {name}`) |"


def init_line(r: dict) -> list[str]:
    """A card's line naming the weights training started from (``--init``), if any."""
    init = r.get("init")
    if not init:
        return []
    if init.get("draft"):
        return [f"Started as the draft model `{init['path']}` (`model.safetensors` sha256 {init['sha256'][:12]}...): "
                "its embedding, layer, final norm and LM head rows, with an fc that passed its embedding through "
                "and ignored the feature, so that it proposed what the draft does; the held-out table scores that "
                "start and the result on the same windows.", ""]
    return [f"Started from `{init['path']}` (`model.safetensors` sha256 {init['sha256'][:12]}...) and trained on "
            "from there: the held-out table scores both on the same windows.", ""]


def write_heads_card(out: Path, r: dict) -> None:
    """README.md of heads trained by ``quickdraft train heads`` (see ``heads.py``)."""
    tr, st = r["train"], r["stage"]
    status = (f"**Stopped by Ctrl-C at step {tr['steps_done']} of {st['steps']}** (resume with the same "
              "command and `--resume`)." if tr["interrupted"] else f"{tr['steps_done']} of {st['steps']} steps done.")
    lines = [
        f"# {out.name}",
        "",
        f"{r['num_heads']} Medusa heads for the target `{r['target']}` ({r['target_params']:,} parameters): each "
        "is one residual block (x + SiLU(W x)) on the target's final hidden state, read by the target's own final "
        "norm and LM head (shared, not stored here); head i predicts the token i + 2 places ahead. "
        f"**{r['params']:,} parameters**, stored as bf16 safetensors (trained in fp32); distilled from the frozen target{teacher_passes(r)} with loss = sum over "
        f"heads of 0.8^i x ({r['kl_weight']} x KL(target || head) + {r['ce_weight']} x CE){answers_only(r)}. {status}",
        "",
        "`config.json` records the target's name and fingerprint; `quickdraft generate --method medusa --heads "
        "THIS_DIR` uses them (verified as a token tree: output identical to the target's) and refuses them for "
        "another target.",
        "",
        *init_line(r),
        "## Held-out results",
        "",
    ]
    agreement = r.get("heldout_agreement")
    if agreement:
        before = r.get("init_heldout_agreement")
        lines += ["Teacher-forced top-1 agreement of each head with the target's own greedy token at its depth"
                  f"{' (on its answers)' if r.get('loss_on') == 'answers' else ''}:",
                  "", "| head | predicts | top-1 agreement |" + _before_header(r), "|---:|---|---:|" + "---:|" * bool(before)]
        lines += [f"| {i} | token t + {i + 2} | {a:.2%} |" + (f" {before[i]:.2%} |" if before else "")
                  for i, a in enumerate(agreement)]
        lines.append("")
    else:
        lines += ["(not measured: training was stopped)", ""]
    lines += training_and_data_sections(r, out)
    (out / "README.md").write_text("\n".join(lines))


def write_prophet_card(out: Path, r: dict) -> None:
    """README.md of a prophet trained by ``quickdraft train heads --kind prophet``."""
    tr, st, p = r["train"], r["stage"], r["prophet"]
    status = (f"**Stopped by Ctrl-C at step {tr['steps_done']} of {st['steps']}** (resume with the same "
              "command and `--resume`)." if tr["interrupted"] else f"{tr['steps_done']} of {st['steps']} steps done.")
    start = "through a bias-free linear map" if p["project"] else "as they are: same width"
    lines = [
        f"# {out.name}",
        "",
        f"A prophet transformer for the target `{r['target']}` ({r['target_params']:,} parameters): a causal "
        f"decoder of {p['n_layers']} layer(s), width {p['hidden_size']}, with its own token embeddings and tied LM "
        f"head, fed the target's final hidden states of the last {p['n_start']} accepted token(s) ({start}), then "
        f"tokens; it drafts a chain, its cache restarting each round. **{r['params']:,} parameters**, bf16 "
        f"safetensors (trained in fp32); trained on the frozen target{teacher_passes(r)} over windows of {p['n_start'] + p['gamma'] + 1} tokens "
        f"(gamma {p['gamma']}) with loss per position = {r['kl_weight']} x KL(target || prophet) + "
        f"{r['ce_weight']} x CE{answers_only(r)}. Started from the target's embeddings, final norm and last layer. {status}",
        "",
        "`config.json` records the target's name and fingerprint; `quickdraft generate --method prophet --heads "
        "THIS_DIR` uses it (verified as a chain, exactly like a draft model's: output identical to the target's "
        "when greedy, distributed as the target's when sampling) and refuses it for another target."
        + (f" When drafting, its LM head scores only the {r['draft_vocab']['size']:,} tokens most frequent in the "
           f"training text (`draft_vocab.json`, {r['draft_vocab']['covers']:.1%} of it): a cheaper step, the same "
           "output." if r.get("draft_vocab", {}).get("size") else ""),
        "",
        "## Held-out results",
        "",
    ]
    agreement = r.get("heldout_agreement")
    if agreement:
        lines += ["Teacher-forced top-1 agreement of the draft at each depth with the target's own greedy token "
                  f"(drafting as it runs, over its draft vocabulary{', on its answers' if r.get('loss_on') == 'answers' else ''}):",
                  "", "| depth | top-1 agreement |", "|---:|---:|"]
        lines += [f"| {i + 1} | {a:.2%} |" for i, a in enumerate(agreement)]
        lines.append("")
    else:
        lines += ["(not measured: training was stopped)", ""]
    lines += training_and_data_sections(r, out)
    (out / "README.md").write_text("\n".join(lines))


def teacher_passes(r: dict) -> str:
    """What a card says of the weights the target's passes ran on (``--teacher``)."""
    if r.get("teacher") == "quantized":
        return (" (its passes on its file's own quantized weights, as generation runs them on a CPU: "
                "`--teacher auto`)")
    return " in fp32"


def answers_only(r: dict) -> str:
    """What a heads card says of ``--loss-on answers`` (nothing for a run on every token)."""
    if r.get("loss_on") != "answers":
        return ""
    return (", counted on the target's answers alone (the self-distilled documents' prompts, which it never "
            "drafts, masked; `--loss-on answers`)")


def write_eagle_card(out: Path, r: dict) -> None:
    """README.md of an EAGLE drafter trained by ``quickdraft train heads --kind eagle``."""
    tr, st = r["train"], r["stage"]
    status = (f"**Stopped by Ctrl-C at step {tr['steps_done']} of {st['steps']}** (resume with the same "
              "command and `--resume`)." if tr["interrupted"] else f"{tr['steps_done']} of {st['steps']} steps done.")
    text = "the target's answers in the training text" if r.get("loss_on") == "answers" else "the training text"
    vocab = (f"a reduced LM head over the {r['draft_vocab']:,} most frequent tokens of {text} "
             f"({r['draft_vocab_covers']:.1%} of them; the target's own LM head rows, frozen, stored here; "
             "`draft_vocab.json` ranks them, so `--draft-vocab N` drafts with the N most frequent)"
             if r["draft_vocab"] else "the target's own LM head (shared, not stored here)")
    layer = r.get("layer")
    fused = r.get("feature_layers") or []
    states = (f"the target's hidden states after layers {', '.join(map(str, fused))} of the previous token, each at "
              "unit RMS, fused (EAGLE-3)" if len(fused) > 1 else "the target's final hidden state of the previous token")
    if layer:
        what = (f"fc([its own token embedding; {states}{' and' if len(fused) > 1 else ','} mapped to "
                f"{layer['hidden_size']} wide]) + one decoder layer {layer['hidden_size']} wide ({layer['n_heads']} "
                f"heads, MLP {layer['intermediate_size']}), read by its own final norm and LM head rows over the "
                f"{r['draft_vocab']:,} most frequent tokens of {text} ({r['draft_vocab_covers']:.1%} of them; "
                "`draft_vocab.json` ranks them). It predicts the target's next token and drafts by feeding its own "
                "outputs back")
        loss = f"loss = sum over steps k of 0.8^k x {r['kl_weight']} x soft CE against the target"
    else:
        what = (f"fc([token embedding; {states}]) + one decoder layer of the target's shape, read by the target's "
                f"final norm and {vocab}. It predicts the target's next final state and token, and drafts by feeding "
                "its own features back")
        loss = (f"loss = sum over steps k of 0.8^k x ({r['reg_weight']} x SmoothL1(feature) + {r['kl_weight']} x "
                "soft CE against the target)")
    loss += answers_only(r)
    if r.get("blind_share"):
        loss += (f", {r['blind_share']:.0%} of the windows read with zero features (as a chain drafts in the first "
                 "round, before the prefill)")
    lines = [
        f"# {out.name}",
        "",
        f"An EAGLE-style feature drafter for the target `{r['target']}` ({r['target_params']:,} parameters): "
        f"{what}. **{r['params']:,} parameters**, bf16 safetensors (trained in fp32); distilled from the frozen "
        f"target{teacher_passes(r)} with a training-time test of {r['ttt_steps']} unrolled steps, {loss}. {status}",
        "",
        "`config.json` records the target's name and fingerprint; `quickdraft generate --method eagle --heads "
        "THIS_DIR` uses it (a chain of its drafts on the CPU, EAGLE-2's dynamic token tree on a GPU, verified by "
        "the target: output identical to the target's) and "
        "refuses it for another target.",
        "",
        *init_line(r),
        "## Held-out results",
        "",
    ]
    agreement = r.get("heldout_agreement")
    if agreement:
        before = r.get("init_heldout_agreement")
        lines += ["Top-1 agreement with the target's own greedy token at each unrolled step (step k = a tree "
                  "node at depth k whose ancestors were right)"
                  f"{', on its answers' if r.get('loss_on') == 'answers' else ''}:", "",
                  "| step | top-1 agreement |" + _before_header(r), "|---:|---:|" + "---:|" * bool(before)]
        lines += [f"| {k} | {a:.2%} |" + (f" {before[k]:.2%} |" if before else "") for k, a in enumerate(agreement)]
        lines.append("")
    else:
        lines += ["(not measured: training was stopped)", ""]
    lines += training_and_data_sections(r, out)
    (out / "README.md").write_text("\n".join(lines))
