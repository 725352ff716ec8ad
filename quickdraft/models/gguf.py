"""GGUF checkpoints (llama.cpp's single-file format): configuration, weights, tokenizer.

A ``.gguf`` file stands wherever a checkpoint directory does: its metadata gives the
configuration (``llama.*`` keys, read into the Hugging Face ``config.json`` shape that
:meth:`ModelConfig.from_hf` takes), its tensors are dequantized to fp32 by the ``gguf``
package and renamed to Hugging Face names, and transformers builds its tokenizer from the
metadata. Llama-architecture files run on the native runtime; others go to transformers,
which reads GGUF itself.

Parsing a real file's header (a 49k-token vocabulary, element by element) and
dequantizing its tensors take seconds, so the first load of a file keeps what it found in
the user's cache (``~/.cache/quickdraft/gguf/``, keyed by the file's path, size and mtime):
the header's configuration and checks as JSON, the converted weights as safetensors (never
pickles). Later loads read those and never open the file; a damaged or unwritable cache
only costs the time of converting again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ModelConfig, UnsupportedModelError
from .errors import CheckpointError

GGUF_SUFFIX = ".gguf"
#: Architectures (``general.architecture``) the native runtime runs from a GGUF file.
NATIVE_ARCHITECTURES = ("llama",)
#: Tensor types we dequantize (``gguf.quants.dequantize``), each covered by a parity test.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor names -> Hugging Face Llama names; "{i}" is the layer.
TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; the header is checked on opening)."""
    path = Path(path)
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


def open_gguf(path: Path):
    """A ``GGUFReader`` over ``path`` (memory-mapped; cached while the file is unchanged)."""
    stat = path.stat()
    return _open_gguf(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: Path, mtime_ns: int, size: int):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors, ...
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {str(exc)[:80]}); "
            "re-download it or pass a checkpoint directory"
        ) from None


def metadata(reader, key: str, default: Any = None) -> Any:
    """The value of metadata ``key`` (a string, a number or a list), or ``default``."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def architecture(reader) -> str:
    return str(metadata(reader, "general.architecture", "unknown"))


def type_name(tensor) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(tensor.tensor_type).name


def check_gguf(path: Path) -> None:
    """Refuse, from the header alone, a GGUF file loading would refuse: unreadable, a
    tensor type we cannot dequantize, or no tokenizer in its metadata."""
    error = header(path).get("check_error")
    if error:
        raise CheckpointError(error)


def _check_reader(path: Path) -> None:
    reader = open_gguf(path)
    for tensor in reader.tensors:
        name = type_name(tensor)
        if name not in SUPPORTED_TYPES:
            raise CheckpointError(
                f"{path.name}: tensor {tensor.name} is {name}, a quantization quickdraft cannot load "
                f"(supported: {', '.join(SUPPORTED_TYPES)}); use a GGUF quantized to one of these"
            )
    if metadata(reader, "tokenizer.ggml.tokens") is None:
        raise CheckpointError(f"{path.name} has no tokenizer in its metadata (tokenizer.ggml.*); "
                              "quickdraft needs the tokenizer inside the GGUF file")


def hf_config(path: Path) -> dict[str, Any]:
    """The file's configuration in ``config.json`` form. Only the Llama keys are mapped;
    for other architectures just ``model_type`` (transformers reads those files itself)."""
    found = header(path)
    if found.get("config_error"):
        raise CheckpointError(found["config_error"])
    return dict(found["hf_config"])


def _hf_config(path: Path) -> dict[str, Any]:
    reader = open_gguf(path)
    arch = architecture(reader)
    if arch not in NATIVE_ARCHITECTURES:
        return {"model_type": arch}

    def key(name: str, default: Any = None) -> Any:
        value = metadata(reader, f"{arch}.{name}", default)
        if value is None:
            raise CheckpointError(f"{path.name} lacks metadata {arch}.{name}; is the file complete?")
        return value

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{path.name} has no token_embd.weight tensor; is the file complete?")
    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    cfg: dict[str, Any] = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM"],
        # The embedding's row count, not llama.vocab_size: that key is optional.
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", n_heads)),
        "head_dim": int(key("attention.key_length", hidden // n_heads)),
        "intermediate_size": int(key("feed_forward_length")),
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata(reader, "tokenizer.ggml.eos_token_id"),
    }
    return cfg


def native_config(path: Path) -> ModelConfig:
    """The native runtime's configuration of the file; :class:`UnsupportedModelError` when
    only transformers can run it (another architecture, RoPE variants we lack)."""
    cfg = hf_config(path)
    error = header(path).get("native_error")
    if error:
        raise UnsupportedModelError(error)
    return ModelConfig.from_hf(cfg)


def _native_error(path: Path) -> str | None:
    """Why the native runtime cannot run the file (None: it can)."""
    reader = open_gguf(path)
    arch = architecture(reader)
    if arch not in NATIVE_ARCHITECTURES:
        return (f"GGUF architecture {arch!r} is not supported by the native runtime (supported: "
                f"{', '.join(NATIVE_ARCHITECTURES)}); use --backend hf to run it through transformers")
    cfg = _hf_config(path)
    scaling = metadata(reader, f"{arch}.rope.scaling.type", "none")
    rope_dim = metadata(reader, f"{arch}.rope.dimension_count", cfg["head_dim"])
    if scaling != "none" or rope_dim != cfg["head_dim"] or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        return (f"{path.name} uses RoPE scaling or partial rotary dimensions, which the native runtime "
                "does not read from GGUF files; use --backend hf")
    return None


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order. Its converter interleaves each head's two rotary
    halves row by row (the layout of its pairwise RoPE); our RoPE, like Hugging Face's,
    rotates the first half of a head against the second, so the halves go back together."""
    rows = weight.shape[0]
    per_head = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


