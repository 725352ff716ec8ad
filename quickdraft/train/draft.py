"""``quickdraft train draft``: distil a draft model for any target the runtime loads.

The draft is a small Llama (sized by ``--config``; by default from the target, so its
decode step costs about a tenth of the target's: :mod:`.sizing`) or an existing model
(``--init``) with the target's tokenizer, trained on KL(target || draft) + a small CE
term over the user's text. The result is a Hugging Face directory with the target's
tokenizer files, a model card and a ``quickdraft.json`` naming its target; the pair is
also recorded in the user's pairing file (``models.registry.register_draft``), so
``quickdraft generate --model TARGET`` finds the draft without writing into the target's
directory.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import torch

from ..machine import machine_info
from ..models.draft_vocab import VOCAB_FILE, default_vocab_size, read_draft_vocab, write_draft_vocab
from ..models.gguf import is_gguf
from ..models.loading import resolve_model_dir
from ..models.registry import META_FILE, PACKAGE_DIR, read_meta, register_draft
from ..models.shared_embed import EMBED_NAME, SHARED_KEY, shared_spec, shared_tensors
from ..pair import check_same_tokenizer
from . import card, sizing
from .distill import (
    DistillTask,
    check_settings,
    context_length,
    load_checkpoint_dir,
    load_teacher,
    resolve_device,
    tokenize,
    train,
)
from .presets import PRESETS, Arch, Stage
from .probe import draft_probe
from .textdata import TrainInputError, read_text_data
from .trainer import (
    build_llama,
    count_params,
    evaluate,
    llama_config,
    load_model_fp32,
    make_distill_loss,
    make_label_loss,
    measure_decode,
    save_model_bf16,
)

# --config names: the embedded family's draft and the tiny smoke-test draft
DRAFT_SIZES = {"small": PRESETS["default"].draft, "tiny": PRESETS["tiny"].draft}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "vocab.txt", "chat_template.jinja", "chat_template.json")


def draft_arch(spec: str, teacher=None, head_rows: int | None = None) -> Arch:
    """``auto`` (sized from ``teacher``, whose draft scores ``head_rows`` tokens:
    :func:`.sizing.default_draft_arch`), ``small``, ``tiny``, a JSON file or inline JSON
    with :class:`Arch` fields."""
    if spec == "auto":
        return sizing.default_draft_arch(teacher, head_rows)
    if spec in DRAFT_SIZES:
        return DRAFT_SIZES[spec]
    text = Path(spec).read_text() if Path(spec).is_file() else spec
    try:
        values = json.loads(text)
        return Arch(**values)
    except (ValueError, TypeError) as exc:
        names = ", ".join(f.name for f in fields(Arch))
        raise TrainInputError(
            f"--config {spec!r}: {exc}; use auto, small, tiny, or JSON with the fields {names}"
        ) from None


def build_student(args, teacher, target_dir: Path, tok, arch: Arch | None):
    """The draft to train: ``--init`` (same tokenizer) or a fresh Llama of ``arch``."""
    vocab = teacher.get_output_embeddings().weight.shape[0]
    context = context_length(teacher)
    if args.init is not None:
        # A draft sharing its target's embeddings (models/shared_embed.py) gets them from
        # the teacher, checked by fingerprint, and keeps them frozen as they were trained.
        shared = shared_tensors(resolve_model_dir(args.init), teacher)
        student, init_dir, init_tok = load_checkpoint_dir(args.init, shared)
        check_same_tokenizer(tok, init_tok, str(target_dir), str(init_dir))
        rows = student.get_output_embeddings().weight.shape[0]
        if rows != vocab:
            raise TrainInputError(f"--init {init_dir} has {rows} output logits but the target "
                                  f"has {vocab}; pass a draft of the target's vocabulary size")
        learned = any(n.endswith(("wpe.weight", "embed_positions.weight"))
                      for n, _ in student.named_parameters())
        if not learned:  # rotary positions extend to any length; a learned table does not
            student.config.max_position_embeddings = context
        drop_quantization(student.config)
        student.train().requires_grad_(True)
        if shared is not None:
            student.get_input_embeddings().weight.requires_grad_(False)
        return student
    if getattr(args, "from_target", False):
        if arch is None:
            raise TrainInputError("--from-target starts a new draft from the target; it cannot be combined "
                                  "with --init")
        return student_from_target(teacher, arch, args.seed)
    eos = teacher.config.eos_token_id
    eos = tok.eos_token_id if eos is None else eos
    bos = teacher.config.bos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if isinstance(eos, int) else None)
    cfg = llama_config(arch, vocab, context, bos_id=bos, eos_id=eos, pad_id=pad)
    return build_llama(cfg, args.seed)


def drop_quantization(config) -> None:
    """Forget a GGUF target's ``quantization_config``: the draft is trained and saved in
    plain floats, and transformers refuses to save a model that says it is quantized."""
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config


def shares_embedding(student, teacher) -> bool:
    """Whether the draft's embedding matrix is the target's own tensor (not a copy)."""
    mine, theirs = student.get_input_embeddings().weight, teacher.get_input_embeddings().weight
    return mine.data_ptr() == theirs.data_ptr()


def target_layers(total: int, keep: int) -> list[int]:
    """``keep`` of ``total`` layers, evenly spaced, the first and the last included."""
    if keep == 1:
        return [0]
    return sorted({round(i * (total - 1) / (keep - 1)) for i in range(keep)})


def student_from_target(teacher, arch: Arch, seed: int):
    """A draft of ``arch``'s depth made of the target's own weights: its configuration
    (width, heads, RoPE, norms), embeddings, final norm and evenly spaced layers. On little
    data this starts far ahead of random weights: the embeddings and head of a 49k-token
    vocabulary are most of what a small draft would otherwise have to learn."""
    import copy

    from transformers import AutoModelForCausalLM

    cfg = teacher.config
    layers = getattr(getattr(teacher, "model", None), "layers", None)
    if layers is None or arch.hidden_size != cfg.hidden_size:
        raise TrainInputError(
            f"--from-target needs a draft as wide as the target ({cfg.hidden_size}) and a Llama-style "
            f"target; this draft is {arch.hidden_size} wide: pass --config with hidden_size "
            f"{cfg.hidden_size}, or leave --from-target out")
    keep = target_layers(len(layers), arch.num_hidden_layers)
    student_cfg = copy.deepcopy(cfg)
    student_cfg.num_hidden_layers = len(keep)
    drop_quantization(student_cfg)
    if hasattr(student_cfg, "layer_types") and student_cfg.layer_types is not None:
        student_cfg.layer_types = [student_cfg.layer_types[i] for i in keep]
    torch.manual_seed(seed)
    student = AutoModelForCausalLM.from_config(student_cfg).float()
    student.model.norm.load_state_dict(teacher.model.norm.state_dict())
    for mine, theirs in zip(student.model.layers, keep):
        mine.load_state_dict(layers[theirs].state_dict())
    if not cfg.tie_word_embeddings:
        student.lm_head.load_state_dict(teacher.lm_head.state_dict())
    student.config.quickdraft_init = f"target layers {keep}"
    student.train().requires_grad_(True)
    # The target's embedding matrix itself, frozen: the draft ships without it and takes it
    # from the loaded target (models/shared_embed.py), so it must stay exactly the target's.
    shared = teacher.model.embed_tokens.weight
    student.model.embed_tokens.weight = shared
    if cfg.tie_word_embeddings:
        student.lm_head.weight = shared
    shared.requires_grad_(False)
    return student


def check_out_dir(out: Path, target_dir: Path, force: bool) -> None:
    """Never overwrite a directory that is not a draft of ours, nor the target."""
    if out.resolve() == target_dir.resolve():
        raise TrainInputError("--out is the target's directory; pass a new directory for the draft")
    if out.is_file():
        raise TrainInputError(f"--out {out} is a file; pass a directory")
    if out.is_dir() and any(out.iterdir()) and read_meta(out).get("role") != "draft" and not force:
        raise TrainInputError(f"--out {out} is not empty and holds no quickdraft draft; pass a "
                              "new directory, or --force to write into it")


def default_work_dir(out: Path) -> Path:
    """Checkpoints go next to the draft (``OUT-work``); for a draft written into the
    package, under ``runs/`` in the current directory."""
    if out.resolve().is_relative_to(PACKAGE_DIR):
        return Path("runs") / "train-draft" / out.name
    return out.parent / f"{out.name}-work"


def copy_tokenizer(target_dir: Path, out: Path, tok) -> None:
    """The target's tokenizer files, verbatim: the draft's vocabulary is the target's. A
    GGUF target has none: its tokenizer (``tok``, built from the file) is saved instead."""
    if is_gguf(target_dir):
        tok.save_pretrained(out)
        return
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, out / name)


def write_meta(out: Path, target: str, target_dir: Path, params: int,
               shared: torch.Tensor | None = None) -> None:
    """``quickdraft.json``; ``shared``: the target's embedding the draft leaves out."""
    target_name = read_meta(target_dir).get("name") or target
    meta = {"name": out.name, "role": "draft", "default": False, "draft": None,
            "params": int(params),
            "description": f"Draft distilled from {target_name} by `quickdraft train draft`.",
            "target": target_name, "target_path": str(target_dir.resolve())}
    if shared is not None:
        meta[SHARED_KEY] = shared_spec(shared, target_name)
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def run_train_draft(args, command: str, log=print) -> int:
    """Run ``quickdraft train draft``; returns the exit code (130 when Ctrl-C stopped it)."""
    out = Path(args.out)
    check_out_dir(out, resolve_model_dir(args.target), args.force)
    teacher, target_dir, tok = load_teacher(args.target)
    context = context_length(teacher)
    seq_len = args.seq_len
    if seq_len > context:
        raise TrainInputError(f"--seq-len {seq_len} is longer than the target's context "
                              f"({context}); pass at most {context}")
    if (args.draft_vocab or 0) > teacher.config.vocab_size:
        raise TrainInputError(f"--draft-vocab {args.draft_vocab} is more than the target's "
                              f"{teacher.config.vocab_size} tokens; pass at most that (0 = all)")
    # The draft's frequency-ranked vocabulary (models/draft_vocab.py): what it scores when
    # drafting, so what its sizing counts.
    vocab_size = teacher.config.vocab_size
    vocab_keep = default_vocab_size(vocab_size) if args.draft_vocab is None else args.draft_vocab
    arch = None if args.init else draft_arch(args.config, teacher, vocab_keep)
    data = read_text_data(args.data)
    tokens = tokenize(data, tok, seq_len)
    loss_on = getattr(args, "loss_on", None) or "answers"  # (--loss-on; where the data has prompts)
    student = build_student(args, teacher, target_dir, tok, arch)
    device = resolve_device(args.device)
    # Moving the teacher moves a shared embedding too: the draft holds the same Parameter.
    teacher.to(device)
    student.to(device)
    stage = Stage(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                  ckpt_every=args.ckpt_every, log_every=args.log_every, probe_every=args.probe_every)
    work = Path(args.work_dir) if args.work_dir else default_work_dir(out)
    check_settings(work, {
        "target_path": str(target_dir.resolve()), "data_sha256": tokens.manifest["sha256"],
        "init": str(args.init) if args.init else None,
        "config": None if arch is None else asdict(arch),
        "from_target": bool(getattr(args, "from_target", False)),
        "seq_len": seq_len, "batch_size": args.batch_size, "lr": args.lr,
        "warmup": args.warmup, "seed": args.seed, "kl_weight": args.kl_weight,
        "ce_weight": args.ce_weight, "loss_on": loss_on}, args.resume)
    split = tokens.manifest["split"]
    auto = arch is not None and args.config == "auto"
    named = args.config if args.config == "auto" or args.config in DRAFT_SIZES else "JSON"
    shape = (f"from {args.init}" if arch is None else
             f"{arch.num_hidden_layers} x {arch.hidden_size} (--config {named}"
             + (f", {student.config.quickdraft_init} of the target" if args.from_target else "") + ")")
    ratio = sizing.cost_ratio(student, teacher, vocab_keep)
    log(f"[train draft] target {target_dir} ({count_params(teacher):,} params, context "
        f"{context}); draft {shape}, {count_params(student):,} params, estimated step cost "
        f"{ratio:.2f} x the target's; {split['train_tokens']:,} train / "
        f"{split['heldout_tokens']:,} held-out tokens; {args.steps} steps of "
        f"{args.batch_size} x {seq_len}")
    warning = sizing.poor_ratio_warning(ratio, "estimated", auto)
    if warning:
        log(warning)

    counts = np.bincount(tokens.drafted(loss_on == "answers").astype(np.int64), minlength=vocab_size)[:vocab_size]

    # --from-target (or an --init draft that shares them): the embedding is the target's own
    # tensor, left out of the draft's files
    shared = teacher.model.embed_tokens.weight if shares_embedding(student, teacher) else None
    own_params = count_params(student) - (shared.numel() if shared is not None else 0)

    def save(d: Path) -> None:
        save_model_bf16(student, d, omit=(EMBED_NAME,) if shared is not None else ())
        copy_tokenizer(target_dir, d, tok)
        write_meta(d, args.target, target_dir, own_params, shared)
        write_draft_vocab(d, counts, vocab_keep)

    if args.kl_weight == 0:  # hard labels: no target pass per window (see make_label_loss)
        rows = torch.from_numpy(np.argsort(-counts, kind="stable")[:vocab_keep]) if vocab_keep else None
        loss = make_label_loss(rows)
    else:
        loss = make_distill_loss(teacher, args.kl_weight, args.ce_weight)
    task = DistillTask("draft", teacher, student, loss, save,
                       draft_probe(teacher, tokens.heldout))
    summary = train(task, tokens, stage, seq_len, args.seed, work, resume=args.resume,
                    progress=not args.no_progress, threads=args.threads, answers=loss_on == "answers")
    # Saved, scored on held-out text and timed as a CPU run would be: the card's figures
    # (and the decode cost ratio) mean the same whichever device trained the draft.
    teacher.cpu()
    student.cpu()
    out.mkdir(parents=True, exist_ok=True)
    task.save(out)
    if not out.resolve().is_relative_to(PACKAGE_DIR):  # an embedded draft pairs by name
        register_draft(target_dir, out)
    card.copy_run_log(work, out)
    (out / "data_manifest.json").write_text(json.dumps(tokens.manifest, indent=1) + "\n")
    report = {"kind": "draft", "command": command, "target": args.target,
              "target_dir": str(target_dir), "target_params": count_params(teacher),
              "params": count_params(student), "stored_params": own_params, "init": str(args.init) if args.init else None,
              "seq_len": seq_len, "seed": args.seed, "stage": asdict(stage),
              "kl_weight": args.kl_weight, "ce_weight": args.ce_weight,
              "loss_on": loss_on if tokens.train_answers is not None else "all",
              "from_target": getattr(student.config, "quickdraft_init", None) if args.from_target else None,
              "train": summary, "data": {k: v for k, v in tokens.manifest.items()
                                         if k != "file_list"},
              "files": tokens.manifest["file_list"], "hardware": machine_info()}
    if summary["interrupted"]:
        card.plot_charts(out, f"{out.name} training")
        card.write_distill_card(out, report)
        log(f"[train draft] stopped at step {summary['steps_done']}/{args.steps}; a usable "
            f"draft is in {out}; continue with the same command and --resume")
        return 130
    # Held-out agreement and decode cost of the saved (bf16 -> fp32) weights: what users run.
    if args.threads == "auto":  # the tuner's last choice is no basis for a timing
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    saved = load_model_fp32(out, None if shared is None else {EMBED_NAME: shared})
    head_vocab = read_draft_vocab(out)
    heldout = evaluate(saved, tokens.heldout, None, seq_len, args.eval_tokens, teacher=teacher,
                       head_vocab=head_vocab)
    card.log_eval(out, summary["steps_done"], {"loss": heldout["loss"]})
    ms = measure_decode({"target": teacher, "draft": saved}, steps=32, prompt_len=32, repeats=3)
    ms.update(steps=32, prompt_len=32, repeats=3, threads=torch.get_num_threads(),
              ratio=ms["draft"] / ms["target"])
    vocab = json.loads((out / VOCAB_FILE).read_text())
    report.update(heldout=heldout, decode_ms=ms,
                  draft_vocab={"size": vocab["size"], "covers": vocab["size_covers"]})
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    card.record_eval(out, heldout, seq_len)
    card.plot_charts(out, f"{out.name} training")
    card.write_distill_card(out, report)
    if not warning:  # the estimate missed it: say so once, with the figure the card reports
        measured = sizing.poor_ratio_warning(ms["ratio"], "measured, full vocabulary", auto)
        if measured:
            log(measured)
    log(f"[train draft] held-out: greedy agreement {heldout['greedy_agreement']:.1%}, "
        f"KL {heldout['kl_from_target']:.4f}, loss {heldout['loss']:.4f}; decode cost "
        f"draft/target {ms['ratio']:.3f}; draft saved to {out}")
    return 0
