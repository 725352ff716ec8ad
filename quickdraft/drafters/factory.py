"""Methods by name: which drafter (and which draft shape) each ``--method`` uses."""

from __future__ import annotations

from dataclasses import dataclass

from ..models.lm import CausalLM
from .base import Drafter, NoDrafter
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter
from .shapes import MultiDraft, Shape, StaticTree, parse_tree

METHODS = ("ar", "draft", "ngram", "tree", "multi-draft", "hybrid")
NEEDS_DRAFT = ("draft", "tree", "multi-draft", "hybrid")


@dataclass(frozen=True)
class DraftOptions:
    """Method settings beyond k (the CLI flags of the same names)."""

    tree: str = "2,2,1"
    tree_children: str = "sample"  # sample (i.i.d. from q when sampling) or top (top-k, one-hot q)
    num_drafts: int = 3
    ngram_max: int = 3
    ngram_min: int = 1


def draft_shape(method: str, options: DraftOptions) -> Shape:
    if method == "tree":
        shape = parse_tree(options.tree)
        if isinstance(shape, StaticTree) and options.tree_children == "top":
            return StaticTree(shape.widths, sample=False)
        return shape
    if method == "multi-draft":
        if options.num_drafts < 1:
            raise ValueError(f"--num-drafts must be >= 1, got {options.num_drafts}")
        return MultiDraft(options.num_drafts)
    return Shape()


def make_drafter(
    method: str, draft: CausalLM | None, target_vocab_size: int, options: DraftOptions = DraftOptions()
) -> Drafter:
    """The drafter of ``method``; a one-line ValueError for unknown methods or a missing draft."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if method == "ar":
        return NoDrafter()
    if method == "ngram":
        return NgramDrafter(options.ngram_max, options.ngram_min)
    shape = draft_shape(method, options)  # checks the options before a missing draft
    if draft is None:
        raise ValueError(f"--method {method} needs a draft model (--draft); ngram and ar need none")
    model_drafter = DraftModelDrafter(draft, target_vocab_size, shape)
    if method == "hybrid":
        from .hybrid import HybridDrafter

        return HybridDrafter(NgramDrafter(options.ngram_max, options.ngram_min), model_drafter)
    return model_drafter
