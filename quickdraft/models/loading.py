"""Find a checkpoint (embedded or packaged name, local directory, GGUF file or hub id) and
load it: safetensors or GGUF only, never pickles.

A GGUF file is passed around where a checkpoint directory would be (the ``model_dir``
arguments below); :mod:`.gguf` reads it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from . import cpu_kernels, gguf
from .config import ModelConfig
from .errors import CheckpointError
from .quant_linear import fast_kernels, quantize_head, quantize_linears
from .registry import (
    PACKAGED_MODELS,
    default_target,
    find_draft_dir,
    find_embedded,
    find_packaged,
    list_models,
    packaged_file,
)
from .shared_embed import missing_target_error, read_shared
from .transformer import Transformer

__all__ = ["CheckpointError"]  # re-exported: callers import it from here


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: Files that hold a tokenizer's vocabulary, one set per tokenizer format.
TOKENIZER_FILE_SETS = (
    ("tokenizer.json",),  # fast tokenizers (what `save_pretrained` writes)
    ("vocab.json", "merges.txt"),  # GPT-2-style byte-level BPE
    ("tokenizer.model",),  # SentencePiece (Llama, Mistral)
    ("spiece.model",),
    ("vocab.txt",),  # WordPiece
)


def check_tokenizer_files(model_dir: Path) -> None:
    """Refuse, naming the files and the fix, a directory without any tokenizer files (a
    GGUF file: without a tokenizer in its metadata)."""
    if gguf.is_gguf(model_dir):
        gguf.check_gguf(model_dir)
        return
    if any(all((model_dir / name).is_file() for name in names) for names in TOKENIZER_FILE_SETS):
        return
    wanted = " or ".join(" + ".join(names) for names in TOKENIZER_FILE_SETS[:3])
    raise CheckpointError(
        f"{model_dir} has no tokenizer files ({wanted}); save the tokenizer next to the weights, "
        f"e.g. AutoTokenizer.from_pretrained(BASE_MODEL).save_pretrained('{model_dir}')"
    )


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, shortened at a word boundary."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0].strip()
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " ..."
    return text


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """Turn an embedded or packaged model name, a local directory, a GGUF file or a hub id
    into a local directory (or, for GGUF, the file)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() or gguf.is_gguf(path):
        return path
    embedded = find_embedded(str(name_or_path))
    if embedded is not None:
        return embedded.path
    text = str(name_or_path)
    packaged = find_packaged(text)
    if packaged is not None:
        file = packaged_file(packaged)
        if file is None:
            raise CheckpointError(f"model {text} is not installed; install it with "
                                  f"`{packaged.install_command}` (pip package {packaged.requirement})")
        return file
    if path.exists():
        raise CheckpointError(f"{text} is a file; pass the model directory that holds config.json, "
                              "or a .gguf file")
    if text.count("/") != 1 or text.startswith((".", "/", "~")) or text.endswith(gguf.GGUF_SUFFIX):
        raise CheckpointError(f"model {text!r} not found: {_not_found_hint(text)}")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            text, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "tokenizer*"]
        )
    except Exception as exc:  # the hub client raises many kinds; all mean "not available"
        raise CheckpointError(
            f"model {text!r} is not a local directory and could not be fetched from the hub "
            f"({type(exc).__name__}); download it first or pass a local path"
        ) from None
    return Path(local)


def _not_found_hint(text: str) -> str:
    """What to pass instead of ``text``: a known name close to it, else every kind of model
    argument (a bare word is not looked up on the hub: its ids are ``owner/name``)."""
    import difflib

    names = [m.name for m in list_models()] + [m.name for m in PACKAGED_MODELS]
    close = difflib.get_close_matches(text, names, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}? (`quickdraft models` lists the names)"
    hub = " as owner/name (e.g. openai-community/gpt2)" if "/" not in text else ""
    return ("pass a model name (see `quickdraft models`), a local directory with config.json, a .gguf file, "
            f"or a Hugging Face hub id{hub}")


def resolve_pair(
    model: str | Path | None, draft: str | Path | None, need_draft: bool
) -> tuple[Path, Path | None]:
    """Directories of a target (default: the embedded default) and, when ``need_draft``, of
    its draft (default: the target's paired draft, see ``registry.find_draft_dir``)."""
    target_dir = resolve_target(model)
    return target_dir, resolve_draft(target_dir, model, draft) if need_draft else None


def resolve_target(model: str | Path | None) -> Path:
    """The target's directory (default: the embedded default target), checked cheaply
    (:func:`check_checkpoint`): a broken target (no tokenizer files, corrupt weights) is
    reported as such, not as a target without a draft, and before anything loads."""
    if model is None:
        embedded = default_target()
        if embedded is None:
            raise CheckpointError("no embedded model is installed; pass --model PATH")
        model = embedded.name
    target_dir = resolve_model_dir(model)
    check_checkpoint(target_dir)
    return target_dir


