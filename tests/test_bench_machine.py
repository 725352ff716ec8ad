"""One machine description for training runs and benchmarks."""

from __future__ import annotations

from quickdraft.machine import machine_info


def test_machine_info_has_what_cards_and_reports_read():
    info = machine_info(threads=3)
    # train/card.py reads these; bench/report.py reads cpu and threads
    for key in ("platform", "machine", "processor", "cpu", "cpu_count", "threads", "python", "torch",
                "transformers"):
        assert key in info, key
    assert info["threads"] == 3


def test_training_and_bench_use_the_same_function():
    import quickdraft.bench.runner as runner
    import quickdraft.train.pipeline as pipeline

    assert not hasattr(pipeline, "hardware")
    assert pipeline.machine_info is machine_info and runner.machine_info is machine_info
