"""Load a target, its tokenizer and (optionally) a draft, as one step.

:func:`load_pair` is what :meth:`SpeculativeGenerator.from_pretrained
<quickdraft.generator.SpeculativeGenerator.from_pretrained>` and ``quickdraft bench`` both
use, so a model that one of them runs, the other runs too (same backend choice, same
fallback to transformers, same tokenizer check).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from .models import gguf
from .models.config import UnsupportedModelError
from .models.draft_vocab import read_draft_vocab
from .models.lm import CausalLM, NativeLM, load_model
from .models.loading import (
    CheckpointError,
    check_tokenizer_files,
    first_line,
    read_model_config,
    resolve_draft,
    resolve_target,
)
from .models.placement import Placement
from .models.quant_linear import is_quantized, native_kernels
from .models.shared_embed import shared_tensors
from .models.tokenizer import FAST_CLASSES, load_fast_tokenizer

#: The methods only the native runtime runs, and why: the transformers backend verifies a
#: chain of tokens with the full model, nothing else.
NATIVE_ONLY_METHODS = {
    "tree": "it verifies a token tree in one pass",
    "multi-draft": "it verifies several drafts merged into a token tree",
    "layer-skip": "its draft is the target with sub-layers skipped",
    "early-exit": "its draft is the target's own first layers, sharing its KV cache",
    "medusa": "its heads read the target's hidden states and it verifies a token tree",
    "prophet": "it reads the target's hidden states",
    "eagle": "its drafter reads the target's hidden states and it verifies a token tree",
    "hybrid-eagle": "its EAGLE drafter reads the target's hidden states",
}
#: The methods the transformers backend runs, as the messages list them.
HF_METHODS = "draft, hybrid, ngram or ar"


def check_method_backend(method: str, backend: str, target_dir: Path | None = None) -> None:
    """Refuse, in one line and before any model loads, a method the backend cannot run:
    a native-only method with ``backend="hf"``, or (given ``target_dir``) with ``"auto"``
    for an architecture the native runtime lacks (auto would fall back to transformers)."""
    why = NATIVE_ONLY_METHODS.get(method)
    if why is None or backend == "native":
        return
    if backend == "hf":
        raise ValueError(f"--method {method} needs the native runtime ({why}); the transformers backend "
                         f"verifies plain chains only: drop --backend hf, or use --method "
                         f"{HF_METHODS} with it")
    if target_dir is not None:
        try:
            read_model_config(target_dir)
        except UnsupportedModelError as exc:
            raise ValueError(f"--method {method} needs the native runtime ({why}), which cannot run "
                             f"{target_dir}: {first_line(exc)}; use --method {HF_METHODS}") from None


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer, as ``AutoTokenizer.from_pretrained`` loads it; a directory
    without tokenizer files is a :class:`CheckpointError` naming them. A GGUF file's tokenizer
    is built from its metadata.

    A ``tokenizer.json`` tokenizer of the plain fast class (ours, SmolLM2's, most) is built
    on ``tokenizers`` alone (:mod:`quickdraft.models.tokenizer`): importing transformers
    costs 1-2 s of start-up. Any other tokenizer is transformers'."""
    if gguf.is_gguf(model_dir):
        return gguf.load_tokenizer(Path(model_dir))
    check_tokenizer_files(Path(model_dir))
    try:
        fast = load_fast_tokenizer(Path(model_dir))
        if fast is not None:
            return fast
        if _fast_tokenizer_class(Path(model_dir)):
            # What AutoTokenizer resolves this config to, without its detour through
            # AutoConfig, which imports torch.distributed (about 1.3 s of start-up).
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"the tokenizer in {model_dir} could not be loaded: {first_line(exc)}") from None


def _fast_tokenizer_class(model_dir: Path) -> bool:
    """Whether the directory's tokenizer is the plain fast tokenizer (``tokenizer.json`` and
    ``tokenizer_class`` PreTrainedTokenizerFast, as ours are)."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (model_dir / "tokenizer.json").is_file() and config.get("tokenizer_class") in FAST_CLASSES


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Draft and target must share a vocabulary (padded embedding sizes may differ)."""
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(
            f"draft {draft_name} and target {target_name} use different tokenizers; "
            "speculative decoding needs a draft with the target's tokenizer"
        )


@dataclass
class ModelPair:
    """A loaded target, its tokenizer and an optional draft, with their directories."""

    target: CausalLM
    tokenizer: object
    draft: CausalLM | None
    target_dir: Path
    draft_dir: Path | None


def draft_placement(placement: Placement | None, target: CausalLM, draft_dir: Path) -> Placement:
    """The draft's placement: the target's, except that ``--quantize auto`` beside a
    quantized target (a GGUF file's own int4/int8 weights) stores the draft in int8 as
    well, where our kernels run: its float32 step would otherwise be a large share of a
    speculative step (SmolLM2's two-layer draft: ~6 of ~30 ms). The draft's rounding
    never changes what the target accepts. A draft only transformers runs keeps float."""
    placement = placement or Placement()
    quantized_target = isinstance(target, NativeLM) and is_quantized(target.model)
    if placement.quantize != "auto" or not quantized_target or not native_kernels():
        return placement
    try:
        read_model_config(draft_dir)
    except UnsupportedModelError:
        return placement
    return replace(placement, quantize="int8")


def load_pair(
    model: str | Path | None = None,
    draft: str | Path | None = None,
    need_draft: bool = True,
    backend: str = "auto",
    draft_vocab: int | None = None,
    method: str | None = None,
    placement: Placement | None = None,
) -> ModelPair:
    """Load a target (default: the embedded default), its tokenizer and, when ``need_draft``,
    a draft (default: the embedded target's paired draft).

    ``backend`` is ``"auto"`` (native when it supports the checkpoint, else transformers),
    ``"native"`` or ``"hf"``, applied to each model on its own. Raises ``ValueError`` when the
    draft's tokenizer differs from the target's.

    ``draft_vocab``: how many of the draft's most frequent tokens it scores (its
    ``draft_vocab.json``, :mod:`quickdraft.models.draft_vocab`): None its default, 0 all.
    ``method``, when given, is checked against the backend first
    (:func:`check_method_backend`), so a combination that cannot run loads nothing.
    ``placement``: the device and dtype of both models (default: CPU, float32).
    """
    if method is not None:
        check_method_backend(method, backend)
    target_dir = resolve_target(model)
    if method is not None:
        check_method_backend(method, backend, target_dir)
    draft_dir = resolve_draft(target_dir, model, draft) if need_draft else None
    target = load_model(target_dir, backend, placement)
    tokenizer = load_tokenizer(target_dir)
    draft_lm = None
    if draft_dir is not None:
        check_same_tokenizer(tokenizer, load_tokenizer(draft_dir), str(target_dir), str(draft_dir))
        draft_lm = load_model(draft_dir, backend, draft_placement(placement, target, draft_dir),
                              head_vocab=read_draft_vocab(draft_dir, draft_vocab), shared=shared_tensors(draft_dir, target))
    return ModelPair(target, tokenizer, draft_lm, target_dir, draft_dir)