def resolve_draft(target_dir: Path, model: str | Path | None, draft: str | Path | None) -> Path:
    """The draft's directory: ``draft``, or the target's paired draft (``model`` is how the
    target was named, for the message when it has none), checked cheaply."""
    if draft is None:
        paired = find_draft_dir(target_dir)
        if paired is None:
            name = model if model is not None else target_dir
            raise CheckpointError(
                f"model {name} has no paired draft; pass --draft PATH, train one with "
                f"`quickdraft train draft --target {name} --out DIR`, or use plain decoding"
            )
        draft_dir = paired
    else:
        draft_dir = resolve_model_dir(draft)
    check_checkpoint(draft_dir)
    return draft_dir


def check_checkpoint(model_dir: Path) -> None:
    """Refuse, cheaply (config.json, the safetensors headers and the tokenizer file names,
    or a GGUF file's header; no weights are read), a checkpoint that loading would refuse."""
    if gguf.is_gguf(model_dir):
        gguf.check_gguf(model_dir)
        return
    read_hf_config(model_dir)
    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), "pt"):
                pass
        except (SafetensorError, OSError, ValueError) as exc:
            raise unreadable_weights(file, exc) from None
    check_tokenizer_files(model_dir)


def unreadable_weights(file: Path, exc: BaseException) -> CheckpointError:
    return CheckpointError(
        f"{file} is corrupt or truncated: not a readable safetensors file ({first_line(exc, 120)}); "
        "re-download or re-save the checkpoint"
    )


def read_hf_config(model_dir: Path) -> dict:
    """The checkpoint's ``config.json`` (a GGUF file's: from its metadata), refusing
    models that need remote code."""
    if gguf.is_gguf(model_dir):
        return gguf.hf_config(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json; pass a Hugging Face model directory")
    try:
        cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path} is not valid JSON ({exc.msg}); re-download the model") from None
    if "auto_map" in cfg:
        raise CheckpointError(
            f"{model_dir} needs trust_remote_code (custom model code); quickdraft never runs remote code"
        )
    return cfg


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files (single file or sharded index); refuses pickles."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise CheckpointError(
                f"{model_dir} only has pickle weights ({', '.join(pickles)}); quickdraft loads "
                "safetensors only: convert them (e.g. save_pretrained(safe_serialization=True))"
            )
        raise CheckpointError(f"{model_dir} has no *.safetensors weights")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{model_dir} is missing weight shards: {', '.join(missing)}")
    return files


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(model_dir):
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise unreadable_weights(file, exc) from None
    return state


