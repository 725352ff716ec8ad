"""Our checkpoints as GGUF files, for llama.cpp (``quickdraft bench --baseline llama.cpp``).

A Llama-architecture safetensors checkpoint with a byte-level BPE ``tokenizer.json``
becomes one f32 GGUF file: ``llama.*`` metadata, the tensors under llama.cpp's names with
the q/k rows in its order (the inverse of :func:`.gguf.unpermute_rope_rows`), and the
tokenizer as ``tokenizer.ggml.model = "gpt2"``. Our tokenizers are ByteLevel with the GPT-2
split regex, which llama.cpp calls the ``gpt-2`` pre-tokenizer.

A draft that scores only part of the vocabulary (:mod:`.draft_vocab`) is exported with a
full-vocabulary head, since llama.cpp pairs a draft and a target by equal vocabularies.
The rows of tokens outside the draft vocabulary are the *mean* of the rows inside it: a
logit is then the mean of the draft-vocabulary logits, never above their maximum (equal
only when all of them are equal), so the draft's greedy choice is the one it makes with
its restricted head. Zero rows would not do: a zero logit wins whenever every scored
logit is negative.

Exports are kept in ``~/.cache/quickdraft/gguf-export/<key>.gguf``, the key a hash of the
checkpoint's files and the export's options, so a changed checkpoint is exported again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig
from .errors import CheckpointError
from .loading import load_state_dict, read_hf_config, read_model_config

#: Bumped when an export of the same checkpoint would differ.
EXPORT_VERSION = 1
#: Hugging Face Llama names -> llama.cpp's (``{i}``: the layer).
TOP_LEVEL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}
# The files whose bytes an export depends on.
HASHED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face Llama tensor."""
    if hf_name in TOP_LEVEL:
        return TOP_LEVEL[hf_name]
    parts = hf_name.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"]:
        module = ".".join(parts[3:-1])
        if module in LAYER:
            return f"blk.{parts[2]}.{LAYER[module]}.{parts[-1]}"
    raise CheckpointError(f"tensor {hf_name!r} has no llama.cpp name; only plain Llama checkpoints export to GGUF")


def permute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face q/k rows -> llama.cpp's order: each head's two rotary halves
    interleaved row by row (what its converter does; undone by ``unpermute_rope_rows``)."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def full_vocab_head(head: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A ``[vocab, hidden]`` head scoring ``ids`` with their own rows and every other token
    with the mean of those rows: its logit never exceeds the best scored one."""
    out = head[ids].mean(0).expand_as(head).clone()
    out[ids] = head[ids]
    return out


def _tokenizer_metadata(model_dir: Path, config: dict) -> dict:
    """The GGUF tokenizer fields of a byte-level BPE ``tokenizer.json``."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no tokenizer.json; GGUF export needs a byte-level BPE tokenizer")
    tok = json.loads(path.read_text())
    model, pre = tok.get("model", {}), tok.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise CheckpointError(f"{path}: only byte-level BPE tokenizers with the GPT-2 regex export to GGUF "
                              f"(found {model.get('type')} / {pre.get('type')})")
    vocab: dict[str, int] = dict(model["vocab"])
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    size = int(config["vocab_size"])
    tokens = [f"[PAD{i}]" for i in range(size)]  # ids the tokenizer leaves unused
    types = [5] * size  # 5: unused
    for text, i in vocab.items():
        if i < size:
            tokens[i], types[i] = text, 1  # 1: normal
    for added in tok.get("added_tokens", []):
        if added["id"] < size and added.get("special"):
            types[added["id"]] = 3  # 3: control
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text()) \
        if (model_dir / "tokenizer_config.json").is_file() else {}
    return {"tokens": tokens, "types": types, "merges": merges,
            "bos": config.get("bos_token_id"), "eos": config.get("eos_token_id"),
            "add_bos": bool(cfg.get("add_bos_token", False))}


