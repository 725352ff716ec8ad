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
# --code --eagle-init keeps SmolLM2's shipped EAGLE drafter and the first greedy shards
# too, without the datastore (~20 MiB), in branch gpu-tree-eagle: gpu_smollm2.sh then trains the drafter on from where
# it is. For its second call only (with .gguf-b, ~39 MiB, and .whl); the first, with
# .gguf-a's 55 MiB, goes from gpu-tree (--code).
# Wheels the machine lacks (fastapi, uvicorn, pydantic, prometheus-client,
# opentelemetry-api for the server part) travel as .whl/ (carry: [".whl"]); see
# docs/gpu.md, "Measuring on a GPU machine".
set -euo pipefail
cd "$(dirname "$0")/.."
[ -z "$(git status --porcelain --untracked-files=no)" ] || { echo "gpu_tree: commit or stash first" >&2; exit 2; }
code_only=0; [ "${1:-}" = --code ] && code_only=1
eagle_init=0; [ "${2:-}" = --eagle-init ] && eagle_init=1
branch=gpu-tree; [ $eagle_init = 1 ] && branch=gpu-tree-eagle  # both exist at once: one per call
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
        # (no datastore either: 5.6 MiB that left gpu-tree 0.4 MB under the limit beside .gguf-a)
        git rm -rq quickdraft/assets/models quickdraft/assets/heads quickdraft/assets/datastores
        git checkout -q HEAD -- data/selfdistill/smollm2-135m data/selfdistill/smollm2-135m-s1 \
            data/selfdistill/smollm2-135m-gpu-1 data/selfdistill/smollm2-135m-gpu-2
        if [ $eagle_init = 1 ]; then  # what gpu_smollm2.sh's EAGLE stage starts from and adds
            git checkout -q HEAD -- quickdraft/assets/heads/smollm2-135m-eagle data/selfdistill/smollm2-135m-greedy
            # (greedy2's 9.3 MiB would not fit beside .gguf-b)
            git rm -rq --ignore-unmatch quickdraft/assets/heads/smollm2-135m-eagle/tensorboard
        fi
    fi
    git ls-files 'quickdraft/assets/*.png' 'tests/*' | grep -v -E '^tests/(test_gpu.py|conftest.py)$' \
        | xargs -r git rm -q
    git commit -qm "gpu-tree: what the GPU check needs, under the device tool's 64 MiB (never merged)"
    git branch -f "$branch" HEAD
    bytes=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
    echo "gpu_tree: branch $branch, $((bytes / 1048576)) MiB of tracked files (+ .whl/ if carried; limit 64 MiB)"
)
git worktree remove --force "$tmp"