def _llama_weights(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    out = {"embed.weight": state["model.embed_tokens.weight"], "norm.weight": state["model.norm.weight"]}
    if "lm_head.weight" in state and not config.tie_word_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(config.n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        out[dst + "attn_norm.weight"] = state[src + "input_layernorm.weight"]
        out[dst + "mlp_norm.weight"] = state[src + "post_attention_layernorm.weight"]
        for kind in ("weight", "bias"):
            parts = [state.get(f"{attn}{p}_proj.{kind}") for p in "qkv"]
            if all(p is not None for p in parts):
                out[f"{dst}attn.wqkv.{kind}"] = torch.cat(parts)
            if f"{attn}o_proj.{kind}" in state:
                out[f"{dst}attn.wo.{kind}"] = state[f"{attn}o_proj.{kind}"]
            mlp = src + "mlp."
            if f"{mlp}gate_proj.{kind}" in state:
                out[f"{dst}mlp.w_in.{kind}"] = torch.cat([state[f"{mlp}gate_proj.{kind}"], state[f"{mlp}up_proj.{kind}"]])
                out[f"{dst}mlp.w_out.{kind}"] = state[f"{mlp}down_proj.{kind}"]
    return out


def _gpt2_weights(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    # Checkpoints saved from GPT2LMHeadModel prefix keys with "transformer."; the hub's gpt2 does not.
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    out = {
        "embed.weight": state["wte.weight"],
        "pos_embed.weight": state["wpe.weight"],
        "norm.weight": state["ln_f.weight"],
        "norm.bias": state["ln_f.bias"],
    }
    # GPT-2 stores Conv1D weights as [in, out]; nn.Linear wants [out, in].
    renames = {"ln_1": "attn_norm", "ln_2": "mlp_norm"}
    convs = {"attn.c_attn": "attn.wqkv", "attn.c_proj": "attn.wo", "mlp.c_fc": "mlp.w_in", "mlp.c_proj": "mlp.w_out"}
    for i in range(config.n_layers):
        for src, dst in renames.items():
            for kind in ("weight", "bias"):
                out[f"layers.{i}.{dst}.{kind}"] = state[f"h.{i}.{src}.{kind}"]
        for src, dst in convs.items():
            out[f"layers.{i}.{dst}.weight"] = state[f"h.{i}.{src}.weight"].t()
            out[f"layers.{i}.{dst}.bias"] = state[f"h.{i}.{src}.bias"]
    return out


_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
          "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_")


@contextmanager
def _no_init() -> Iterator[None]:
    """Skip the modules' random initialisation, which the loaded weights replace anyway (for
    SmolLM2 it took seconds). Not the meta device: any op on it imports ``torch._dynamo``,
    about 2 s of every start-up."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def build_native(
    config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Transformer:
    """Instantiate the native transformer and load Hugging Face-named weights into it, in
    ``dtype`` on ``device`` (cast on the CPU first: half the bytes to copy to a GPU).

    bfloat16 on a CPU that has AVX512_BF16 (:func:`cpu_bf16_products`): the weights are
    rounded to bfloat16 and kept as float32 tensors, and the model is marked
    ``bf16_products``, so its decode linears multiply bfloat16-rounded inputs by them
    (``cpu_kernels.bf16_products``) while norms, attention, the KV cache and the residual
    stream stay float32: the runtime's fast C paths, each row rounded alike (exactly
    lossless), where PyTorch's bfloat16 CPU ops are ~2.5x slower and round a row
    differently beside others."""
    convert = _gpt2_weights if config.family == "gpt2" else _llama_weights
    try:
        weights = convert(state, config)
    except KeyError as exc:
        raise CheckpointError(
            f"checkpoint lacks weight {exc.args[0]!r} expected for a {config.model_type} model; "
            "is the checkpoint complete?"
        ) from None
    with _no_init():  # uninitialised CPU tensors: untouched pages, replaced by the weights
        model = Transformer(config)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing:
        raise CheckpointError(f"checkpoint lacks weights for: {', '.join(missing[:5])}")
    if cpu_bf16_products(dtype, device):
        model = model.float()
        with torch.no_grad():
            for param in model.parameters():
                rounded = param.to(torch.bfloat16).float()
                if not torch.equal(rounded, param):  # (a tensor shared with a target is already rounded)
                    param.data = rounded
        model.bf16_products = True
        return model.eval().requires_grad_(False)
    return model.to(dtype).to(device).eval().requires_grad_(False)


def cpu_bf16_products(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a ``dtype`` model on ``device`` computes with our bfloat16 products (see
    :func:`build_native`): bfloat16 on a CPU whose kernels have them."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu"
            and cpu_kernels.bf16_products_supported())


def read_model_config(model_dir: Path) -> ModelConfig:
    """The native runtime's configuration of a checkpoint (directory or GGUF file);
    :class:`UnsupportedModelError` when only transformers can run it."""
    if gguf.is_gguf(model_dir):
        return gguf.native_config(model_dir)
    try:
        return ModelConfig.from_hf(read_hf_config(model_dir))
    except KeyError as exc:
        raise CheckpointError(f"{model_dir}/config.json lacks {exc.args[0]!r}; is it a complete HF config?") from None


def load_native(model_dir: Path, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu",
                shared: dict[str, torch.Tensor] | None = None, quantize: str = "none") -> Transformer:
    """Load a Hugging Face checkpoint directory or a llama GGUF file into the native runtime.
    ``shared``: tensors the checkpoint leaves to its target (:mod:`.shared_embed`), used as
    they are (same storage when ``dtype`` and ``device`` match). ``quantize``
    (``placement.resolve_quantize``): ``int8`` / ``int4`` store the transformer blocks'
    linears so (a GGUF file's Q4_0/Q4_1 or Q8_0 blocks taken as they are) and the LM head in
    int8; ``auto`` runs a GGUF file's Q4 linears in int4 and its Q8_0 linears and head in
    int8 where the kernels are fast on this CPU (``quant_linear``)."""
    config = read_model_config(model_dir)
    if gguf.is_gguf(model_dir):
        model = build_native(config, gguf.load_state_dict(model_dir, config), dtype, device)
        fast_here = fast_kernels() and dtype == torch.float32 and torch.device(device).type == "cpu"
        if quantize in ("int8", "int4") or (quantize == "auto" and fast_here):
            int4 = None if quantize == "int8" else gguf.int4_blocks(model_dir, config)
            int8, head = gguf.int8_weights(model_dir, config)  # head: auto takes only a Q8_0 one
            quantize_linears(model, quantize, int4, None if quantize == "int4" else int8)
            if head is not None or quantize != "auto":
                quantize_head(model, head)
        return model
    if shared is None and read_shared(model_dir) is not None:
        raise missing_target_error(model_dir)
    model = build_native(config, {**load_state_dict(model_dir), **(shared or {})}, dtype, device)
    if quantize in ("int8", "int4"):
        quantize_linears(model, quantize)
        quantize_head(model)
    return model
