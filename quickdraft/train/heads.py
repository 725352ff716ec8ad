"""``quickdraft train heads``: heads that read a frozen target: Medusa heads (here), the
EAGLE drafter (its loss in :mod:`.eagle`) and the prophet transformer (:mod:`.prophet`).

Head ``i`` at position ``t`` learns the target's own distribution for the token ``i + 2``
places after ``t`` (KL to the target's logits at ``t + i + 1``, plus a little CE on the
text), self-distillation as in Medusa-2, so what the heads learn is what verification
accepts. Losses are weighted ``0.8 ** i`` (Medusa's choice: later heads are less sure).

Memory: K heads over the vocabulary would hold K ``[B, T, V]`` logits (and their
gradients) at once if their losses were summed before one backward. The loss instead runs
in the order of Gloeckle et al. 2024 (:func:`multi_head_backward`): the trunk once, then
per head forward, loss, backward into the detached trunk output, logits freed; the trunk's
backward once at the end. Peak memory is one head's logits, whatever K.

Everything else is the draft trainer's: data, checkpoints, ``--resume``, Ctrl-C, progress
bar (:func:`.distill.train`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..drafters.medusa import MedusaDrafter
from ..machine import machine_info
from ..models.draft_vocab import default_vocab_size, write_draft_vocab
from ..models.eagle import (
    LAYER_FIELDS,
    EagleHead,
    check_feature_layers,
    is_eagle_dir,
    load_eagle,
    save_eagle,
)
from ..models.errors import CheckpointError
from ..models.medusa import MedusaHeads, is_medusa_dir, load_medusa, save_medusa
from ..models.registry import read_meta
from . import card
from .data import answer_runs, batch_parts, masked_mean, window_runs
from .distill import DistillTask, check_settings, resolve_device, tokenize, train
from .draft import default_work_dir
from .exit_head import check_out_dir, load_native_teacher, load_teacher_passes
from .presets import Stage
from .probe import acceptance_probe, as_lm, probe_prompts, snapshot
from .textdata import TrainInputError, read_text_data
from .trainer import count_params

HEAD_DECAY = 0.8  # loss weight of head i: HEAD_DECAY ** i


def multi_head_backward(trunk: torch.Tensor, head_losses: Sequence[Callable[[torch.Tensor], torch.Tensor]]
                        ) -> list[float]:
    """Backpropagate the sum of ``head_losses`` (each a function of the trunk's output)
    holding one head's activations at a time: per head forward, loss, backward into a
    detached copy of ``trunk``'s output (its gradient accumulates there), then the trunk's
    own backward once (skipped for a frozen trunk). Gradients equal those of
    ``sum(loss(trunk)).backward()``. Returns each head's loss."""
    detached = trunk.detach().requires_grad_(trunk.requires_grad)
    values = []
    for loss_of in head_losses:
        loss = loss_of(detached)
        loss.backward()
        values.append(loss.item())
        del loss  # its graph, and the head's logits, go now
    if trunk.requires_grad:
        trunk.backward(detached.grad)
    return values


class TargetStates:
    """One pass of the frozen target over windows ``[B, T]``: its logits and hidden states
    ``[B, T, L * H]``: the outputs of ``layers`` side by side (default: the final state,
    before the norm), the KV cache kept between same-shape calls. ``passes``: the model that
    runs it (:func:`~.exit_head.load_teacher_passes`; default ``target``, whose embedding,
    norm and LM head the student reads)."""

    def __init__(self, target, layers: Sequence[int] = (), passes=None) -> None:
        self.target, self.cache = target, None
        self.passes = target if passes is None else passes
        self.device = next(target.parameters()).device
        # The final state alone is the pass's own output: no states to ask for.
        self.layers = () if tuple(layers) == (target.config.n_layers,) else tuple(layers)

    def window(self, stream: np.ndarray, start: int, length: int) -> torch.Tensor:
        """``stream[start : start + length]`` as a ``[1, T]`` batch on the target's device."""
        return torch.as_tensor(stream[start : start + length], dtype=torch.long)[None].to(self.device)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, length = tokens.shape
        if self.cache is None or self.cache.k.shape[1] != bsz or self.cache.max_len < length:
            self.cache = self.passes.new_cache(bsz, length)
        positions = torch.arange(length, device=tokens.device)[None].expand(bsz, -1)
        out = self.passes(tokens, positions, self.cache, output_hidden_states=self.layers)
        if not self.layers:
            return out.logits, out.hidden
        return out.logits, torch.cat([out.hidden_states[i] for i in self.layers], dim=-1)


def head_loss(heads: MedusaHeads, target, i: int, t_logits: torch.Tensor, labels: torch.Tensor,
              kl_weight: float, ce_weight: float, runs: torch.Tensor | None = None
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Head ``i``'s weighted loss as a function of the final states ``[B, T, H]``. ``runs``
    ``[B, T + 1]`` (:func:`~.data.answer_runs`; None: every place counts): place t counts
    where the tokens t + 1 .. t + i + 2 are answers (the target's own next token, then the
    heads' i + 1 drafts)."""
    shift = i + 1
    teacher = F.log_softmax(t_logits[:, shift:].float(), dim=-1)
    mask = None if runs is None else runs[:, shift + 1 :] >= shift + 1

    def loss_of(hidden: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(heads.head_logits(i, hidden[:, :-shift], target), dim=-1)
        kl = masked_mean((teacher.exp() * (teacher - logp)).sum(-1), mask)
        ce = masked_mean(F.nll_loss(logp.flatten(0, 1), labels[:, shift:].flatten(), reduction="none"
                                    ).view(labels[:, shift:].shape), mask)
        return HEAD_DECAY ** i * (kl_weight * kl + ce_weight * ce)

    return loss_of


def make_medusa_loss(states: TargetStates, kl_weight: float, ce_weight: float):
    """The trainer's ``loss_fn``: backpropagates itself (memory-efficient order) and
    returns the total loss detached, which tells the loop not to call backward again.
    Given :class:`~.data.Windows`, the loss counts answer tokens alone (:func:`head_loss`)."""
    def loss_fn(heads: MedusaHeads, batch):
        windows, answers = batch_parts(batch)
        inp, labels = windows[:, :-1], windows[:, 1:]
        runs = None if answers is None else answer_runs(answers)
        t_logits, hidden = states(inp)
        losses = multi_head_backward(hidden, [head_loss(heads, states.target, i, t_logits, labels, kl_weight,
                                                        ce_weight, runs) for i in range(heads.num_heads)])
        return torch.tensor(sum(losses)), {f"head{i}": value for i, value in enumerate(losses)}

    return loss_fn


@torch.no_grad()
def head_agreement(heads: MedusaHeads, states: TargetStates, stream: np.ndarray, seq_len: int,
                   max_tokens: int, answers: np.ndarray | None = None) -> list[float]:
    """Teacher-forced top-1 agreement of each head with the target's own greedy choice for
    the token it predicts, on held-out windows: the chance a head's first candidate is
    what greedy verification accepts at that depth (given the earlier ones were).
    ``answers`` (a flag per token of ``stream``): only where the loss counts (:func:`head_loss`)."""
    hits = torch.zeros(heads.num_heads, device=states.device)
    counts = torch.zeros(heads.num_heads, device=states.device)
    for start in range(0, min(stream.size - 1, max_tokens), seq_len):
        window = states.window(stream, start, seq_len)
        if window.shape[1] < heads.num_heads + 2:
            break
        runs = None if answers is None else window_runs(answers, start, window.shape[1], states.device)
        t_logits, hidden = states(window)
        greedy = t_logits.argmax(-1)
        for i in range(heads.num_heads):
            guess = heads.head_logits(i, hidden[:, : -(i + 1)], states.target).argmax(-1)
            agree = guess == greedy[:, i + 1 :]
            if runs is not None:
                mask = runs[:, i + 2 :] >= i + 2
                agree, guess = agree & mask, guess[mask]
            hits[i] += agree.sum()
            counts[i] += guess.numel()
    return (hits / counts.clamp(min=1)).tolist()


def medusa_probe(target, heldout: np.ndarray) -> Callable[[MedusaHeads], dict[str, float]]:
    """Acceptance of the heads as a chain (one candidate per head), so draft position i is
    head i - 1 and the curves compare with other drafters' chains."""
    lm, prompts = as_lm(target), probe_prompts(heldout)
    return lambda heads: acceptance_probe(lm, lambda: MedusaDrafter(lm, snapshot(heads), (1,) * heads.num_heads), prompts,
                                          k=heads.num_heads)


def eagle_probe(target, heldout: np.ndarray, depth: int) -> Callable[[EagleHead], dict[str, float]]:
    """Acceptance of the EAGLE drafter as a chain of ``depth`` (its unrolled steps)."""
    from ..drafters.eagle import EagleDrafter, eagle_shape

    lm, prompts = as_lm(target), probe_prompts(heldout)
    shape = eagle_shape(",".join(["1"] * depth))
    return lambda head: acceptance_probe(lm, lambda: EagleDrafter(lm, snapshot(head), shape), prompts, k=depth)


def feature_layers_arg(value: str | None, start: EagleHead | None) -> list[int] | None:
    """``--feature-layers`` as layer numbers (None: the ``--init`` drafter's, else the final
    state); with ``--init``, they must keep every layer it reads."""
    if value is None:
        return None if start is None else list(start.feature_layers)
    try:
        layers = [int(part) for part in value.split(",")]
    except ValueError:
        raise TrainInputError(f"--feature-layers {value}: layer numbers separated by commas, e.g. 2,5,8") from None
    if start is not None and not set(start.feature_layers) <= set(layers):
        raise TrainInputError(f"--feature-layers {value}: the --init drafter reads layers "
                              f"{','.join(map(str, start.feature_layers))}; keep them (it can only add layers)")
    return layers


def widened_map(start: EagleHead, layers: tuple[int, ...]) -> torch.Tensor:
    """``start``'s feature map for reading ``layers`` (a superset of its own): its columns for
    the layers it read, zeros for the new ones, so the drafter starts as it was."""
    old = start.feature_in.weight.detach()
    size = old.shape[1] // len(start.feature_layers)
    weight = old.new_zeros(old.shape[0], size * len(layers))
    for i, layer in enumerate(start.feature_layers):
        j = layers.index(layer)
        weight[:, j * size : (j + 1) * size] = old[:, i * size : (i + 1) * size]
    return weight


def read_init(path: Path, target, load) -> tuple[torch.nn.Module, dict[str, str]]:
    """Heads trained before for ``target`` (``--init``) and what the run records of them;
    a one-line TrainInputError when ``path`` holds none for it."""
    try:
        heads = load(path, target)
    except CheckpointError as exc:
        raise TrainInputError(f"--init {path}: {exc}") from None
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    return heads, {"path": str(path), "sha256": digest}


def heldout_answers(args, tokens) -> np.ndarray | None:
    """The held-out answer flags where the loss counts answers alone (``--loss-on``)."""
    return tokens.heldout_answers if args.loss_on == "answers" else None


def _student(args, target, passes, tokens, log):
    """The kind's student, its loss, save, load and held-out check, and its settings
    (``passes``: the model whose passes teach, :func:`~.exit_head.load_teacher_passes`)."""
    if args.kind == "medusa":
        states = TargetStates(target, passes=passes)
        start, init = read_init(args.init, target, load_medusa) if args.init is not None else (None, None)
        heads = MedusaHeads(args.num_heads if start is None else start.num_heads, target.config.hidden_size)
        if start is not None:
            heads.load_state_dict(start.state_dict())
            log(f"[train heads] starting from {args.init} ({heads.num_heads} heads)")
        return (heads, make_medusa_loss(states, args.kl_weight, args.ce_weight), save_medusa, load_medusa,
                lambda h: head_agreement(h, states, tokens.heldout, args.seq_len, args.eval_tokens,
                                         heldout_answers(args, tokens)),
                {"num_heads": heads.num_heads, "kl_weight": args.kl_weight, "ce_weight": args.ce_weight, "init": init})
    from .eagle import eagle_agreement, frequent_tokens, make_eagle_loss, vocab_cover

    if not 0 <= args.blind_share < 1:
        raise TrainInputError(f"--blind-share {args.blind_share}: a share of the windows, at least 0 and below 1")
    start, init = read_init(args.init, target, load_eagle) if args.init is not None else (None, None)
    draft = None
    layer = None if start is None else start.layer_shape
    if args.from_draft is not None:
        if start is not None:
            raise TrainInputError("--from-draft starts a new EAGLE drafter; --init continues one: pass one of them")
        draft, draft_dir, _ = load_native_teacher(args.from_draft)
        layer = {name: getattr(draft.config, name) for name in LAYER_FIELDS}
        init = {"path": str(args.from_draft), "draft": True,
                "sha256": hashlib.sha256((draft_dir / "model.safetensors").read_bytes()).hexdigest()}
    drafted = tokens.drafted(args.loss_on == "answers")  # what its draft vocabulary ranks
    layers = feature_layers_arg(args.feature_layers, start)
    try:
        check_feature_layers(layers, target.config.n_layers,
                             layer is not None and layer["hidden_size"] != target.config.hidden_size)
    except ValueError as exc:
        raise TrainInputError(f"--feature-layers {args.feature_layers}: {exc}") from None
    if start is None:
        size = default_vocab_size(target.config.vocab_size) if args.draft_vocab is None else args.draft_vocab
        ids, covers = frequent_tokens(drafted, target.config.vocab_size, size)
    else:
        ids = start.vocab_ids
        if start.own_width and args.draft_vocab:
            raise TrainInputError(f"--draft-vocab: {args.init}'s LM head rows are its own, learned for its "
                                  "tokens; it cannot widen them (drop --draft-vocab, or start anew)")
        if ids is not None and args.draft_vocab:  # widen: the rows are the target's, nothing learned is lost
            ids = torch.unique(torch.cat([ids, frequent_tokens(drafted, target.config.vocab_size,
                                                               args.draft_vocab)[0]]))
        covers = vocab_cover(drafted, ids)
        log(f"[train heads] starting from {args.init}")
    if ids is not None:
        text = "of the answers" if drafted is not tokens.train else "of the training text"
        log(f"[train heads] draft vocabulary: {ids.numel():,} tokens ({covers:.1%} {text})")
    try:
        head = EagleHead(target, ids, layer, layers)
        if draft is not None:
            head.from_draft(draft, target)
            log(f"[train heads] a layer of the draft's shape ({draft.config.hidden_size} wide), starting as "
                f"{args.from_draft}")
    except ValueError as exc:
        raise TrainInputError(f"--from-draft {args.from_draft}: {exc}") from None
    head.copy_vocab_rows(target)
    if start is not None:  # its own layers; a target-width head's rows (frozen) come from the target above
        state = head.state_dict()
        state.update((k, v) for k, v in start.state_dict().items() if head.own_width or not k.startswith("vocab_"))
        if head.feature_layers != start.feature_layers:
            if start.maps_features:  # else the new map is the final state's identity already
                state["feature_in.weight"] = widened_map(start, head.feature_layers)
            log(f"[train heads] reading target layers {','.join(map(str, head.feature_layers))} (from "
                f"{','.join(map(str, start.feature_layers))}): the new layers' share of the map starts at zero")
        head.load_state_dict(state)
    states = TargetStates(target, head.feature_layers, passes)
    return (head, make_eagle_loss(states, args.ttt_steps, args.reg_weight, args.kl_weight, args.blind_share), save_eagle,
            load_eagle,
            lambda h: eagle_agreement(h, states, tokens.heldout, args.seq_len, args.eval_tokens, args.ttt_steps,
                                      heldout_answers(args, tokens)),
            {"ttt_steps": args.ttt_steps, "layer": head.layer_shape, "feature_layers": list(head.feature_layers),
             "draft_vocab": 0 if ids is None else ids.numel(),
             "draft_vocab_covers": covers, "reg_weight": args.reg_weight, "kl_weight": args.kl_weight, "blind_share": args.blind_share,
             "init": init})


def run_train_heads(args, command: str, log=print) -> int:
    """Run ``quickdraft train heads``; returns the exit code (130 when Ctrl-C stopped it)."""
    out = Path(args.out)
    check_out_dir(out, args.force, is_medusa_dir if args.kind == "medusa" else is_eagle_dir, "heads")
    target, target_dir, tok = load_native_teacher(args.target)
    device = resolve_device(args.device)
    target.to(device)
    if args.seq_len > target.config.max_position_embeddings:
        raise TrainInputError(f"--seq-len {args.seq_len} is longer than the target's context "
                              f"({target.config.max_position_embeddings}); pass at most that")
    tokens = tokenize(read_text_data(args.data), tok, args.seq_len)
    passes, teacher = load_teacher_passes(target, target_dir, args.teacher, log, "train heads")
    torch.manual_seed(args.seed)
    student, loss_fn, save, load, agreement, settings = _student(args, target, passes, tokens, log)
    student.to(device)
    stage = Stage(steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                  ckpt_every=args.ckpt_every, log_every=args.log_every, probe_every=args.probe_every)
    work = Path(args.work_dir) if args.work_dir else default_work_dir(out)
    check_settings(work, {
        "kind": args.kind, "target_path": str(target_dir.resolve()), "data_sha256": tokens.manifest["sha256"],
        "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr, "warmup": args.warmup,
        "seed": args.seed, "loss_on": args.loss_on, "teacher": teacher, **settings}, args.resume)
    split = tokens.manifest["split"]
    target_name = read_meta(target_dir).get("name") or target_dir.name
    what = (f"{args.num_heads} Medusa heads" if args.kind == "medusa" else
            f"an EAGLE drafter ({args.ttt_steps} unrolled steps)")
    log(f"[train heads] target {target_dir} ({count_params(target):,} params); {what}, "
        f"{count_params(student):,} params; {split['train_tokens']:,} train / {split['heldout_tokens']:,} held-out "
        f"tokens; {args.steps} steps of {args.batch_size} x {args.seq_len}")
    probe = (medusa_probe(passes, tokens.heldout) if args.kind == "medusa" else
             eagle_probe(passes, tokens.heldout, args.ttt_steps))
    before = None
    if settings["init"]:  # scored before training on: the card compares start and result on one set of windows
        saved = work / "init_heldout_agreement.json"
        if saved.exists():  # a --resume: the weights are past their start
            before = json.loads(saved.read_text())
        else:
            before = agreement(student.eval())
            work.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps(before) + "\n")
        student.train()
    task = DistillTask(args.kind, target, student, loss_fn, lambda d: save(student, target, target_name, d), probe)
    summary = train(task, tokens, stage, args.seq_len, args.seed, work, resume=args.resume,
                    progress=not args.no_progress, threads=args.threads, answers=args.loss_on == "answers")
    out.mkdir(parents=True, exist_ok=True)
    task.save(out)
    if args.kind == "eagle" and student.vocab_ids is not None:  # ranks its rows: --draft-vocab N keeps the first N
        counts = np.bincount(tokens.drafted(args.loss_on == "answers"), minlength=target.config.vocab_size)
        write_draft_vocab(out, counts, student.draft_vocab, student.vocab_ids.cpu().numpy())
    card.copy_run_log(work, out)
    (out / "data_manifest.json").write_text(json.dumps(tokens.manifest, indent=1) + "\n")
    report = {"kind": args.kind, "command": command, "target": target_name, "target_dir": str(target_dir),
              "target_params": count_params(target), "params": count_params(student), **settings,
              "loss_on": args.loss_on if tokens.train_answers is not None else "all", "teacher": teacher,
              "seq_len": args.seq_len, "seed": args.seed, "stage": asdict(stage), "train": summary,
              "data": {k: v for k, v in tokens.manifest.items() if k != "file_list"},
              "hardware": {**machine_info(),
                           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}}
    if before is not None:
        report["init_heldout_agreement"] = before
    if not summary["interrupted"]:
        report["heldout_agreement"] = agreement(load(out, target))
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    card.plot_charts(out, f"{out.name} training")
    (card.write_heads_card if args.kind == "medusa" else card.write_eagle_card)(out, report)
    if summary["interrupted"]:
        log(f"[train heads] stopped at step {summary['steps_done']}/{args.steps}; usable heads are in {out}; "
            "continue with the same command and --resume")
        return 130
    agreement_text = ", ".join(f"{a:.1%}" for a in report["heldout_agreement"])
    per = "head" if args.kind == "medusa" else "unrolled step (tree depth)"
    log(f"[train heads] held-out top-1 agreement with the target per {per}: {agreement_text}; saved to {out} "
        f"(use it with --method {args.kind} --heads {out})")
    return 0
