"""Training a student on a frozen target: what every drafter trained on a target shares.

A :class:`DistillTask` is the student (a draft model today; early-exit heads, a prophet
transformer or Medusa heads later), its loss on a batch and how it is saved. Around it
this module provides the teacher (the target, fp32, frozen), the tokenised data
(:mod:`.textdata`), the settings check that makes ``--resume`` safe, and the training run
(:func:`.trainer.train_loop`: tqdm progress, checkpoints, Ctrl-C). Cards: :mod:`.card`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..models.loading import CheckpointError, read_hf_config, resolve_model_dir
from ..pair import load_tokenizer
from .data import encode_docs
from .holdout import drop_bench_documents
from .presets import Stage
from .textdata import TextData, TrainInputError
from .trainer import load_model_fp32, thread_tuner, train_loop


@dataclass
class DistillTask:
    """A student trained to imitate a frozen teacher.

    ``loss_fn(student, batch)`` gets token windows ``[B, L + 1]`` and returns ``(loss,
    {name: float})`` (see ``trainer.make_distill_loss``); ``save(dir)`` writes a directory
    the runtime loads; ``probe(student)``, if given, measures the student as a drafter
    while it trains (:mod:`.probe`).
    """

    kind: str
    teacher: torch.nn.Module
    student: torch.nn.Module
    loss_fn: Callable
    save: Callable[[Path], None]
    probe: Callable[[torch.nn.Module], dict[str, float]] | None = None


def load_checkpoint_dir(name_or_path: str | Path, shared: dict[str, torch.Tensor] | None = None,
                        ) -> tuple[torch.nn.Module, Path, object]:
    """A model as ``(fp32 transformers model, directory, tokenizer)``: an embedded name, a
    directory or a hub id; ``shared``: tensors it takes from its target. Raises
    CheckpointError (one line) when it cannot be loaded."""
    model_dir = resolve_model_dir(name_or_path)
    read_hf_config(model_dir)  # no config.json, or remote code: a clear message
    tok = load_tokenizer(model_dir)
    try:
        model = load_model_fp32(model_dir, shared)
    except (OSError, ValueError, KeyError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(
            f"cannot load {name_or_path}: {str(exc).splitlines()[0][:160]}") from None
    return model, model_dir, tok


def load_teacher(target: str | Path) -> tuple[torch.nn.Module, Path, object]:
    """The target as a frozen fp32 teacher: ``(model, directory, tokenizer)``."""
    teacher, target_dir, tok = load_checkpoint_dir(target)
    return teacher.requires_grad_(False), target_dir, tok


def context_length(model) -> int:
    cfg = model.config
    return int(getattr(cfg, "max_position_embeddings", None) or cfg.n_positions)


@dataclass
class TokenData:
    """Token streams of the train and held-out text, and the data manifest with counts."""

    train: np.ndarray
    heldout: np.ndarray
    manifest: dict
    #: Per token of each stream, whether the target wrote it (:func:`answer_flags`); None
    #: where every token counts (text a user gave, no shard's prompt in it).
    train_answers: np.ndarray | None = None
    heldout_answers: np.ndarray | None = None

    def drafted(self, answers: bool) -> np.ndarray:
        """The train tokens a drafter learns to draft: the answers alone (``answers``, where
        the data has prompts) or all of them. Its draft vocabulary ranks these: ranked over
        prompts too, a chat template's tokens crowd out the answers' words."""
        return self.train[self.train_answers] if answers and self.train_answers is not None else self.train


def tokenize(data: TextData, tok, seq_len: int) -> TokenData:
    """Encode both splits (``EOS doc EOS doc ...``; documents given as ids join as they
    are); the train stream must hold a window. Self-distillation documents that ask a bench
    prompt are left out first (:mod:`.holdout`; the manifest's ``held_out`` lists them)."""
    held_out = drop_bench_documents(data, tok)
    train_text = encode_docs(tok, [t for _, t in data.train])
    heldout_text = encode_docs(tok, [t for _, t in data.heldout])
    train = join_ids(train_text, data.train_ids, tok)
    heldout = join_ids(heldout_text, data.heldout_ids, tok)
    if train.size < seq_len + 1:
        raise TrainInputError(
            f"the training text has {train.size} tokens, fewer than --seq-len + 1 = "
            f"{seq_len + 1}; add data or lower --seq-len")
    manifest = data.manifest()
    manifest["split"].update(train_tokens=int(train.size), heldout_tokens=int(heldout.size))
    manifest["held_out"] = held_out
    return TokenData(train, heldout, manifest,
                     answer_flags(train_text.size, data.train_ids, data.prompt_tokens, tok),
                     answer_flags(heldout_text.size, data.heldout_ids, data.prompt_tokens, tok))


def answer_flags(text_tokens: int, docs: list[tuple[str, np.ndarray]], prompt_tokens: dict[str, int],
                 tok) -> np.ndarray | None:
    """Per token of ``join_ids``' stream, whether it is what the target wrote: a user's text
    (the first ``text_tokens``) counts whole; a shard document's separator and prompt (its
    chat template and instruction, or the code it completes) do not, its answer does. A
    drafter only ever drafts answers: a loss on prompts trains it for text it never meets
    (EAGLE's and Medusa's recipes train on answers alone). None where every token counts."""
    if not any(prompt_tokens.get(name, 0) for name, _ in docs):
        return None
    eos = 0 if tok.eos_token_id is None else 1
    parts = [np.ones(text_tokens, dtype=bool)]
    for name, ids in docs:
        flags = np.ones(eos + ids.size, dtype=bool)
        flags[: eos + prompt_tokens.get(name, 0)] = False
        parts.append(flags)
    return np.concatenate(parts)


def join_ids(stream: np.ndarray, docs: list[tuple[str, np.ndarray]], tok) -> np.ndarray:
    """``stream`` followed by ``EOS ids EOS ids ...`` for each ``(name, ids)`` document."""
    if not docs:
        return stream
    eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
    parts = [stream] + [np.concatenate([np.asarray(eos, dtype=stream.dtype), ids.astype(stream.dtype)])
                        for _, ids in docs]
    return np.concatenate(parts)


def resolve_device(name: str) -> torch.device:
    """``--device`` as a torch device; one line when it does not exist on this machine (the
    inference commands' check, :func:`~quickdraft.models.placement.resolve_device`)."""
    from ..models.placement import PlacementError
    from ..models.placement import resolve_device as resolve

    try:
        return resolve(name)
    except PlacementError as exc:
        raise TrainInputError(str(exc)) from None


# What runs recorded before a setting existed did: a --resume of them compares with it.
SETTINGS_BEFORE = {"loss_on": "all", "teacher": "float32"}


def check_settings(work_dir: Path, settings: dict, resume: bool) -> None:
    """Record the settings batches and weights depend on; ``resume`` must not change them."""
    path = Path(work_dir) / "run.json"
    if resume and path.exists():
        old = {**SETTINGS_BEFORE, **json.loads(path.read_text())}
        changed = [f"{k}: {old.get(k)} -> {v}" for k, v in settings.items() if old.get(k) != v]
        if changed:
            raise TrainInputError(
                f"--resume: the checkpoints in {work_dir} were made with other settings "
                f"({'; '.join(changed[:3])}); use the same ones, or drop --resume to start over")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1) + "\n")


def train(task: DistillTask, tokens: TokenData, stage: Stage, seq_len: int, seed: int,
          work_dir: Path, resume: bool = False, progress: bool = True,
          threads: int | str | None = None, answers: bool = False) -> dict:
    """Run the training loop on the task's student; the summary says if Ctrl-C stopped it.
    ``answers``: its loss takes :class:`~.data.Windows` with the answer flags (where the
    data has prompts: ``tokens.train_answers``)."""
    task.teacher.eval()
    tuner = thread_tuner(threads) if threads is not None else None
    work_dir = Path(work_dir)
    return train_loop(task.student, tokens.train, stage, seq_len, seed, work_dir,
                      work_dir / "train_log.jsonl", loss_fn=task.loss_fn, resume=resume,
                      desc=task.kind, progress=progress, tuner=tuner, probe=task.probe,
                      answers=tokens.train_answers if answers else None)
