"""Training curves as TensorBoard event files: the training loop writes them, the cards and
the docs' charts read them back, and ``tensorboard --logdir DIR`` shows them live.

One run writes one directory (``WORK/tensorboard``, copied to ``OUT/tensorboard``). Tags
are ``train/<name>`` every ``--log-every`` steps, ``probe/<name>`` when the run measures
its drafter while it trains (acceptance per step), ``eval/<name>`` after training. A
resumed run continues the same directory: events written after its checkpoint by the run
that crashed are purged, so the curves read as one uninterrupted run.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

TB_DIR = "tensorboard"


class Tracker:
    """Scalars of one run, written as TensorBoard event files under ``log_dir``.

    ``resume_step``: the checkpoint step a resumed run starts from (events after it are
    dropped); ``None`` starts afresh and deletes what ``log_dir`` held.
    """

    def __init__(self, log_dir: Path, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(log_dir)
        if resume_step is None and log_dir.exists():
            shutil.rmtree(log_dir)
        elif resume_step is not None:
            _start_after_existing_files(log_dir)
        # Logged steps are 1-based (the step just done), so a checkpoint at step s keeps
        # events up to s and purges from s + 1 on.
        self.writer = SummaryWriter(str(log_dir), purge_step=None if resume_step is None else resume_step + 1)

    def scalars(self, step: int, group: str, values: dict[str, float]) -> None:
        """Write ``group/name`` = value at ``step`` for each finite number in ``values``."""
        for name, value in values.items():
            if isinstance(value, (int, float)) and value == value:  # NaN: nothing to chart
                self.writer.add_scalar(f"{group}/{name}", float(value), step)

    def close(self) -> None:
        self.writer.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _start_after_existing_files(log_dir: Path) -> None:
    """Wait until this second is later than every event file's in ``log_dir``.

    TensorBoard applies a purge only to the files that sort before the purging one, and
    files sort by name: creation second, host, pid, then a per-process counter compared as
    text ("10" sorts before "9"). A resume in the same second as the run it purges (in one
    process: tests, or ``log_scalars`` right after training) could sort first and purge
    nothing; a later second always sorts after. Waits at most a second."""
    seconds = []
    for path in log_dir.glob("events.out.tfevents.*"):
        field = path.name.split(".")[3]
        if field.isdigit():
            seconds.append(int(field))
    while seconds and int(time.time()) <= max(seconds):
        time.sleep(0.05)


def log_scalars(log_dir: Path, step: int, group: str, values: dict[str, float]) -> None:
    """Append scalars to an existing run's directory (e.g. held-out results after training)."""
    with Tracker(log_dir, resume_step=step) as tracker:
        tracker.scalars(step, group, values)


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the run in ``log_dir`` as ``[(step, value), ...]`` in step order,
    read with TensorBoard's own reader (which applies purges from resumed runs)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}
