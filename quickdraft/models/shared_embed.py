"""A draft that shares its target's embeddings: they are not in its safetensors, and loading
fills them from the loaded target, the same tensor (no copy, no extra memory).

A draft trained ``--from-target`` keeps the target's embedding (and, tied to it, LM head)
matrix frozen, so shipping it again would only repeat the target: for SmolLM2-135M that is
57 of a 2-layer draft's 68 MB. Its ``quickdraft.json`` records where they come from and a
fingerprint of the target's tensor, so a draft paired with another target is refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from .errors import CheckpointError
from .registry import read_meta

#: The ``quickdraft.json`` key of a draft whose embeddings are its target's.
SHARED_KEY = "shared_embeddings"
#: The Hugging Face name of the shared tensor (tied to the LM head when the config says so).
EMBED_NAME = "model.embed_tokens.weight"


def fingerprint(weight: torch.Tensor) -> str:
    """sha256 of the tensor's fp32 values: what a draft's target must hold, exactly."""
    data = weight.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def shared_spec(target_weight: torch.Tensor, target_name: str) -> dict:
    """What a draft's ``quickdraft.json`` records under :data:`SHARED_KEY`: the tensor's
    fingerprint, and that of its bfloat16 rounding (the target loaded ``--dtype bfloat16``
    holds that one; the draft then takes the rounded tensor, as the target computes with it)."""
    return {"from": "target", "target": target_name, "tensor": EMBED_NAME,
            "shape": list(target_weight.shape), "sha256": fingerprint(target_weight),
            "sha256_bfloat16": fingerprint(target_weight.to(torch.bfloat16))}


def read_shared(model_dir: Path) -> dict | None:
    """The draft's shared-embedding record, or None for a self-contained checkpoint."""
    if not Path(model_dir).is_dir():
        return None
    return read_meta(Path(model_dir)).get(SHARED_KEY)


def input_embedding(model) -> torch.Tensor:
    """The embedding matrix of a loaded model: a native ``Transformer``, a transformers
    model, or either wrapped in ``NativeLM`` / ``HFCausalLM`` (their ``.model``)."""
    from .transformer import Transformer

    inner = getattr(model, "model", model) if not hasattr(model, "get_input_embeddings") else model
    if isinstance(inner, Transformer):
        return inner.embed.weight
    return inner.get_input_embeddings().weight


def shared_tensors(draft_dir: Path, target) -> dict[str, torch.Tensor] | None:
    """The tensors a draft takes from ``target`` (a loaded model), checked against the
    draft's record; None when the draft ships its own. Refuses a target whose embedding is
    not the one the draft was trained with."""
    spec = read_shared(draft_dir)
    if spec is None:
        return None
    weight = input_embedding(target)
    known = {spec["sha256"], spec.get("sha256_bfloat16")}
    if list(weight.shape) != spec["shape"] or fingerprint(weight) not in known:
        raise CheckpointError(
            f"draft {draft_dir} shares the embeddings of {spec['target']}, but this target's "
            f"(shape {list(weight.shape)}) differ; pair it with {spec['target']}, or pass a "
            "draft trained for this target")
    return {spec["tensor"]: weight.detach()}


def missing_target_error(draft_dir: Path) -> CheckpointError:
    spec = read_shared(draft_dir) or {}
    return CheckpointError(
        f"draft {draft_dir} takes its embeddings from its target {spec.get('target')}; load it "
        f"with its target (e.g. --model {spec.get('target')} --draft {draft_dir})")


def fill_hf(model, shared: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Put the target's embedding into a transformers draft (and its tied LM head)."""
    weight = torch.nn.Parameter(shared[EMBED_NAME].to(dtype), requires_grad=False)
    model.get_input_embeddings().weight = weight
    if getattr(model.config, "tie_word_embeddings", False):
        model.get_output_embeddings().weight = weight
