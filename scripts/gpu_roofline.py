"""Plain decoding against the memory-bandwidth roofline, on random-initialised models of
realistic shapes (Llama 3.2 1B, Llama 3.1 8B), with transformers' generate and assisted
generation on the same weights as baselines.

A batch-1 decode step reads every weight once, so its floor is weight bytes / HBM
bandwidth. Random weights: acceptance is not the point here (a random draft agrees with a
random target by chance only); step costs are. Each model is built once in transformers
(random, bf16, on the device) and loaded into quickdraft's runtime from that state dict
(the checkpoint-loading path), so both decode the same weights.

    python scripts/gpu_roofline.py --out results/gpu/roofline.json            # on a GPU
    python scripts/gpu_roofline.py --device cpu --shapes tiny --out /tmp/r.json  # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

SHAPES = {
    # Llama 3.2 1B / Llama 3.1 8B (config.json of the released models)
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    # for a smoke test on the CPU (tests/test_gpu_check.py)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False),
    "tiny-draft": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=512, tie_word_embeddings=True),
}
#: Peak HBM bandwidth by GPU name (bytes/s): the vendors' figures.
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}


def hf_model(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], rope_theta=500000.0, max_position_embeddings=4096,
                      bos_token_id=0, eos_token_id=None)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the target dtype: no float32 copy of 8B weights
    try:
        with device:
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def native_from(hf, device: torch.device, dtype: torch.dtype):
    from quickdraft.models.config import ModelConfig
    from quickdraft.models.lm import NativeLM
    from quickdraft.models.loading import build_native

    config = ModelConfig.from_hf(hf.config.to_dict())
    return NativeLM(build_native(config, dict(hf.state_dict()), dtype, device))


def weight_bytes(hf) -> int:
    """Bytes one decode step reads: every weight once; an untied embedding table only one
    row (not counted)."""
    total = sum(p.numel() * p.element_size() for p in hf.parameters())
    if not hf.config.tie_word_embeddings:
        embed = hf.get_input_embeddings().weight
        total -= embed.numel() * embed.element_size()
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ours(target, prompt, n: int, drafter=None, k: int = 0) -> dict:
    """Our engine: plain (no drafter) or speculative; decode tokens/s after the prefill."""
    from quickdraft.decoding.engine import decode
    from quickdraft.decoding.stats import GenerationStats
    from quickdraft.decoding.stopping import StopConditions

    stats = GenerationStats()
    tokens = [t for s in decode(target, prompt, StopConditions(n), drafter=drafter, num_speculative_tokens=k,
                                stats=stats) for t in s.tokens]
    decoded = stats.new_tokens - stats.prefill_tokens
    return {"tokens": tokens, "decode_tokens_per_s": decoded / stats.decode_seconds,
            "step_ms": 1e3 * stats.decode_seconds / max(1, stats.target_forward_passes - 1),
            "mean_accepted_tokens": stats.mean_accepted_tokens}


def theirs(hf, prompt, n: int, assistant=None, k: int = 4) -> dict:
    """transformers generate (greedy, exactly n tokens), plain or assisted; tokens/s
    including the prefill (transformers reports no split)."""
    kwargs = {}
    if assistant is not None:
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    from quickdraft.models.transformer import attention_kernels

    ids = prompt.view(1, -1).to(hf.device)
    sync(hf.device)
    started = time.perf_counter()
    # transformers gets the attention kernels ours uses (attention_kernels: no cuDNN, whose
    # per-key-length plans cost ~50 ms a step in both runtimes on the first GPU runs)
    with torch.inference_mode(), attention_kernels(hf.device):
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, **kwargs)
    sync(hf.device)
    seconds = time.perf_counter() - started
    return {"tokens": out[0, ids.shape[1]:].tolist(), "tokens_per_s": n / seconds, "seconds": seconds}


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--shapes", default="llama-1b,llama-8b")
    parser.add_argument("--draft-shape", default="llama-1b", help="the draft for the speculative rows (none: no "
                        "speculative rows)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    parser.add_argument("--capture", action="store_true",
                        help="also plain decoding through the captured fixed-width step (torch.compile "
                        "reduce-overhead on CUDA; eager at static shapes on the CPU)")
    parser.add_argument("--capture-mode", default="reduce-overhead", choices=["reduce-overhead", "max-autotune"],
                        help="the captured step's torch.compile mode: max-autotune also tunes the matrix kernels "
                        "(the captured 8B step ran at 93%% of an isolated cuBLAS GEMV's bandwidth, 2026-11-29)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from quickdraft.drafters import DraftModelDrafter
    from quickdraft.machine import device_info
    from quickdraft.models.placement import resolve_placement

    placement = resolve_placement(args.device, args.dtype)
    device, dtype = placement.device, placement.dtype
    info = device_info(placement)
    peak = next((bw for name, bw in PEAK_BANDWIDTH.items() if name in info.get("gpu", "")), None)
    result = {"device": info, "peak_bandwidth_bytes_per_s": peak, "tokens": args.tokens,
              "prompt_tokens": args.prompt_tokens, "k": args.k, "models": {}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    draft_hf = draft = None
    for shape in args.shapes.split(","):
        row: dict = {"shape": shape, **SHAPES[shape]}
        result["models"][shape] = row
        try:
            hf = hf_model(shape, device, dtype)
            target = native_from(hf, device, dtype)
            prompt = torch.randint(0, SHAPES[shape]["vocab_size"], (args.prompt_tokens,))
            row["weight_bytes"] = weight_bytes(hf)
            ours(target, prompt, 8)  # warm-up: kernels, caches, the RoPE table
            plain = ours(target, prompt, args.tokens)
            row["ours_plain"] = {k: v for k, v in plain.items() if k != "tokens"}
            seconds = plain["step_ms"] / 1e3
            row["achieved_bandwidth_bytes_per_s"] = row["weight_bytes"] / seconds
            if peak:
                row["fraction_of_roofline"] = row["achieved_bandwidth_bytes_per_s"] / peak
            if args.capture:
                target.use_static_step(1, compile=args.capture_mode if device.type == "cuda" else False)
                started = time.perf_counter()
                ours(target, prompt, args.tokens)  # compiles and captures at the measured run's cache size
                row["capture_seconds"] = time.perf_counter() - started
                captured = ours(target, prompt, args.tokens)
                row["ours_plain_captured"] = {k: v for k, v in captured.items() if k != "tokens"}
                row["ours_plain_captured"]["equals_eager"] = captured["tokens"] == plain["tokens"]
                row["ours_plain_captured"]["eager_fallback"] = bool(getattr(target.static.fn, "eager", True))
                row["ours_plain_captured"]["compile_mode"] = args.capture_mode
                bandwidth = row["weight_bytes"] / (captured["step_ms"] / 1e3)
                row["ours_plain_captured"]["achieved_bandwidth_bytes_per_s"] = bandwidth
                if peak:
                    row["ours_plain_captured"]["fraction_of_roofline"] = bandwidth / peak
                target.use_static_step(0)
            if not args.no_hf:
                theirs(hf, prompt, 8)
                base = theirs(hf, prompt, args.tokens)
                row["hf_generate"] = {k: v for k, v in base.items() if k != "tokens"}
                row["ours_vs_hf_agree_tokens"] = agreement(plain["tokens"], base["tokens"])
            if (args.draft_shape in SHAPES and shape != args.draft_shape
                    and SHAPES[shape]["vocab_size"] == SHAPES[args.draft_shape]["vocab_size"]):
                if draft is None:
                    draft_hf = hf_model(args.draft_shape, device, dtype)
                    draft = native_from(draft_hf, device, dtype)
                spec = ours(target, prompt, args.tokens, DraftModelDrafter(draft, target.vocab_size), args.k)
                row["ours_draft"] = {k: v for k, v in spec.items() if k != "tokens"}
                row["ours_draft_equals_plain"] = spec["tokens"] == plain["tokens"]
                if not args.no_hf:
                    assisted = theirs(hf, prompt, args.tokens, draft_hf, args.k)
                    row["hf_assisted"] = {k: v for k, v in assisted.items() if k != "tokens"}
        except Exception as exc:  # one shape failing (memory, say) keeps the others' figures
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            hf = target = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        out.write_text(json.dumps(result, indent=1))  # after each model: a timeout keeps what ran
        print(json.dumps({shape: {k: v for k, v in row.items() if k not in SHAPES[shape]}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
