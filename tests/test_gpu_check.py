"""The GPU measurement script is ready to run: on a machine without a usable GPU it says
what is missing in one line (exit 3), and its roofline part runs end to end on the CPU
with tiny shapes (so a GPU session spends its minutes measuring, not debugging)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_check_says_what_is_missing():
    run = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh")], capture_output=True, text=True,
                         env={"PY": sys.executable, "PATH": "/usr/bin:/bin"}, timeout=60)
    assert run.returncode == 3, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("gpu_check: torch") and ("CPU-only build" in line or "sees no GPU" in line), line


@pytest.mark.slow  # 10-20 s: sorted first (conftest.py), never a worker's last test
def test_roofline_script_runs_on_tiny_shapes(tmp_path):
    out = tmp_path / "roofline.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_roofline.py"), "--device", "cpu", "--dtype",
                          "float32", "--shapes", "tiny", "--draft-shape", "tiny-draft", "--tokens", "16",
                          "--prompt-tokens", "8", "--capture", "--out", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # this tree's quickdraft
    assert run.returncode == 0, run.stderr[-2000:]
    row = json.loads(out.read_text())["models"]["tiny"]
    assert "error" not in row, row["error"]
    assert row["weight_bytes"] > 0 and row["ours_plain"]["decode_tokens_per_s"] > 0
    assert row["hf_generate"]["tokens_per_s"] > 0 and row["hf_assisted"]["tokens_per_s"] > 0
    # The same weights in both runtimes: greedy float32 decoding agrees (random weights
    # leave near-ties, so at least the first tokens), and the draft row is lossless.
    assert row["ours_vs_hf_agree_tokens"] >= 4 and row["ours_draft_equals_plain"]
    assert row["ours_plain_captured"]["decode_tokens_per_s"] > 0  # the static step, eager on the CPU


@pytest.mark.slow  # 10-20 s: sorted first (conftest.py), never a worker's last test
def test_overheads_script_runs_on_the_cpu(tmp_path):
    out = tmp_path / "overheads.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_overheads.py"), "--device", "cpu", "--dtype",
                          "float32", "--shape", "tiny", "--copy-mib", "8", "--out", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    for part in ("sync", "launch", "copy", "gemv_8b_mlp", "step", "growing"):
        assert "error" not in result[part], (part, result[part])
    assert result["step"]["step_wall_us"] > 0 and result["step"]["top_by_cpu"]
    assert result["launch"]["launch_us_per_kernel"] > 0 and result["copy"]["bytes_per_s_read_plus_write"] > 0
    assert all(result["growing"][f"{name}_step_ms"] > 0 for name in ("torch_default", "quickdraft"))
