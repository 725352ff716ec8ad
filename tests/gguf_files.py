"""Tiny GGUF files written by the tests themselves: a random 2-layer Llama (GQA) with a
byte-level BPE tokenizer, its q/k rows permuted the way llama.cpp's converter stores them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 256, 4, 2, 2, 512  # 256 columns: one K-quant block
HEAD_DIM = HIDDEN // HEADS
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ i", "Ġi n", "o n", "Ġ c"]

# Byte offsets of the fp16 scales in one 256-value block of each K-quant (gguf's layouts):
# random bytes elsewhere are valid quants, random scales could be inf or NaN.
K_QUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return ["<|endoftext|>", *bytes_to_unicode().values(), *(m.replace(" ", "") for m in MERGES)]


def llamacpp_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face q/k rows -> llama.cpp's order (each head's rotary halves interleaved)."""
    return weight.reshape(n_heads, 2, -1, weight.shape[-1]).swapaxes(1, 2).reshape(weight.shape)


def hf_weights(vocab: int, tied: bool, seed: int) -> dict[str, np.ndarray]:
    """Random fp32 weights under Hugging Face Llama names."""
    rng = np.random.default_rng(seed)

    def rand(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"model.embed_tokens.weight": rand(vocab, HIDDEN, scale=0.5),
           "model.norm.weight": 1 + rand(HIDDEN)}
    if not tied:
        out["lm_head.weight"] = rand(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": 1 + rand(HIDDEN),
            p + "post_attention_layernorm.weight": 1 + rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
        }
    return out


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.{kind}"


def encode(values: np.ndarray, qtype: str, rng: np.random.Generator):
    """``values`` stored as ``qtype``: (array, raw dtype for GGUFWriter.add_tensor). K-quants
    (which gguf cannot quantize in numpy) get random blocks with small scales instead."""
    from gguf import GGMLQuantizationType, quants
    from gguf.constants import GGML_QUANT_SIZES

    q = GGMLQuantizationType[qtype]
    if qtype == "F32":
        return values, None
    if qtype == "F16":
        return values.astype(np.float16), None
    if qtype in K_QUANT_SCALES:
        block, size = GGML_QUANT_SIZES[q]
        blocks = rng.integers(0, 256, (values.shape[0], values.shape[1] // block, size), dtype=np.uint8)
        for offset in K_QUANT_SCALES[qtype]:
            blocks[..., offset : offset + 2] = np.frombuffer(np.float16(3e-4).tobytes(), np.uint8)
        return blocks.reshape(values.shape[0], -1), q
    return quants.quantize(values, q), q


def write_tiny_gguf(path: Path, qtype: str = "F32", tied: bool = False, seed: int = 0,
                    arch: str = "llama") -> dict[str, torch.Tensor]:
    """Write a tiny GGUF (norms fp32, matrices ``qtype``) and return its weights as Hugging
    Face tensors (for K-quants: what the file dequantizes to)."""
    from gguf import GGUFWriter, quants

    vocab = tokens()
    rng = np.random.default_rng(seed + 1)
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_types([3] + [1] * (len(vocab) - 1))  # 3: control (<|endoftext|>)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    stored = {}
    for name, values in hf_weights(len(vocab), tied, seed).items():
        if ".q_proj." in name:
            values = llamacpp_rows(values, HEADS)
        elif ".k_proj." in name:
            values = llamacpp_rows(values, KV_HEADS)
        data, raw = encode(values, "F32" if values.ndim == 1 else qtype, rng)
        writer.add_tensor(gguf_name(name), data, raw_dtype=raw)
        dequantized = quants.dequantize(data, raw) if raw is not None else data
        stored[name] = torch.from_numpy(np.array(dequantized, dtype=np.float32).reshape(values.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for name, weight in stored.items():  # q/k back to Hugging Face order
        if ".q_proj." in name or ".k_proj." in name:
            heads = HEADS if ".q_proj." in name else KV_HEADS
            stored[name] = weight.reshape(heads, -1, 2, HIDDEN).transpose(1, 2).reshape(weight.shape)
    return stored
