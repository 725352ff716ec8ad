#!/usr/bin/env bash
# SmolLM2-135M-Instruct on a GPU machine reached through the device tool, whose calls carry
# at most 64 MiB: the 94 MiB GGUF travels in two halves, one per call, while the machine
# stays warm (it keeps /tmp between calls for ~30 s of idleness).
#
# Here, once:   scripts/gpu_smollm2.sh split        (writes .gguf-a/ and .gguf-b/, ignored)
#               scripts/gpu_tree.sh --code && git checkout gpu-tree
# Device call 1 (carry [".whl", ".gguf-a"]):  scripts/gpu_smollm2.sh stash .gguf-a
#   (any timing parts can follow in the same call: they need no model files)
# Device call 2 (carry [".whl", ".gguf-b"]):  scripts/gpu_smollm2.sh run .gguf-b
#   joins the halves (checked against the sha256 recorded at split), then the stages in
#   STAGES (default data,eagle,server): the target writes chat and code data on the GPU
#   (`train data`, DATA_SECONDS), an EAGLE drafter trains on it and the shipped shards
#   (TRAIN_LIMIT), and the server is loaded with SmolLM2 (1 vs 8 streams). A later call
#   (`run .gguf-b` again, the GGUF already joined) can run other stages.
# Results: $RES (default /tmp/qd-smol-results), tarred into $OUT when $OUT is set.
set -u
cd "$(dirname "$0")/.."
STASH=/tmp/qd-gguf
RES=${RES:-/tmp/qd-smol-results}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

pack() {  # the results so far, into the tool's $OUT (a killed command returns only what is there)
    [ -n "${OUT:-}" ] && tar -czf "$OUT/smollm2-results.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"
    return 0
}

case "${1:-}" in
split)
    src=$(.venv/bin/python -c "from quickdraft.models.loading import resolve_model_dir as r; print(r('smollm2-135m'))")
    [ -f "$src" ] || { echo "gpu_smollm2: SmolLM2 is not installed: quickdraft models install smollm2-135m" >&2; exit 2; }
    rm -rf .gguf-a .gguf-b && mkdir -p .gguf-a .gguf-b
    head -c 57671680 "$src" > .gguf-a/part    # 55 MiB
    tail -c +57671681 "$src" > .gguf-b/part
    sha256sum "$src" | cut -d' ' -f1 | tee .gguf-a/sha256 > .gguf-b/sha256
    du -b .gguf-a/part .gguf-b/part
    ;;
stash)
    mkdir -p "$STASH" && cp "$2/part" "$STASH/a" && cp "$2/sha256" "$STASH/sha256"
    echo "gpu_smollm2: first half kept in $STASH ($(du -b "$STASH/a" | cut -f1) bytes)"
    ;;
run)
    if [ ! -f "$STASH/$GGUF_NAME" ]; then
        [ -f "$STASH/a" ] || { echo "gpu_smollm2: $STASH/a is gone (the machine went cold); run call 1 again" >&2; exit 3; }
        cat "$STASH/a" "$2/part" > "$STASH/$GGUF_NAME"
    fi
    [ "$(sha256sum "$STASH/$GGUF_NAME" | cut -d' ' -f1)" = "$(cat "$2/sha256")" ] \
        || { echo "gpu_smollm2: the joined GGUF does not match its sha256" >&2; exit 4; }
    GGUF=$STASH/$GGUF_NAME
    PY=${PY:-python3}
    DEVICE=${DEVICE:-cuda}  # DEVICE=cpu PY=.venv/bin/python NO_WHEELS=1: a dry run on a CPU
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    # gguf (the loader) and the server's packages: the machine has torch and transformers only
    if [ -d .whl ] && [ -z "${NO_WHEELS:-}" ]; then
        "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
    mkdir -p "$RES"
    nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
    STAGES=",${STAGES:-data,eagle,server},"
    # 1. Self-distillation data on the GPU (bf16): chat through the template, self-instruct,
    #    code continuations; 128 rows at a time. The shipped shards hold only ~35k chat tokens.
    if [[ $STAGES == *,data,* ]]; then
        "$PY" -m quickdraft train data --target "$GGUF" --out "$RES/selfdistill-gpu" \
            --tokens "${DATA_TOKENS:-3000000}" --batch-size "${DATA_ROWS:-128}" --shard-jobs 256 \
            --max-seconds "${DATA_SECONDS:-150}" --device "$DEVICE" --no-progress > "$RES/data.log" 2>&1
        echo "data: exit $?" | tee -a "$RES/parts.txt"; tail -n 4 "$RES/data.log"
        pack
    fi
    DATA=(data/selfdistill/smollm2-135m stdlib)
    [ -d "$RES/selfdistill-gpu" ] && DATA=("$RES/selfdistill-gpu" "${DATA[@]}")
    STEPS=${STEPS:-1100}  # the H100 ran 1,128 of 1,200 in its 280 s (~95 s of loading first)
    # 2. EAGLE for SmolLM2 (the CPU run's settings, 16x the tokens a step); SIGINT at the
    #    limit still saves a usable drafter (its optimizer checkpoints are dropped below:
    #    too large to come back).
    [[ $STAGES == *,eagle,* ]] && {
    timeout -s INT --kill-after=30 "${TRAIN_LIMIT:-280}" "$PY" -m quickdraft train heads --kind eagle \
        --target "$GGUF" --data "${DATA[@]}" --out "$RES/smollm2-135m-eagle" \
        --steps "$STEPS" --seq-len 512 --batch-size "${EAGLE_ROWS:-16}" --lr 1.5e-3 --warmup 40 --reg-weight 0.5 \
        --ttt-steps 5 --draft-vocab 4096 --ckpt-every 250 --log-every 25 --eval-tokens 65536 \
        --device "$DEVICE" --no-progress > "$RES/eagle-train.log" 2>&1
    echo "eagle-train: exit $?" | tee -a "$RES/parts.txt"; tail -n 8 "$RES/eagle-train.log"
    rm -rf "$RES/smollm2-135m-eagle-work/checkpoints"   # 3x the head's size; the head is enough
    pack
    }
    # 3. The server on SmolLM2, bf16 on the GPU: 8 concurrent streams against 1, plain
    #    decoding (this copy has no SmolLM2 draft, the server's default method).
    [[ $STAGES == *,server,* ]] && {
    timeout --kill-after=10 "${SERVER_LIMIT:-100}" "$PY" -m quickdraft.server.loadtest --start \
        --categories short --requests 16 --max-tokens 128 --concurrency 1,8 \
        --json "$RES/server-load-smollm2.json" -- --model "$GGUF" --device "$DEVICE" --method ar > "$RES/server.log" 2>&1
    echo "server: exit $?" | tee -a "$RES/parts.txt"; tail -n 12 "$RES/server.log"
    pack
    }
    exit 0
    ;;
*)
    echo "usage: scripts/gpu_smollm2.sh split | stash DIR | run DIR (see the top of this file)" >&2
    exit 2
    ;;
esac
