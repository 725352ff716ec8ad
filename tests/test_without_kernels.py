"""Every method where our C kernels do not run (no AVX2, say an ARM machine, or no C
compiler): PyTorch's kernels instead, run in a subprocess with
``QUICKDRAFT_NATIVE_KERNELS=0`` so nothing compiled or cached in this process leaks in.
The rest of the suite runs with the kernels, so these paths had no other test: sampled
EAGLE and EAGLE trees failed there on the float16 draft cache ("Index put requires the
source and destination dtypes match")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
from quickdraft.drafters.factory import BATCH_METHODS, METHODS
from quickdraft.generator import SpeculativeGenerator
from quickdraft.models import cpu_kernels

assert cpu_kernels.library() is None
plain = SpeculativeGenerator.from_pretrained(method="ar")
prompts = [plain.tokenizer("def")["input_ids"][-1:], "def median(values):\n"]
report = {}
for method in [m for m in METHODS if m != "ar"]:
    gen = SpeculativeGenerator.from_pretrained(method=method)
    checks = []
    for prompt in prompts:
        want = plain.generate(prompt, max_new_tokens=12).token_ids
        checks.append(gen.generate(prompt, max_new_tokens=12, num_speculative_tokens=3).token_ids == want)
        sampled = gen.generate(prompt, max_new_tokens=12, temperature=0.8, seed=0, num_speculative_tokens=3)
        checks.append(len(sampled.token_ids) == sampled.stats.new_tokens > 0)
    if method in BATCH_METHODS:
        rows = gen.generate(prompts, max_new_tokens=12, num_speculative_tokens=3)
        checks.append([r.token_ids for r in rows] == [plain.generate(p, max_new_tokens=12).token_ids for p in prompts])
    report[method] = checks
print(json.dumps(report))
"""


@pytest.mark.slow
def test_every_method_runs_and_stays_lossless_without_our_kernels():
    env = {**os.environ, "QUICKDRAFT_NATIVE_KERNELS": "0"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {method: checks for method, checks in report.items() if not all(checks)}
    assert not failed, failed
