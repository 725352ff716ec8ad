"""``quickdraft train exit-head``: distil an early-exit head on a frozen target.

The student is an :class:`~quickdraft.models.exit_head.ExitHead` reading the target's
residual stream after layer L; the teacher is the whole target. Both come out of ONE
native forward pass of the frozen target (its logits and its layer-L hidden states), so
a training step costs a target forward plus the head. Everything else is the draft
trainer's: data (:mod:`.textdata`), KL + CE (:func:`.trainer.distill_objective`), the
loop with progress, checkpoints, resume and Ctrl-C (:func:`.distill.train`), held-out
agreement (:func:`.trainer.evaluate`) and the card (:mod:`.card`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from ..machine import machine_info
from ..models.config import UnsupportedModelError
from ..models.draft_vocab import default_vocab_size, write_draft_vocab
from ..models.exit_head import ExitHead, is_exit_head_dir, save_exit_head
from ..models.loading import load_native, resolve_model_dir
from ..models.registry import read_meta
from ..pair import load_tokenizer
from . import card
from .data import batch_parts
from .distill import DistillTask, check_settings, resolve_device, tokenize, train
from .draft import default_work_dir
from .presets import Stage
from .probe import acceptance_probe, as_lm, probe_prompts, snapshot
from .textdata import TrainInputError, read_text_data
from .trainer import count_params, distill_objective, evaluate


def load_native_teacher(target: str | Path):
    """The target in the native runtime, fp32, frozen: ``(model, directory, tokenizer)``."""
    target_dir = resolve_model_dir(target)
    try:
        model = load_native(target_dir, torch.float32)
    except UnsupportedModelError as exc:
        raise TrainInputError(f"{target}: {exc}; exit heads need a target the native runtime loads") from None
    return model.eval().requires_grad_(False), target_dir, load_tokenizer(target_dir)


def load_teacher_passes(target, target_dir: Path, how: str = "auto", log=None, command: str = "train"):
    """The model whose forward passes teach (logits, states): ``(model, "quantized" |
    "float32")``. ``auto``: where generation runs the target on its file's own int4/int8
    weights (``--quantize auto``: a GGUF file on a CPU with our kernels), that model, so the
    student learns the logits verification accepts and the states it drafts from, at half
    the cost of a float32 pass (SmolLM2, 8 x 512 tokens: 3.4 s against 7.5 s); elsewhere,
    and with ``float32``, ``target`` itself (the dequantized weights). Quantized weights
    cannot carry gradients: the student keeps reading ``target``'s embedding, norm and LM
    head. ``log`` (with ``command``'s tag) is told when the passes run quantized."""
    from ..models import gguf

    # Only a GGUF file has quantized weights for auto to keep: other targets load once.
    if how == "auto" and next(target.parameters()).device.type == "cpu" and gguf.is_gguf(target_dir):
        from ..models.lm import load_model
        from ..models.quant_linear import WeightOnlyLinear

        model = load_model(target_dir, backend="native").model  # generation's placement and kernels
        if any(isinstance(m, WeightOnlyLinear) for m in model.modules()):
            if log is not None:
                log(f"[{command}] the target's passes run on its file's own quantized weights, as generation "
                    "runs them on this machine (--teacher float32: its dequantized float32 weights)")
            return model.eval().requires_grad_(False), "quantized"
    return target, "float32"


class TargetPass:
    """One forward pass of the frozen target over token windows ``[B, T]``: its logits and
    its residual stream after ``layer`` (the KV cache is kept between same-shape calls).
    ``passes``: the model that runs it (:func:`load_teacher_passes`; default ``target``)."""

    def __init__(self, target, layer: int, passes=None) -> None:
        self.target, self.layer, self.cache = target, layer, None
        self.passes = target if passes is None else passes
        self.device = target.embed.weight.device

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bsz, length = tokens.shape
        if self.cache is None or self.cache.k.shape[1] != bsz or self.cache.max_len < length:
            self.cache = self.passes.new_cache(bsz, length)
        positions = torch.arange(length, device=tokens.device)[None].expand(bsz, -1)
        out = self.passes(tokens, positions, self.cache, output_hidden_states=[self.layer])
        return out.logits, out.hidden_states[self.layer], positions


def head_logits(head: ExitHead, target, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The head's logits over whole windows (a fresh cache for the extra block)."""
    cache = head.new_cache(hidden.shape[0], hidden.shape[1], hidden)
    return head.logits(head.transform(hidden, target, positions, cache), target)


class _Logits(nn.Module):
    """``model(input_ids=...).logits`` for :func:`.trainer.evaluate`: the target's own
    logits, or (with ``head``) the exit head's."""

    def __init__(self, target_pass: TargetPass, head: ExitHead | None = None) -> None:
        super().__init__()
        self.target_pass, self.head = target_pass, head

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        logits, hidden, positions = self.target_pass(input_ids.to(self.target_pass.device))
        if self.head is not None:
            logits = head_logits(self.head, self.target_pass.target, hidden, positions)
        return SimpleNamespace(logits=logits)


def make_exit_loss(target_pass: TargetPass, kl_weight: float, ce_weight: float):
    """The trainer's ``loss_fn``; given :class:`~.data.Windows`, at the places whose next
    token is an answer (what the head drafts)."""
    def loss_fn(head: ExitHead, batch):
        windows, answers = batch_parts(batch)
        inp, labels = windows[:, :-1], windows[:, 1:]
        t_logits, hidden, positions = target_pass(inp)
        logits = head_logits(head, target_pass.target, hidden, positions)
        return distill_objective(t_logits, logits, labels, kl_weight, ce_weight,
                                 None if answers is None else answers[:, 1:])

    return loss_fn


def check_out_dir(out: Path, force: bool, holds_ours=is_exit_head_dir, what: str = "exit head") -> None:
    """Refuse an ``--out`` that is a file, or a non-empty directory that does not hold what
    this command writes (``holds_ours``), unless ``force``."""
    if out.is_file():
        raise TrainInputError(f"--out {out} is a file; pass a directory")
    if out.is_dir() and any(out.iterdir()) and not holds_ours(out) and not force:
        raise TrainInputError(f"--out {out} is not empty and holds no {what}; pass a new directory, "
                              "or --force to write into it")


def exit_probe(target, heldout) -> Callable[[ExitHead], dict[str, float]]:
    """Acceptance of the head drafting chains of 4 (sharing the target's KV, as generation does)."""
    from ..drafters.early_exit import EarlyExitDrafter

    lm, prompts = as_lm(target), probe_prompts(heldout)
    return lambda head: acceptance_probe(lm, lambda: EarlyExitDrafter(lm, snapshot(head)), prompts, k=4)


def run_train_exit_head(args, command: str, log=print) -> int:
    """Run ``quickdraft train exit-head``; returns the exit code (130 when Ctrl-C stopped it)."""
    out = Path(args.out)
    check_out_dir(out, args.force)
    target, target_dir, tok = load_native_teacher(args.target)
    device = resolve_device(args.device)
    target.to(device)
    n_layers, context = target.config.n_layers, target.config.max_position_embeddings
    if not 1 <= args.exit_layer < n_layers:
        raise TrainInputError(f"--exit-layer must be in 1..{n_layers - 1} for this target ({n_layers} layers), "
                              f"got {args.exit_layer}")
    if args.seq_len > context:
        raise TrainInputError(f"--seq-len {args.seq_len} is longer than the target's context ({context}); "
                              f"pass at most {context}")
    vocab_size = target.config.vocab_size
    if (args.draft_vocab or 0) > vocab_size:
        raise TrainInputError(f"--draft-vocab {args.draft_vocab} is more than the target's vocabulary "
                              f"({vocab_size}); pass at most that, or 0 for all")
    tokens = tokenize(read_text_data(args.data), tok, args.seq_len)
    loss_on = getattr(args, "loss_on", None) or "answers"  # (--loss-on; where the data has prompts)
    passes, teacher = load_teacher_passes(target, target_dir, args.teacher, log, "train exit-head")
    torch.manual_seed(args.seed)
    head = ExitHead(target.config, args.exit_layer, trained=True, extra_block=args.extra_block).init_from(target).to(device)
    stage = Stage(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                  ckpt_every=args.ckpt_every, log_every=args.log_every, probe_every=args.probe_every)
    work = Path(args.work_dir) if args.work_dir else default_work_dir(out)
    check_settings(work, {
        "kind": "exit-head", "target_path": str(target_dir.resolve()), "data_sha256": tokens.manifest["sha256"],
        "exit_layer": args.exit_layer, "extra_block": args.extra_block, "seq_len": args.seq_len,
        "batch_size": args.batch_size, "lr": args.lr, "warmup": args.warmup, "seed": args.seed,
        "kl_weight": args.kl_weight, "ce_weight": args.ce_weight, "loss_on": loss_on, "teacher": teacher},
        args.resume)
    split = tokens.manifest["split"]
    target_name = read_meta(target_dir).get("name") or target_dir.name
    log(f"[train exit-head] target {target_dir} ({count_params(target):,} params, {n_layers} layers); head after "
        f"layer {args.exit_layer}{' with an extra block' if args.extra_block else ''}, {count_params(head):,} "
        f"params; {split['train_tokens']:,} train / {split['heldout_tokens']:,} held-out tokens; {args.steps} "
        f"steps of {args.batch_size} x {args.seq_len}")
    target_pass = TargetPass(target, args.exit_layer, passes)
    task = DistillTask("exit-head", target, head, make_exit_loss(target_pass, args.kl_weight, args.ce_weight),
                       lambda d: save_exit_head(head, target, target_name, d), exit_probe(passes, tokens.heldout))
    summary = train(task, tokens, stage, args.seq_len, args.seed, work, resume=args.resume,
                    progress=not args.no_progress, threads=args.threads, answers=loss_on == "answers")
    out.mkdir(parents=True, exist_ok=True)
    task.save(out)
    # The tokens its draft steps score (FR-Spec, as train draft does): the LM head is a
    # large share of an early-exit step (a fifth of SmolLM2's).
    vocab = write_draft_vocab(out, np.bincount(tokens.drafted(loss_on == "answers"), minlength=vocab_size),
                              default_vocab_size(vocab_size) if args.draft_vocab is None else args.draft_vocab)
    card.copy_run_log(work, out)
    (out / "data_manifest.json").write_text(json.dumps(tokens.manifest, indent=1) + "\n")
    report = {"kind": "exit-head", "command": command, "target": target_name, "target_dir": str(target_dir),
              "target_params": count_params(target), "params": count_params(head),
              "exit_layer": args.exit_layer, "n_layers": n_layers, "extra_block": args.extra_block,
              "seq_len": args.seq_len, "seed": args.seed, "stage": asdict(stage),
              "kl_weight": args.kl_weight, "ce_weight": args.ce_weight, "train": summary,
              "loss_on": loss_on if tokens.train_answers is not None else "all", "teacher": teacher,
              "draft_vocab": {"size": vocab["size"], "covers": vocab["size_covers"]},
              "data": {k: v for k, v in tokens.manifest.items() if k != "file_list"},
              "hardware": {**machine_info(), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}}
    if not summary["interrupted"]:
        # Held-out agreement of the saved (bf16) head, and of the shared head at the same layer.
        from ..models.exit_head import load_exit_head

        saved = load_exit_head(out, target)
        shared = ExitHead(target.config, args.exit_layer, trained=False).to(device)
        teacher = _Logits(target_pass)
        report["heldout"] = evaluate(_Logits(target_pass, saved), tokens.heldout, None, args.seq_len,
                                     args.eval_tokens, teacher=teacher)
        report["heldout_shared_head"] = evaluate(_Logits(target_pass, shared), tokens.heldout, None,
                                                 args.seq_len, args.eval_tokens, teacher=teacher)
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    card.plot_charts(out, f"{out.name} training")
    card.write_exit_head_card(out, report)
    if summary["interrupted"]:
        log(f"[train exit-head] stopped at step {summary['steps_done']}/{args.steps}; a usable head is in "
            f"{out}; continue with the same command and --resume")
        return 130
    ev, base = report["heldout"], report["heldout_shared_head"]
    log(f"[train exit-head] held-out greedy agreement with the target {ev['greedy_agreement']:.1%} (shared head "
        f"at layer {args.exit_layer}: {base['greedy_agreement']:.1%}), KL {ev['kl_from_target']:.4f}; head saved "
        f"to {out}")
    return 0
