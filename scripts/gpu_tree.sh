#!/usr/bin/env bash
# The device tool sends this checkout's working tree to the GPU machine, at most 64 MiB,
# and the tree holds ~110 MB (mostly model and head weights). This makes branch
# gpu-tree from HEAD without what the GPU check does not need (the SmolLM2 draft, the
# heads other than EAGLE and the first exit head, docs, data, images, the CPU tests),
# and prints the size that would travel. Use it, then go back:
#   scripts/gpu_tree.sh && git checkout gpu-tree     # then the device call(s), then:
#   git checkout -          # never merge gpu-tree
# --code leaves out every shipped model and head as well (and all data but the SmolLM2
# self-distillation shards): ~2 MiB, for calls that carry their own model files
# (scripts/gpu_smollm2.sh) or need none (the roofline and overhead timings).
# Wheels the machine lacks (fastapi, uvicorn, pydantic, prometheus-client,
# opentelemetry-api for the server part) travel as .whl/ (carry: [".whl"]); see
# docs/gpu.md, "Measuring on a GPU machine".
set -euo pipefail
cd "$(dirname "$0")/.."
[ -z "$(git status --porcelain --untracked-files=no)" ] || { echo "gpu_tree: commit or stash first" >&2; exit 2; }
code_only=0; [ "${1:-}" = --code ] && code_only=1
tmp=$(mktemp -d)
git worktree add -q --detach "$tmp" HEAD
(
    cd "$tmp"
    git rm -rq --ignore-unmatch docs data \
        quickdraft/assets/models/qd-smollm2-135m-draft \
        quickdraft/assets/heads/smollm2-135m-exit8x \
        quickdraft/assets/heads/smollm2-135m-eagle \
        quickdraft/assets/heads/qd-stdlib-target-prophet1 \
        quickdraft/assets/heads/qd-stdlib-target-medusa4 \
        quickdraft/assets/heads/qd-stdlib-target-exit1x
    if [ $code_only = 1 ]; then
        git rm -rq quickdraft/assets/models quickdraft/assets/heads
        git checkout -q HEAD -- data/selfdistill/smollm2-135m data/selfdistill/smollm2-135m-s1
    fi
    git ls-files 'quickdraft/assets/*.png' 'tests/*' | grep -v -E '^tests/(test_gpu.py|conftest.py)$' \
        | xargs -r git rm -q
    git commit -qm "gpu-tree: what the GPU check needs, under the device tool's 64 MiB (never merged)"
    git branch -f gpu-tree HEAD
    bytes=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
    echo "gpu_tree: branch gpu-tree, $((bytes / 1048576)) MiB of tracked files (+ .whl/ if carried; limit 64 MiB)"
)
git worktree remove --force "$tmp"
