"""Architecture description shared by every model family the native runtime runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gpt2")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one the native runtime implements."""


@dataclass
class ModelConfig:
    """Everything the native transformer needs to know about an architecture.

    ``family`` is ``"llama"`` (RMSNorm, RoPE, gated SiLU MLP; covers Llama, Mistral and
    Qwen2) or ``"gpt2"`` (LayerNorm, learned positions, GELU MLP).
    """

    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    activation: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported by the native runtime "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
                "use --backend hf to run it through transformers"
            )
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if model_type == "gpt2":
            hidden = cfg["n_embd"]
            n_heads = cfg["n_head"]
            return cls(
                family="gpt2",
                model_type=model_type,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                n_layers=cfg["n_layer"],
                n_heads=n_heads,
                n_kv_heads=n_heads,
                head_dim=hidden // n_heads,
                intermediate_size=cfg.get("n_inner") or 4 * hidden,
                max_position_embeddings=cfg["n_positions"],
                norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
                qkv_bias=True,
                o_bias=True,
                mlp_bias=True,
                tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                activation=cfg.get("activation_function", "gelu_new"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        n_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        # transformers >= 5 may nest RoPE settings under "rope_parameters".
        rope_params = cfg.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("default", "llama3", None):
                raise UnsupportedModelError(
                    f"rope scaling {kind!r} is not supported by the native runtime "
                    "(supported: default, llama3); use --backend hf"
                )
            if kind in ("default", None):
                rope_scaling = None
        return cls(
            family="llama",
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or hidden // n_heads,
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            activation=cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
