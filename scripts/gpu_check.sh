#!/usr/bin/env bash
# The GPU measurement of issue #28, as one command on a machine with a CUDA GPU:
#   scripts/gpu_check.sh            (or: make gpu-check)
# Parts, each under its own time limit so one failing keeps the others' results:
#   1. make test-gpu (pytest -m gpu): every method lossless on cuda, host syncs per step
#   2. quickdraft bench --device cuda --dtype bfloat16 on the embedded pair, with
#      transformers generate / assisted generation (hf-ar, hf-assisted) as baselines
#   3. the roofline: plain decoding on random Llama-1B / 8B-shaped bf16 models against
#      weight bytes / HBM bandwidth, with transformers generate and assisted generation
#   4. the 8B's plain decoding again with the step captured (--capture)
#   5. the server on the GPU: 1 and 8 concurrent streams (quickdraft.server.loadtest)
#   6. overheads: a synchronisation, a kernel launch, HBM copy, a GEMV, one profiled 1B step
#      (the fixed ~55 ms step found on the first H200 run: scripts/gpu_overheads.py)
# Results go to results/gpu/<date>-<gpu>/ (JSON, logs). Total: under 10 minutes.
# PARTS=test-gpu,roofline (names as above) runs only those; OUT=DIR picks the folder, so
# two calls can fill one folder (e.g. the tests beside a training job, then the timings).
# The machine needs no network, but a CUDA build of torch in the venv: part 0 checks.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)  # no venv here: the system's Python, if it has torch
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this tree's quickdraft, installed or not

# 0. Is there a CUDA GPU that this torch can use? Say exactly what is missing if not.
if ! "$PY" - <<'EOF'
import sys
try:
    import torch
except ImportError as exc:
    sys.exit(f"gpu_check: torch is not importable with this Python ({exc}); run `make install "
             "TORCH_INDEX=https://download.pytorch.org/whl/cu128` where there is network")
if torch.version.cuda is None:
    sys.exit(f"gpu_check: torch {torch.__version__} is a CPU-only build; a CUDA build is needed: "
             "`make install TORCH_INDEX=https://download.pytorch.org/whl/cu128` (needs network), "
             "or carry a venv with a CUDA torch")
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU; check "
             "nvidia-smi and the driver")
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
EOF
then
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    exit 3
fi

GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-'))")
OUT=${OUT:-results/gpu/$(date -u +%Y%m%dT%H%M%SZ)-$GPU}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
echo "gpu_check: results in $OUT"
status=0

PARTS=${PARTS:-test-gpu,bench-embedded,roofline,roofline-captured,server,overheads}
part() {  # part NAME SECONDS COMMAND...: run with a time limit, log, record its exit code
    local name=$1 limit=$2; shift 2
    case ",$PARTS," in *",$name,"*) ;; *) return 0 ;; esac
    local started=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc after $((SECONDS - started)) s" | tee -a "$OUT/parts.txt"
    tail -n 15 "$OUT/$name.log"
    [ $rc -eq 0 ] || status=1
}

# 1. The GPU tests (make test-gpu, with a JUnit report).
part test-gpu 140 env QUICKDRAFT_REQUIRE_GPU=1 "$PY" -m pytest -q -m gpu tests -p no:cacheprovider \
    --junitxml="$OUT/test-gpu.xml"

# 2. The embedded pair: our methods against transformers on the same GPU, bf16, greedy.
part bench-embedded 85 "$PY" -m quickdraft bench --device cuda --dtype bfloat16 --quick --quiet -k 4 \
    --methods ar,draft,ngram,tree,hybrid,eagle,early-exit,hf-ar,hf-assisted --json "$OUT/bench-embedded.json"

# 3. The roofline on Llama-shaped random models (1B, 8B; the 8B's draft is the 1B).
part roofline 125 "$PY" scripts/gpu_roofline.py --device cuda --dtype bfloat16 --shapes llama-1b,llama-8b \
    --tokens 128 --out "$OUT/roofline.json"

# 4. The same plain decoding with the step captured (CUDA graphs through torch.compile), 8B.
part roofline-captured 115 "$PY" scripts/gpu_roofline.py --device cuda --dtype bfloat16 --shapes llama-8b \
    --draft-shape none --no-hf --capture --tokens 128 --out "$OUT/roofline-captured.json"

# 4b. (not in the default PARTS) the same with the matrix kernels tuned too: the captured 8B
#     step ran at 50% of the roofline, 93% of an isolated cuBLAS GEMV's bandwidth (2026-11-29).
part roofline-autotune 300 "$PY" scripts/gpu_roofline.py --device cuda --dtype bfloat16 --shapes llama-8b \
    --draft-shape none --no-hf --capture --capture-mode max-autotune --tokens 128 --out "$OUT/roofline-autotune.json"
# 5. The server on the GPU (bf16): aggregate tokens/s of 8 concurrent streams against 1.
part server 85 "$PY" -m quickdraft.server.loadtest --start --categories short,long --requests 16 \
    --max-tokens 128 --concurrency 1,8 --json "$OUT/server-load.json" -- --device cuda

# 6. Where a step's fixed cost goes: sync, launch, copy, GEMV, one profiled 1B step.
part overheads 60 "$PY" scripts/gpu_overheads.py --device cuda --dtype bfloat16 --out "$OUT/overheads.json"

echo "gpu_check: done (exit $status); results in $OUT"
exit $status
