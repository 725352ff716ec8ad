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
#   STAGES (default data,eagle,draft,exit; eagle-all: EAGLE with --loss-on all beside it):
#   DATA_PROCS writers of the target write chat and code data on the GPU (`train data`,
#   DATA_SECONDS), then the EAGLE drafter, the separate draft and the layer-8 exit head
#   train on it side by side (TRAIN_LIMIT each). A later call (`run .gguf-b` again, the
#   GGUF already joined) can run other stages.
#   Dry run on a CPU: DEVICE=cpu PY=.venv/bin/python NO_WHEELS=1 with tiny DATA_ROWS,
#   SHARD_JOBS, TRAIN_ROWS, *STEPS and EVAL_TOKENS.
# Results: $RES (default /tmp/qd-smol-results), tarred into $OUT when $OUT is set
# (one tarball per data folder and model, plus logs.tgz).
set -u
cd "$(dirname "$0")/.."
STASH=/tmp/qd-gguf
RES=${RES:-/tmp/qd-smol-results}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

pack() {  # the results so far into the tool's $OUT: a tarball per artefact (at most 8 files of
          # 16 MiB come back), the logs and the work folders (logs, no checkpoints) in one
    [ -n "${OUT:-}" ] || return 0
    local d
    for d in "$RES"/*/; do
        d=$(basename "$d")
        [[ $d == *-work ]] || tar -czf "$OUT/$d.tgz" -C "$RES" "$d"
    done
    (cd "$RES" && tar -czf "$OUT/logs.tgz" --exclude='checkpoints' $(ls -d -- *.log *.txt *-work 2>/dev/null))
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
    STAGES=",${STAGES:-data,eagle,draft,exit},"
    # 1. Self-distillation data on the GPU (bf16): chat through the template, self-instruct,
    #    code continuations. DATA_PROCS writers, each its own seed (DATA_SEED0 + 1, + 2, ...: greedy
    #    writers of a seed already committed write the same documents again; committed: 0-3,
    #    11, 12 in data/selfdistill/smollm2-135m-gpu-1, -2, 41 and 42 in -si41, -si42) and folder, share the GPU: one
    #    writer leaves it mostly idle (batch 256 of a
    #    135M model). The shipped shards hold only ~35k chat tokens. Greedy by default
    #    (DATA_TEMPERATURE): greedy answers are what moved SmolLM2's chat acceptance most
    #    (sessions 38-39); DATA_MIX weights chat / self-instruct / code (e.g.
    #    chat=2,self-instruct=8: the built-in instructions already have greedy answers in
    #    data/selfdistill/smollm2-135m-greedy2, self-instruct questions are new each seed).
    if [[ $STAGES == *,data,* ]]; then
        # --max-seconds is checked between shards only: a hard stop 60 s later keeps a slow
        # writer (session 23's H200 wrote no 256-job shard in 9 minutes, before ragged passes
        # attended in one call on CUDA) from eating the training stages' time; shards
        # already written stay usable.
        for i in $(seq 1 "${DATA_PROCS:-2}"); do
            timeout -s INT --kill-after=10 "$(( ${DATA_SECONDS:-150} + 60 ))" \
            "$PY" -m quickdraft train data --target "$GGUF" --out "$RES/selfdistill-gpu-$i" --seed "$(( ${DATA_SEED0:-20} + i ))" \
                --tokens "${DATA_TOKENS:-3000000}" --batch-size "${DATA_ROWS:-128}" --shard-jobs "${SHARD_JOBS:-128}" \
                --temperature "${DATA_TEMPERATURE:-0}" ${DATA_MIX:+--mix "$DATA_MIX"} \
                --max-seconds "${DATA_SECONDS:-150}" --device "$DEVICE" --no-progress > "$RES/data-$i.log" 2>&1 &
        done
        wait
        tail -n 2 "$RES"/data-*.log | tee -a "$RES/parts.txt"
        pack
    fi
    GPU_DATA=()
    for d in "$RES"/selfdistill-gpu-*; do  # only folders that hold a shard
        compgen -G "$d/shard-*.npy" > /dev/null && GPU_DATA+=("$d")
    done
    # shipped: seeds 0, 1, and session 49's GPU greedy sets (seeds 11, 12)
    SELF=("${GPU_DATA[@]}" data/selfdistill/smollm2-135m data/selfdistill/smollm2-135m-s1
          data/selfdistill/smollm2-135m-gpu-1 data/selfdistill/smollm2-135m-gpu-2)
    # and where they travelled: sessions 51-52's CPU greedy self-instruct sets (seeds 41, 42)
    for d in data/selfdistill/smollm2-135m-si41 data/selfdistill/smollm2-135m-si42 data/selfdistill/smollm2-135m-greedy2 data/selfdistill/smollm2-135m-greedy; do
        compgen -G "$d/shard-*.npy" > /dev/null && SELF+=("$d")  # greedy answers (sessions 38-39): what moved chat most; gpu_tree.sh
    done                             # --code --eagle-init carries the first set
    # EAGLE from the shipped drafter where it travelled (gpu_tree.sh --code --eagle-init),
    # with the target's layers 3 and 15 fused in (session 41: +1 point of held-out agreement
    # at every depth over the same training), at session 39's fine-tuning rate; else
    # session 18's recipe from scratch.
    EAGLE_INIT=quickdraft/assets/heads/smollm2-135m-eagle
    if [ -f "$EAGLE_INIT/model.safetensors" ]; then
        # No stdlib text: the shipped drafter was fine-tuned on the shards alone, and chat is
        # what is short of its goal (the shards hold code continuations too).
        EAGLE_ARGS=(--init "$EAGLE_INIT" --feature-layers 3,15,30 --lr 5e-4 --warmup 10 --ttt-steps 3)
        EAGLE_DATA=("${SELF[@]}")
    else
        EAGLE_ARGS=(--draft-vocab 4096 --lr 1.5e-3 --warmup 40 --ttt-steps 5)
        EAGLE_DATA=("${SELF[@]}" stdlib)
    fi
    STEPS=${STEPS:-1100}  # the H100 ran 1,128 of 1,200 in its 280 s (~95 s of loading first)
    LIMIT=${TRAIN_LIMIT:-280}
    # 2. The drafters, side by side on the GPU, each stopped by SIGINT at LIMIT (a usable
    #    model is saved; the optimizer checkpoints are dropped below: too large to come back).
    #    EAGLE: from the shipped drafter where it travelled (above), on the new data as well.
    #    Its loss counts the target's answers alone (`--loss-on answers`, the default since
    #    session 50; 43% of the shipped sets' held-out stream is prompts and separators).
    [[ $STAGES == *,eagle,* ]] && timeout -s INT --kill-after=30 "$LIMIT" "$PY" -m quickdraft train heads \
        --kind eagle --target "$GGUF" --data "${EAGLE_DATA[@]}" --out "$RES/smollm2-135m-eagle" \
        --steps "$STEPS" --seq-len 512 --batch-size "${TRAIN_ROWS:-16}" "${EAGLE_ARGS[@]}" --reg-weight 0.5 \
        --ckpt-every 250 --log-every 25 --eval-tokens "${EVAL_TOKENS:-65536}" \
        --device "$DEVICE" --no-progress > "$RES/eagle-train.log" 2>&1 &
    #    STAGES with eagle-all: the same run with the loss on every token beside it (the two
    #    arms session 50 could not tell apart on a CPU; docs/smollm2/heldout_agreement.py and
    #    drafter_ab.py compare them).
    [[ $STAGES == *,eagle-all,* ]] && timeout -s INT --kill-after=30 "$LIMIT" "$PY" -m quickdraft train heads \
        --kind eagle --target "$GGUF" --data "${EAGLE_DATA[@]}" --out "$RES/smollm2-135m-eagle-all" \
        --steps "$STEPS" --seq-len 512 --batch-size "${TRAIN_ROWS:-16}" "${EAGLE_ARGS[@]}" --reg-weight 0.5 \
        --loss-on all --ckpt-every 250 --log-every 25 --eval-tokens "${EVAL_TOKENS:-65536}" \
        --device "$DEVICE" --no-progress > "$RES/eagle-all-train.log" 2>&1 &
    #    The separate draft: two of the target's layers, hard labels of the target's own text
    #    (the shipped one saw 150 steps of 4 x 256 tokens on a CPU).
    [[ $STAGES == *,draft,* ]] && timeout -s INT --kill-after=30 "$LIMIT" "$PY" -m quickdraft train draft \
        --target "$GGUF" --data "${SELF[@]}" --out "$RES/qd-smollm2-135m-draft" --from-target --kl-weight 0 \
        --steps "${DRAFT_STEPS:-2000}" --seq-len 512 --batch-size "${TRAIN_ROWS:-16}" --lr 1e-3 --warmup 40 --ckpt-every 250 \
        --log-every 25 --probe-every 0 --eval-tokens "${EVAL_TOKENS:-16384}" --device "$DEVICE" --no-progress > "$RES/draft-train.log" 2>&1 &
    #    The early-exit head after layer 8 (the shipped one: 77 CPU steps of 4 x 256).
    [[ $STAGES == *,exit,* ]] && timeout -s INT --kill-after=30 "$LIMIT" "$PY" -m quickdraft train exit-head \
        --target "$GGUF" --data "${SELF[@]}" stdlib --out "$RES/smollm2-135m-exit8x" --exit-layer 8 --extra-block \
        --steps "${EXIT_STEPS:-2000}" --seq-len 512 --batch-size "${TRAIN_ROWS:-16}" --lr 2e-3 --warmup 40 --ckpt-every 250 \
        --log-every 25 --probe-every 0 --eval-tokens "${EVAL_TOKENS:-16384}" --device "$DEVICE" --no-progress > "$RES/exit-train.log" 2>&1 &
    wait
    for part in eagle eagle-all draft exit; do
        [ -f "$RES/$part-train.log" ] && { echo "== $part"; tail -n 4 "$RES/$part-train.log"; } | tee -a "$RES/parts.txt"
    done
    rm -rf "$RES"/*-work/checkpoints
    pack
    exit 0
    ;;
*)
    echo "usage: scripts/gpu_smollm2.sh split | stash DIR | run DIR (see the top of this file)" >&2
    exit 2
    ;;
esac