def dequantize(tensor) -> torch.Tensor:
    """One GGUF tensor as an fp32 torch tensor of its logical shape (rows first)."""
    from gguf.quants import dequantize as gguf_dequantize

    values = gguf_dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dimensions innermost first; copy out of the memory map.
    shape = [int(d) for d in reversed(tensor.shape.tolist())]
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face name of a llama GGUF tensor, or None when we do not know it."""
    if name in TOP_LEVEL_NAMES:
        return TOP_LEVEL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def load_state_dict(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of a llama GGUF file, fp32, under its Hugging Face name, with the q/k
    rows back in Hugging Face order: converted once, then read from the cache."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    check_gguf(path)
    error = header(path).get("native_error")
    if error:
        raise UnsupportedModelError(error)
    cached = cache_entry(path) / WEIGHTS_FILE
    if cached.is_file():
        try:
            return load_file(str(cached))
        except (OSError, SafetensorError):
            pass  # a damaged entry: convert again
    state = convert_state_dict(path, config)
    _write_atomic(cached, lambda tmp: save_file(state, str(tmp)))
    return state


def convert_state_dict(path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """:func:`load_state_dict` without the cache: dequantize every tensor of the file."""
    state: dict[str, torch.Tensor] = {}
    for tensor in open_gguf(path).tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise UnsupportedModelError(f"{path.name} holds tensor {tensor.name!r}, which the native "
                                        "runtime does not know; use --backend hf")
        weight = dequantize(tensor)
        if ".q_proj." in name:
            weight = unpermute_rope_rows(weight, config.n_heads)
        elif ".k_proj." in name:
            weight = unpermute_rope_rows(weight, config.n_kv_heads)
        state[name] = weight
    return state


#: GGUF block types that map exactly onto int4 groups of 32 (``quant_linear.Int4Linear``).
INT4_TYPES = ("Q4_0", "Q4_1")
#: The transformer's fused linears -> the Hugging Face tensors stacked into them, in order.
FUSED_LINEARS = {"attn.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "attn.wo": ("self_attn.o_proj",), "mlp.w_in": ("mlp.gate_proj", "mlp.up_proj"),
                 "mlp.w_out": ("mlp.down_proj",)}
INT4_FILE = "int4.safetensors"
INT8_FILE = "int8.safetensors"
HEAD_KEY = "lm_head"  # int8.safetensors' name for the Q8_0 head (never a module name there)


def int4_blocks(path: Path, config: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The file's Q4_0/Q4_1 linears as int4 groups, by the native module name
    (``layers.{i}.attn.wqkv``, ...): ``(q, scale, zero)`` with ``q`` uint8 in 0..15 and the
    weight ``(q - 8) * scale + zero``, exactly the file's values (see ``quant_linear``).
    A fused linear is listed only when all its parts are Q4. Converted once, then cached."""
    def flatten(blocks) -> dict[str, torch.Tensor]:
        return {f"{name}.{part}": t for name, triple in blocks.items()
                for part, t in zip(("q", "scale", "zero"), (_pack_nibbles(triple[0]), triple[1], triple[2]))}

    return _cached(path, INT4_FILE, lambda: convert_int4_blocks(path, config), flatten, _unflatten_blocks)


