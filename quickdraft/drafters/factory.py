"""Methods by name: which drafter (and which draft shape) each ``--method`` uses."""

from __future__ import annotations

from dataclasses import dataclass

from ..models.lm import CausalLM
from .base import Drafter, NoDrafter
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter
from .shapes import MultiDraft, Shape, StaticTree, parse_tree

#: Decoding methods by name, with what each does (the CLI's ``--method`` choices). A new
#: method adds an entry here and its drafter in :func:`make_drafter`.
METHODS = {
    "ar": "plain decoding (no drafter)",
    "draft": "speculative decoding with a draft model (default)",
    "ngram": "prompt lookup: continue an earlier match of the last n tokens (no model)",
    "tree": "the draft model expands a token tree (--tree), verified in one pass",
    "multi-draft": "--num-drafts sequences from the draft merged into one tree",
    "hybrid": "the n-gram continuation when one matches, else the draft model",
    "auto": "the cost model picks the method, k and tree for this pair and machine (measured once, cached)",
}
NEEDS_DRAFT = ("draft", "tree", "multi-draft", "hybrid", "auto")


@dataclass(frozen=True)
class DraftOptions:
    """Method settings beyond k (the CLI flags of the same names)."""

    tree: str = "2,2,1"
    tree_children: str = "sample"  # sample (i.i.d. from q when sampling) or top (top-k, one-hot q)
    num_drafts: int = 3
    ngram_max: int = 3
    ngram_min: int = 1

    def __post_init__(self) -> None:
        """One-line errors for bad settings, before any model is loaded."""
        parse_tree(self.tree)
        if self.tree_children not in ("sample", "top"):
            raise ValueError(f"tree children must be sample or top, got {self.tree_children!r}")
        if self.num_drafts < 1:
            raise ValueError(f"--num-drafts must be >= 1, got {self.num_drafts}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"n-gram sizes need 1 <= --ngram-min <= --ngram-max, got {self.ngram_min} and {self.ngram_max}"
            )


def draft_shape(method: str, options: DraftOptions) -> Shape:
    if method == "tree":
        shape = parse_tree(options.tree)
        if isinstance(shape, StaticTree) and options.tree_children == "top":
            return StaticTree(shape.widths, sample=False)
        return shape
    if method == "multi-draft":
        return MultiDraft(options.num_drafts)
    return Shape()


def make_drafter(
    method: str, draft: CausalLM | None, target_vocab_size: int, options: DraftOptions = DraftOptions()
) -> Drafter:
    """The drafter of ``method``; a one-line ValueError for unknown methods or a missing draft."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if method == "auto":
        raise ValueError("method auto is chosen by measurement: use SpeculativeGenerator.from_pretrained(method='auto')")
    if method == "ar":
        return NoDrafter()
    if method == "ngram":
        return NgramDrafter(options.ngram_max, options.ngram_min)
    shape = draft_shape(method, options)
    if draft is None:
        raise ValueError(f"--method {method} needs a draft model (--draft); ngram and ar need none")
    model_drafter = DraftModelDrafter(draft, target_vocab_size, shape)
    if method == "hybrid":
        from .hybrid import HybridDrafter

        return HybridDrafter(NgramDrafter(options.ngram_max, options.ngram_min), model_drafter)
    return model_drafter
