"""The default size of a new draft: a Llama whose decode step costs about a tenth of the
target's, estimated from the two architectures before anything is trained.

A batch-1 decode step on CPU reads every matrix once (memory-bound: cost ~ parameters),
plus a fixed cost per layer and per forward pass (kernel launches, norms, rotary, the KV
cache) that dominates small models. :func:`decode_cost` counts both in parameter
equivalents; the constants were fitted to ``trainer.measure_decode`` (transformers, fp32,
1 and 2 threads) on a 2-core Xeon for Llamas from 1 x 32 to 4 x 1024 wide (vocabularies
512 to 32000): about 0.17-0.3 ns per parameter, 0.19 ms per layer and 0.27 ms per step;
the native runtime's per-layer cost is about the same. The draft's head is counted at its
draft vocabulary (``draft_vocab.json``: what generation scores), the target's in full.
"""

from __future__ import annotations

import math

import torch

from .presets import Arch

TARGET_RATIO = 0.1  # the default draft's estimated cost, as a fraction of the target's
FLOOR_SLACK = 1.5  # when a tenth is below the cheapest draft: up to 1.5 x the cheapest
POOR_RATIO = 0.5  # above this, speculative decoding gains little: warn
LAYER_COST = 800_000  # parameter equivalents of one layer's fixed cost
STEP_COST = 1_200_000  # ... and of one forward pass's
MAX_DRAFT_LAYERS = 8


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def matmul_params(model: torch.nn.Module, head_rows: int | None = None) -> int:
    """Weights a decode step multiplies with: every matrix except embedding lookups, plus
    the output head (counted once, tied or not; ``head_rows`` of its rows when given)."""
    lookup = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding)
              for p in m.parameters(recurse=False)}
    head = model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters()
               if p.ndim >= 2 and id(p) not in lookup and p is not head)
    rows = head.shape[0] if not head_rows else min(head_rows, head.shape[0])
    return body + rows * head.shape[1]


def decode_cost(model: torch.nn.Module, head_rows: int | None = None) -> float:
    """Estimated cost of one cached decode step of a transformers causal LM (parameter
    equivalents; only ratios mean anything)."""
    layers = int(_text_config(model.config).num_hidden_layers)
    return matmul_params(model, head_rows) + LAYER_COST * layers + STEP_COST


def llama_matmul_params(arch: Arch, head_rows: int) -> int:
    """:func:`matmul_params` of a Llama of ``arch`` (``trainer.llama_config``) whose head
    scores ``head_rows`` tokens, without building it."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    kv = (arch.num_key_value_heads or heads) * (h // heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * arch.intermediate_size
    return arch.num_hidden_layers * per_layer + head_rows * h


def arch_cost(arch: Arch, head_rows: int) -> float:
    """:func:`decode_cost` of a Llama of ``arch`` whose head scores ``head_rows`` tokens."""
    return llama_matmul_params(arch, head_rows) + LAYER_COST * arch.num_hidden_layers + STEP_COST


def llama_arch(width: int, layers: int) -> Arch:
    """A Llama shape of ``width``: heads of 64 (of 32 below 128 wide), an MLP 8/3 as wide
    rounded up to 32 (the family draft: 256 -> 704)."""
    head_dim = 64 if width >= 128 and width % 64 == 0 else min(32, width)
    return Arch(hidden_size=width, num_hidden_layers=layers,
                num_attention_heads=width // head_dim,
                intermediate_size=32 * math.ceil(width * 8 / 3 / 32))


def candidates(width: int, layers: int) -> list[Arch]:
    """Draft shapes strictly smaller than a ``layers`` x ``width`` target: no deeper, no
    wider, and not both as deep and as wide."""
    widths = [w for w in [16, 32, 64, 96, *range(128, width + 1, 64)] if w <= width]
    return [llama_arch(w, n) for n in range(1, min(layers, MAX_DRAFT_LAYERS) + 1)
            for w in widths if w < width or n < layers]


def default_draft_arch(teacher: torch.nn.Module, head_rows: int | None = None) -> Arch:
    """The draft ``--config auto`` builds for ``teacher`` (``head_rows``: the draft
    vocabulary's size; None or 0: all of it).

    Of the shapes strictly smaller than the target that cost at most a tenth of its step,
    the one with the most transformer-block weights (the per-layer cost in the estimate
    trades depth against width). The fixed per-step cost is a floor no draft gets under:
    when a tenth of the target is below it, the budget is 1.5 x the cheapest shape, and
    :func:`poor_ratio_warning` tells the user if that is still too dear."""
    cfg = _text_config(teacher.config)
    width, layers = int(cfg.hidden_size), int(cfg.num_hidden_layers)
    rows = head_rows or teacher.get_output_embeddings().weight.shape[0]
    target = decode_cost(teacher)
    options = [a for a in candidates(width, layers) if arch_cost(a, rows) < target]
    if not options:
        from .textdata import TrainInputError

        raise TrainInputError(
            f"the target ({layers} x {width}) is too small for a smaller draft to pay off; "
            "generate with --method ngram, or pass --config with a draft shape")
    cheapest = min(arch_cost(a, rows) for a in options)
    budget = max(TARGET_RATIO * target, FLOOR_SLACK * cheapest)
    fits = [a for a in options if arch_cost(a, rows) <= budget]
    return max(fits, key=lambda a: (llama_matmul_params(a, 0), -a.num_hidden_layers))


def cost_ratio(draft: torch.nn.Module, target: torch.nn.Module, head_rows: int | None = None) -> float:
    """Estimated draft / target decode-step cost (the draft scoring ``head_rows`` tokens)."""
    return decode_cost(draft, head_rows) / decode_cost(target)


def poor_ratio_warning(ratio: float, how: str, auto: bool = False) -> str | None:
    """One line for stderr when a draft's step costs too much of the target's to pay off
    (``how`` says where the figure comes from; ``auto``: the draft is already the default
    size, so only another method helps), else None."""
    if ratio <= POOR_RATIO:
        return None
    fix = ("the target is too small for a draft model to pay off: generate with --method ngram "
           "or --method early-exit instead" if auto else
           "pass a smaller --config (fewer layers, a narrower hidden_size; or leave --config "
           "out to size the draft from the target), or generate with --method ngram or "
           "--method early-exit")
    return (f"[train draft] warning: the draft's decode step costs {ratio:.2f} x the target's "
            f"({how}; above {POOR_RATIO} speculative decoding gains little); {fix}")
