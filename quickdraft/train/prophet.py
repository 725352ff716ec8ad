"""``quickdraft train heads --kind prophet``: a prophet transformer on a frozen target.

One target pass over a batch of windows ``[B, T]`` gives its final states and logits at
every position; every start ``s`` then makes one prophet sequence: the states of
positions ``s - n + 1 .. s``, then the tokens ``x_{s+1} .. x_{s+gamma}`` (what drafting
feeds: the newest token, then ``gamma - 1`` drafts), its outputs predicting
``x_{s-n+2} .. x_{s+gamma+1}``: windows of ``n + gamma + 1`` tokens (``gamma + 2`` for
one state). The loss is cross-entropy at every position, against the target's own
distribution there (KL, self-distillation: what verification accepts) plus a little on
the text. The sequences run in chunks, each backpropagated at once
(:func:`.heads.multi_head_backward`), so memory holds one chunk's logits. With
``--loss-on answers`` (the default) on self-distillation shards, an output counts where the
token it predicts is the target's answer and, for a draft at depth d, so are the d - 1
drafted before it (:func:`counted`), as for EAGLE and Medusa.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..drafters.prophet import ProphetDrafter
from ..machine import machine_info
from ..models.draft_vocab import default_vocab_size, write_draft_vocab
from ..models.prophet import Prophet, ProphetConfig, is_prophet_dir, load_prophet, save_prophet
from ..models.registry import read_meta
from . import card
from .data import answer_runs, batch_parts, window_runs
from .distill import DistillTask, check_settings, resolve_device, tokenize, train
from .draft import default_work_dir
from .exit_head import check_out_dir, load_native_teacher, load_teacher_passes
from .heads import TargetStates, multi_head_backward
from .presets import Stage
from .probe import acceptance_probe, as_lm, probe_prompts, snapshot
from .textdata import TrainInputError, read_text_data
from .trainer import count_params

CHUNK = 256  # prophet sequences per backward


def window_index(length: int, n: int, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For windows ``[.., length + 1]`` of text whose first ``length`` tokens the target has
    seen: ``(states [W, n], inputs [W, gamma])``, the text positions of each prophet
    sequence's states and tokens. Output ``j`` of a sequence predicts the token after text
    position ``cat(states, inputs)[j]``."""
    starts = torch.arange(n - 1, length - gamma)
    if starts.numel() == 0:
        raise TrainInputError(f"--seq-len {length} is too short for --n-start {n} and --gamma {gamma}")
    return starts[:, None] + torch.arange(1 - n, 1), starts[:, None] + 1 + torch.arange(gamma)


def prophet_batch(batch: torch.Tensor, hidden: torch.Tensor, n: int, gamma: int):
    """Prophet sequences of a batch ``[B, T + 1]`` whose first ``T`` tokens gave the target's
    states ``hidden [B, T, H]``: ``(states [N, n, H], inputs [N, gamma], positions [N, n + gamma],
    row [N, 1])``, ``positions`` being the text positions whose next token each output predicts."""
    bsz, length = hidden.shape[:2]
    at_states, at_inputs = window_index(length, n, gamma)
    w = at_states.shape[0]
    rows = torch.arange(bsz, device=batch.device).repeat_interleave(w)[:, None]
    at_states, at_inputs = at_states.to(batch.device).repeat(bsz, 1), at_inputs.to(batch.device).repeat(bsz, 1)
    return hidden[rows, at_states], batch[rows, at_inputs], torch.cat([at_states, at_inputs], 1), rows