def export_key(model_dir: Path, shared: dict[str, torch.Tensor] | None, head_ids: torch.Tensor | None) -> str:
    """A hash of what the export reads: the checkpoint's files, the shared tensors, the head."""
    h = hashlib.sha256(f"quickdraft-gguf-export:{EXPORT_VERSION}".encode())
    files = [model_dir / n for n in HASHED_FILES] + sorted(model_dir.glob("*.safetensors"))
    for f in files:
        if f.is_file():
            h.update(f.name.encode())
            with f.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
    for name, t in sorted((shared or {}).items()):
        h.update(name.encode())
        h.update(t.detach().to(torch.float32).contiguous().numpy().tobytes())
    if head_ids is not None:
        h.update(b"head:" + head_ids.to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:24]


def export_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/quickdraft/gguf-export`` (``~/.cache`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quickdraft" / "gguf-export"


def cached_export(model_dir: Path, shared: dict[str, torch.Tensor] | None = None,
                  head_ids: torch.Tensor | None = None) -> Path:
    """The checkpoint's GGUF export, written once into the cache."""
    model_dir = Path(model_dir)
    out = export_cache_dir() / f"{model_dir.name}-{export_key(model_dir, shared, head_ids)}.gguf"
    if not out.is_file():
        export_gguf(model_dir, out, shared=shared, head_ids=head_ids)
    return out


def export_gguf(model_dir: Path, out: Path, shared: dict[str, torch.Tensor] | None = None,
                head_ids: torch.Tensor | None = None) -> Path:
    """Write ``model_dir`` (a Llama safetensors checkpoint) as an f32 GGUF file at ``out``.

    ``shared``: tensors the checkpoint takes from its target (:mod:`.shared_embed`);
    ``head_ids``: the tokens a draft's head scores (:func:`full_vocab_head` fills the rest).
    Written beside ``out`` and renamed into place, so a reader never sees half a file.
    """
    from gguf import GGUFWriter, LlamaFileType

    model_dir = Path(model_dir)
    hf = read_hf_config(model_dir)
    config: ModelConfig = read_model_config(model_dir)
    if config.model_type != "llama" or config.rope_scaling or config.qkv_bias or config.o_bias or config.mlp_bias:
        raise CheckpointError(f"{model_dir}: only plain Llama checkpoints (no biases, no RoPE scaling) "
                              "export to GGUF")
    tok = _tokenizer_metadata(model_dir, hf)
    state = {**load_state_dict(model_dir), **(shared or {})}
    tied = config.tie_word_embeddings or "lm_head.weight" not in state
    head = state["model.embed_tokens.weight"] if tied else state["lm_head.weight"]
    if head_ids is not None:
        state["lm_head.weight"] = full_vocab_head(head.float(), head_ids.to(torch.long))
    elif not tied:
        state["lm_head.weight"] = head
    else:
        state.pop("lm_head.weight", None)  # tied: llama.cpp reuses token_embd

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=".tmp-", suffix=".gguf")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = GGUFWriter(str(tmp), "llama")
        writer.add_name(model_dir.name)
        writer.add_file_type(LlamaFileType.ALL_F32)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.n_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.n_heads)
        writer.add_head_count_kv(config.n_kv_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_rope_dimension_count(config.head_dim)
        writer.add_layer_norm_rms_eps(float(config.norm_eps))
        writer.add_rope_freq_base(float(config.rope_theta))
        writer.add_vocab_size(config.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tok["tokens"])
        writer.add_token_types(tok["types"])
        writer.add_token_merges(tok["merges"])
        if tok["bos"] is not None:
            writer.add_bos_token_id(int(tok["bos"]))
        eos = tok["eos"][0] if isinstance(tok["eos"], list) else tok["eos"]
        if eos is not None:
            writer.add_eos_token_id(int(eos))
        writer.add_add_bos_token(tok["add_bos"])
        writer.add_add_eos_token(False)
        for name, weight in sorted(state.items()):
            weight = weight.detach().to(torch.float32)
            if ".q_proj." in name:
                weight = permute_rope_rows(weight, config.n_heads)
            elif ".k_proj." in name:
                weight = permute_rope_rows(weight, config.n_kv_heads)
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(weight.numpy()))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