def int8_weights(path: Path, config: ModelConfig) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]],
                                                            tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`int8_blocks` and :func:`q8_head` together, converted once, then cached (the
    GGUF reader parses the whole metadata, a real vocabulary included: seconds a start)."""
    def flatten(weights) -> dict[str, torch.Tensor]:
        blocks, head = weights
        flat = {f"{name}.{part}": t for name, pair in blocks.items() for part, t in zip(("q", "scale"), pair)}
        if head is not None:
            flat[f"{HEAD_KEY}.q"], flat[f"{HEAD_KEY}.scale"] = head
        return flat

    def unflatten(flat: dict[str, torch.Tensor]):
        pairs = {key.removesuffix(".q"): (t, flat[key.removesuffix(".q") + ".scale"])
                 for key, t in flat.items() if key.endswith(".q")}
        return pairs, pairs.pop(HEAD_KEY, None)

    return _cached(path, INT8_FILE, lambda: (int8_blocks(path, config), q8_head(path)), flatten, unflatten)


def _cached(path: Path, name: str, convert, flatten, unflatten):
    """``convert()``, kept as safetensors ``name`` in the file's cache entry (``flatten`` /
    ``unflatten`` map it to and from flat tensors); converted again if the entry is damaged."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    cached = cache_entry(path) / name
    if cached.is_file():
        try:
            return unflatten(load_file(str(cached)))
        except (OSError, SafetensorError, KeyError):
            pass  # a damaged entry: convert again
    value = convert()
    flat = flatten(value)
    _write_atomic(cached, lambda tmp: save_file(flat, str(tmp)))
    return value


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _unflatten_blocks(flat: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    out = {}
    for key, packed in flat.items():
        if key.endswith(".q"):
            name = key.removesuffix(".q")
            q = torch.stack([packed & 0x0F, packed >> 4], -1).reshape(packed.shape[0], -1)
            out[name] = (q, flat[name + ".scale"], flat[name + ".zero"])
    return out


def q4_groups(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Q4_0 or Q4_1 tensor as ``(q, scale, zero)``: ``q`` ``[rows, cols]`` uint8 in
    0..15, ``scale`` and ``zero`` ``[rows, cols / 32]`` float32, the weight being
    ``(q - 8) * scale + zero``. A block is an fp16 ``d`` (Q4_1: then an fp16 ``m``) and
    16 bytes: element j in the low nibble of byte j, element 16 + j in its high nibble."""
    kind = type_name(tensor)
    rows, cols = (int(d) for d in reversed(tensor.shape.tolist()))
    header_bytes = 4 if kind == "Q4_1" else 2
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, cols // 32, header_bytes + 16)
    halves = raw[..., :header_bytes].copy().view(np.float16).astype(np.float32)
    nibbles = raw[..., header_bytes:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    d = torch.from_numpy(np.ascontiguousarray(halves[..., 0]))
    # Q4_1: w = d q + m = (q - 8) d + (m + 8 d); Q4_0: w = d (q - 8).
    zero = torch.from_numpy(halves[..., 1] + 8 * halves[..., 0]) if kind == "Q4_1" else torch.zeros_like(d)
    return torch.from_numpy(np.ascontiguousarray(q)), d, zero


def q8_groups(tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Q8_0 tensor as ``(q, scale)``: ``q`` int8 ``[rows, cols]``, ``scale`` float32
    ``[rows, cols / 32]``, the weight being ``q * scale`` group by group, exactly the file's
    values. A Q8_0 block is an fp16 ``d`` and 32 int8 values."""
    rows, cols = (int(d) for d in reversed(tensor.shape.tolist()))
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, cols // 32, 34)
    scale = raw[..., :2].copy().view(np.float16).astype(np.float32)[..., 0]
    q = raw[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(scale))


def q8_head(path: Path) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The file's LM head (``output.weight``, else the tied ``token_embd.weight``) as
    :func:`q8_groups` when it is stored Q8_0; None for any other type."""
    tensors = {t.name: t for t in open_gguf(path).tensors}
    tensor = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if tensor is None or type_name(tensor) != "Q8_0":
        return None
    return q8_groups(tensor)


def int8_blocks(path: Path, config: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The file's Q8_0 linears as :func:`q8_groups`, by the native module name (a fused
    linear only when all its parts are Q8_0)."""
    return _fused_blocks(path, config, ("Q8_0",), q8_groups)


def convert_int4_blocks(path: Path, config: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`int4_blocks` without the cache."""
    return _fused_blocks(path, config, INT4_TYPES, q4_groups)


def _fused_blocks(path: Path, config: ModelConfig, types: tuple[str, ...], groups) -> dict[str, tuple]:
    """``groups(tensor)`` of every fused linear whose parts are all of ``types``, the
    parts' rows stacked in the fused order (q/k rows back in Hugging Face order)."""
    tensors = {hf_tensor_name(t.name): t for t in open_gguf(path).tensors}
    out = {}
    for i in range(config.n_layers):
        for module, parts in FUSED_LINEARS.items():
            names = [f"model.layers.{i}.{part}.weight" for part in parts]
            if not all(n in tensors and type_name(tensors[n]) in types for n in names):
                continue
            stacked = []
            for name in names:
                pieces = groups(tensors[name])
                if ".q_proj." in name or ".k_proj." in name:
                    heads = config.n_heads if ".q_proj." in name else config.n_kv_heads
                    pieces = tuple(unpermute_rope_rows(t, heads) for t in pieces)
                stacked.append(pieces)
            out[f"layers.{i}.{module}"] = tuple(torch.cat(ts).contiguous() for ts in zip(*stacked))
    return out


def load_tokenizer(path: Path):
    """The tokenizer transformers builds from the file's metadata (no network). Building it
    takes seconds for a real vocabulary, so it is saved once in the user's cache, keyed by
    the file (path, size, mtime) and the transformers version, and loaded from there: on
    ``tokenizers`` alone when it is a plain fast tokenizer (no transformers import)."""
    from importlib.metadata import version

    from .tokenizer import load_fast_tokenizer

    check_gguf(path)
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{version('transformers')}"
    cached = tokenizer_cache_dir() / hashlib.sha256(key.encode()).hexdigest()[:24]
    if (cached / "tokenizer_config.json").is_file():
        try:
            fast = load_fast_tokenizer(cached)
            if fast is not None:
                return fast
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError):
            pass  # a damaged cache entry: build it again
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise CheckpointError(f"the tokenizer in {path} could not be built: {first}") from None
    save_tokenizer(tok, cached)
    return tok


def tokenizer_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/quickdraft/gguf-tokenizers`` (``~/.cache`` without it)."""
    return _cache_base() / "gguf-tokenizers"


def _cache_base() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quickdraft"


#: Bumped when what the cache holds changes meaning (conversion or header fields).
CACHE_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
HEADER_FILE = "header.json"


def cache_entry(path: Path) -> Path:
    """The cache directory of one GGUF file: ``~/.cache/quickdraft/gguf/<key>``, the key a
    hash of the file's resolved path, size and mtime (a rewritten file gets a new entry)."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CACHE_VERSION}"
    return _cache_base() / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:24]


def header(path: Path) -> dict[str, Any]:
    """What the file's header says that loading needs: ``check_error`` (why loading would
    refuse it), ``hf_config`` or ``config_error``, and ``native_error`` (why the native
    runtime cannot run it). Read once per file and kept in the cache; an unreadable file is
    a :class:`CheckpointError` and is not cached."""
    stat = path.stat()
    return dict(_header(path.resolve(), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _header(path: Path, mtime_ns: int, size: int) -> dict[str, Any]:
    cached = cache_entry(path) / HEADER_FILE
    try:
        found = json.loads(cached.read_text())
        if isinstance(found, dict) and found.get("version") == CACHE_VERSION:
            return found
    except (OSError, ValueError):
        pass
    open_gguf(path)  # unreadable: raise here, cache nothing
    found: dict[str, Any] = {"version": CACHE_VERSION, "check_error": None, "config_error": None,
                             "hf_config": None, "native_error": None}
    try:
        _check_reader(path)
    except CheckpointError as exc:
        found["check_error"] = str(exc)
    try:
        found["hf_config"] = _hf_config(path)
    except CheckpointError as exc:
        found["config_error"] = str(exc)
    if not found["config_error"]:
        found["native_error"] = _native_error(path)
    text = json.dumps(found)
    _write_atomic(cached, lambda tmp: tmp.write_text(text))
    return found


def _write_atomic(target: Path, write) -> None:
    """``write(tmp)`` a file beside ``target``, then rename it into place: a reader never
    sees half a file. A cache that cannot be written only costs time."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        os.close(fd)
    except OSError:
        return
    tmp = Path(name)
    try:
        write(tmp)
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)


def save_tokenizer(tok, target: Path) -> None:
    """Save into a fresh directory renamed into place: a reader never sees half a save.
    A cache that cannot be written only costs time."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    except OSError:
        return
    try:
        tok.save_pretrained(str(tmp))
        os.replace(tmp, target)  # fails if another process saved it first: theirs stays
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def load_hf_model(path: Path, dtype: torch.dtype):
    """The file as a transformers model (transformers dequantizes it; needs accelerate)."""
    from transformers import AutoModelForCausalLM

    check_gguf(path)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