def counted(runs: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
    """Which outputs of prophet sequences ``[N, n + gamma]`` count on answers alone, given
    :func:`~.data.answer_runs` ``runs`` of their windows: output j predicts the token after
    ``positions[j]``; a draft (j >= n, depth d = j - n + 1) counts where that token and the
    d - 1 drafted before it are answers, an output at the states where its token is one."""
    need = (torch.arange(positions.shape[1], device=positions.device) - n + 1).clamp(min=1)
    return runs[rows, positions + 1] >= need


def make_prophet_loss(states: TargetStates, kl_weight: float, ce_weight: float):
    """The trainer's ``loss_fn`` (backpropagates itself, chunk by chunk; returns the loss
    detached): the mean over every position of every prophet sequence; given
    :class:`~.data.Windows`, over the positions that count on answers (:func:`counted`)."""
    def loss_fn(prophet: Prophet, batch):
        cfg = prophet.config
        windows, answers = batch_parts(batch)
        t_logits, hidden = states(windows[:, :-1])
        seq_states, inputs, positions, rows = prophet_batch(windows, hidden, cfg.n_start, cfg.gamma)
        total = positions.shape[0]
        mask = None if answers is None else counted(answer_runs(answers), rows, positions, cfg.n_start)
        places = positions.numel() if mask is None else mask.sum().clamp(min=1)

        def chunk_loss(a: int):
            sl = slice(a, a + CHUNK)

            def loss_of(_):  # the teacher's chunk too is made here, so one chunk's is held at a time
                teacher = F.log_softmax(t_logits[rows[sl], positions[sl]].float(), dim=-1)
                labels = windows[rows[sl], positions[sl] + 1]
                logp = F.log_softmax(prophet(seq_states[sl], inputs[sl]).float(), dim=-1)
                kl = (teacher.exp() * (teacher - logp)).sum(-1)
                ce = F.nll_loss(logp.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
                if mask is not None:
                    kl, ce = kl * mask[sl], ce * mask[sl]
                return (kl_weight * kl.sum() + ce_weight * ce.sum()) / places

            return loss_of

        losses = multi_head_backward(hidden, [chunk_loss(a) for a in range(0, total, CHUNK)])
        return torch.tensor(sum(losses)), {}

    return loss_fn


@torch.no_grad()
def depth_agreement(prophet: Prophet, states: TargetStates, stream: np.ndarray, seq_len: int,
                    max_tokens: int, answers: np.ndarray | None = None) -> list[float]:
    """Teacher-forced top-1 agreement of the prophet's draft at each depth with the target's
    own greedy token there, on held-out windows: the chance the draft's token at depth
    ``d`` is what greedy verification accepts (given the earlier ones were). ``answers`` (a
    flag per token of ``stream``): only where the loss counts (:func:`counted`)."""
    cfg = prophet.config
    hits, count = torch.zeros(cfg.gamma, device=states.device), torch.zeros(cfg.gamma, device=states.device)
    for start in range(0, min(stream.size - 1, max_tokens), seq_len):
        window = states.window(stream, start, seq_len + 1)
        if window.shape[1] < cfg.n_start + cfg.gamma + 2:
            break
        t_logits, hidden = states(window[:, :-1])
        seq_states, inputs, positions, rows = prophet_batch(window, hidden, cfg.n_start, cfg.gamma)
        mask = (torch.ones_like(positions, dtype=torch.bool) if answers is None else
                counted(window_runs(answers, start, window.shape[1], states.device), rows, positions, cfg.n_start))
        for a in range(0, positions.shape[0], CHUNK):
            sl = slice(a, a + CHUNK)
            drafts = prophet(seq_states[sl], inputs[sl])[:, cfg.n_start :].argmax(-1)  # depths 1 .. gamma
            at = mask[sl, cfg.n_start :]
            hits += ((drafts == t_logits[rows[sl], positions[sl, cfg.n_start :]].argmax(-1)) & at).sum(0)
            count += at.sum(0)
    return (hits / count.clamp(min=1)).tolist()


def prophet_probe(target, heldout: np.ndarray) -> Callable[[Prophet], dict[str, float]]:
    """Acceptance of the prophet drafting its gamma tokens a round (all of its vocabulary)."""
    lm, prompts = as_lm(target), probe_prompts(heldout)
    return lambda prophet: acceptance_probe(lm, lambda: ProphetDrafter(lm, snapshot(prophet)), prompts,
                                            k=prophet.config.gamma)


def run_train_prophet(args, command: str, log=print) -> int:
    """Run ``quickdraft train heads --kind prophet``; the exit code (130: Ctrl-C stopped it)."""
    out = Path(args.out)
    check_out_dir(out, args.force, is_prophet_dir, "prophet")
    target, target_dir, tok = load_native_teacher(args.target)
    device = resolve_device(args.device)
    target.to(device)
    if args.seq_len > target.config.max_position_embeddings:
        raise TrainInputError(f"--seq-len {args.seq_len} is longer than the target's context "
                              f"({target.config.max_position_embeddings}); pass at most that")
    window_index(args.seq_len, args.n_start, args.gamma)  # a one-line error before any work
    tokens = tokenize(read_text_data(args.data), tok, args.seq_len)
    passes, teacher = load_teacher_passes(target, target_dir, args.teacher, log, "train heads")
    tc = target.config
    width = args.width or tc.hidden_size
    try:
        config = ProphetConfig(tc.hidden_size, tc.vocab_size, width, n_layers=args.layers,
                               n_heads=args.prophet_heads or tc.n_heads, n_start=args.n_start, gamma=args.gamma,
                               project=args.project or width != tc.hidden_size,
                               intermediate_size=tc.intermediate_size if width == tc.hidden_size else 0)
    except ValueError as exc:
        raise TrainInputError(str(exc)) from None
    torch.manual_seed(args.seed)
    prophet = Prophet(config)
    prophet.init_from_target(target)
    prophet.to(device)
    stage = Stage(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                  ckpt_every=args.ckpt_every, log_every=args.log_every, probe_every=args.probe_every)
    work = Path(args.work_dir) if args.work_dir else default_work_dir(out)
    check_settings(work, {
        "kind": args.kind, "target_path": str(target_dir.resolve()), "data_sha256": tokens.manifest["sha256"],
        "prophet": asdict(config), "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr,
        "warmup": args.warmup, "seed": args.seed, "kl_weight": args.kl_weight, "ce_weight": args.ce_weight,
        "teacher": teacher, "loss_on": args.loss_on},
        args.resume)
    split = tokens.manifest["split"]
    target_name = read_meta(target_dir).get("name") or target_dir.name
    log(f"[train heads] target {target_dir} ({count_params(target):,} params); prophet of {config.n_layers} "
        f"layer(s), width {width}, {count_params(prophet):,} params, {config.n_start} start state(s), gamma "
        f"{config.gamma}; {split['train_tokens']:,} train / {split['heldout_tokens']:,} held-out tokens; "
        f"{args.steps} steps of {args.batch_size} x {args.seq_len}")
    states = TargetStates(target, passes=passes)
    task = DistillTask("prophet", target, prophet, make_prophet_loss(states, args.kl_weight, args.ce_weight),
                       lambda d: save_prophet(prophet, target, target_name, d), prophet_probe(passes, tokens.heldout))
    answers = args.loss_on == "answers"
    summary = train(task, tokens, stage, args.seq_len, args.seed, work, resume=args.resume,
                    progress=not args.no_progress, threads=args.threads, answers=answers)
    out.mkdir(parents=True, exist_ok=True)
    task.save(out)
    # Its LM head scores the most frequent tokens only when drafting (as a draft's does).
    counts = np.bincount(tokens.drafted(answers).astype(np.int64), minlength=tc.vocab_size)[: tc.vocab_size]
    vocab = write_draft_vocab(out, counts, default_vocab_size(tc.vocab_size))
    card.copy_run_log(work, out)
    (out / "data_manifest.json").write_text(json.dumps(tokens.manifest, indent=1) + "\n")
    report = {"kind": args.kind, "command": command, "target": target_name, "target_dir": str(target_dir),
              "target_params": count_params(target), "params": count_params(prophet), "prophet": asdict(config),
              "seq_len": args.seq_len, "seed": args.seed, "stage": asdict(stage), "kl_weight": args.kl_weight,
              "ce_weight": args.ce_weight, "teacher": teacher, "train": summary,
              "loss_on": args.loss_on if tokens.train_answers is not None else "all",
              "draft_vocab": {"size": vocab["size"], "covers": vocab["size_covers"]},
              "data": {k: v for k, v in tokens.manifest.items() if k != "file_list"},
              "hardware": {**machine_info(),
                           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}}
    if not summary["interrupted"]:
        report["heldout_agreement"] = depth_agreement(load_prophet(out, target), states, tokens.heldout,
                                                      args.seq_len, args.eval_tokens,
                                                      tokens.heldout_answers if answers else None)
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    card.plot_charts(out, f"{out.name} training")
    card.write_prophet_card(out, report)
    if summary["interrupted"]:
        log(f"[train heads] stopped at step {summary['steps_done']}/{args.steps}; a usable prophet is in {out}; "
            "continue with the same command and --resume")
        return 130
    agreement = ", ".join(f"{a:.1%}" for a in report["heldout_agreement"])
    log(f"[train heads] held-out top-1 agreement with the target per draft depth: {agreement}; prophet saved to "
        f"{out} (use it with --method prophet --heads {out})")
    return 0
