"""Training curves in TensorBoard event files: written by the loop, purged on resume, read
back by TensorBoard's own reader for the cards' charts; acceptance probed while training."""

from __future__ import annotations

import numpy as np
import torch

from quickdraft.train.card import plot_acceptance, read_curves
from quickdraft.train.probe import acceptance_probe, probe_prompts
from quickdraft.train.tracker import Tracker, read_scalars


def test_a_resumed_run_replaces_what_the_crashed_run_logged_after_its_checkpoint(tmp_path):
    with Tracker(tmp_path) as run:
        for step in range(1, 9):  # crashed after logging step 8; last checkpoint at step 5
            run.scalars(step, "train", {"loss": 100.0 + step, "nan": float("nan")})
    with Tracker(tmp_path, resume_step=5) as run:
        for step in range(6, 11):
            run.scalars(step, "train", {"loss": float(step)})
    curves = read_scalars(tmp_path)
    assert set(curves) == {"train/loss"}  # a NaN is not charted
    assert curves["train/loss"] == [(s, 100.0 + s) for s in range(1, 6)] + [(s, float(s)) for s in range(6, 11)]
    with Tracker(tmp_path) as run:  # a fresh start forgets the old run
        run.scalars(1, "train", {"loss": 7.0})
    assert read_scalars(tmp_path) == {"train/loss": [(1, 7.0)]}


def test_a_resume_purges_even_when_its_file_name_sorts_first(tmp_path):
    """TensorBoard orders event files by name, whose last field is a per-process counter
    compared as text: a writer numbered 10 sorts before one numbered 9. Within one second
    that let a resumed run purge nothing (a flaky CI failure); the tracker now starts a
    resume in a later second than the files it purges."""
    from tensorboard.summary.writer import event_file_writer

    while event_file_writer._global_uid.get() % 10 != 8:  # the next two writers: ...9, then ...10
        pass
    test_a_resumed_run_replaces_what_the_crashed_run_logged_after_its_checkpoint(tmp_path)


def test_the_probe_measures_what_decoding_accepts(tiny_family, tmp_path):
    """The probe decodes fixed held-out prompts: a copy of the target is always
    accepted, an unrelated draft less; the chart reads the figures back from event files."""
    from quickdraft.drafters.draft_model import DraftModelDrafter
    from quickdraft.models.lm import load_model

    target = load_model(tiny_family["target"])
    copy, unrelated = load_model(tiny_family["copy"]), load_model(tiny_family["unrelated"])
    stream = np.arange(400, dtype=np.uint16) % 50 + 10
    prompts = probe_prompts(stream, n=3, length=12)
    assert len(prompts) == 3 and all(p.shape == (12,) for p in prompts)
    assert torch.equal(prompts[0], torch.as_tensor(stream[:12], dtype=torch.long))
    same = acceptance_probe(target, lambda: DraftModelDrafter(copy, target.vocab_size), prompts, k=3, new_tokens=12)
    assert same["mean_accepted_tokens"] >= 3.0 and same["accept_rate/pos1"] == 1.0  # a copy of the target drafts
    other = acceptance_probe(target, lambda: DraftModelDrafter(unrelated, target.vocab_size), prompts, k=3, new_tokens=12)
    assert 1.0 <= other["mean_accepted_tokens"] < same["mean_accepted_tokens"]
    with Tracker(tmp_path / "tensorboard") as run:
        run.scalars(0, "probe", other)
        run.scalars(10, "probe", same)
    assert read_curves(tmp_path)["probe/mean_accepted_tokens"] == [
        (0, other["mean_accepted_tokens"]), (10, same["mean_accepted_tokens"])]
    assert plot_acceptance(tmp_path, tmp_path / "acceptance.png", "t") and (tmp_path / "acceptance.png").stat().st_size
