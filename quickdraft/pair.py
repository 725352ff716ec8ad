"""Load a target, its tokenizer and (optionally) a draft, as one step.

:func:`load_pair` is what :meth:`SpeculativeGenerator.from_pretrained
<quickdraft.generator.SpeculativeGenerator.from_pretrained>` and ``quickdraft bench`` both
use, so a model that one of them runs, the other runs too (same backend choice, same
fallback to transformers, same tokenizer check).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .models.draft_vocab import read_draft_vocab
from .models.lm import CausalLM, load_model
from .models.loading import CheckpointError, check_tokenizer_files, first_line, resolve_pair


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer, loaded exactly as ``AutoTokenizer.from_pretrained`` does;
    a directory without tokenizer files is a :class:`CheckpointError` naming them."""
    from transformers import AutoTokenizer

    check_tokenizer_files(Path(model_dir))
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"the tokenizer in {model_dir} could not be loaded: {first_line(exc)}") from None


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


def load_pair(
    model: str | Path | None = None,
    draft: str | Path | None = None,
    need_draft: bool = True,
    backend: str = "auto",
    draft_vocab: int | None = None,
) -> ModelPair:
    """Load a target (default: the embedded default), its tokenizer and, when ``need_draft``,
    a draft (default: the embedded target's paired draft).

    ``backend`` is ``"auto"`` (native when it supports the checkpoint, else transformers),
    ``"native"`` or ``"hf"``, applied to each model on its own. Raises ``ValueError`` when the
    draft's tokenizer differs from the target's.

    ``draft_vocab``: how many of the draft's most frequent tokens it scores (its
    ``draft_vocab.json``, :mod:`quickdraft.models.draft_vocab`): None its default, 0 all.
    """
    target_dir, draft_dir = resolve_pair(model, draft, need_draft)
    target = load_model(target_dir, backend)
    tokenizer = load_tokenizer(target_dir)
    draft_lm = None
    if draft_dir is not None:
        check_same_tokenizer(tokenizer, load_tokenizer(draft_dir), str(target_dir), str(draft_dir))
        draft_lm = load_model(draft_dir, backend, head_vocab=read_draft_vocab(draft_dir, draft_vocab))
    return ModelPair(target, tokenizer, draft_lm, target_dir, draft_dir)
