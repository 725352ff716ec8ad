"""Methods by name: which drafter (and which draft shape) each ``--method`` uses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..decoding.drafter import Drafter, NoDrafter
from ..models.lm import CausalLM
from .datastore import Datastore, resolve_datastore
from .draft_model import DraftModelDrafter
from .draft_stop import ADAPTIVE_MAX_DEPTH, FixedStop, parse_draft_stop
from .ngram import NgramDrafter
from .shapes import MultiDraft, Shape, StaticTree, parse_tree

if TYPE_CHECKING:
    from ..models.eagle import EagleHead
    from ..models.exit_head import ExitHead
    from ..models.medusa import MedusaHeads
    from ..models.prophet import Prophet

@dataclass(frozen=True)
class MethodSpec:
    """One decoding method: what it does, what it needs, and where it runs.

    ``needs``: "draft" (a draft model), "target" (drafts with the target itself), "heads"
    (heads trained on the target that read its hidden states, ``reads_hidden`` in
    :mod:`quickdraft.decoding.drafter`; native runtime), "nothing" or "measured" (auto: a
    draft, and the cost model's measurement). ``chain``: it drafts a
    chain, so ``--draft-stop`` applies. ``batched``: the batched engine runs it
    (:func:`~quickdraft.drafters.batched.make_batch_drafter`); every method runs at batch 1
    (:func:`make_drafter`). ``lossless``: output identical in distribution to the target's
    (every built-in method is; a lossy one must say so in its summary). ``default_k``:
    where its k comes from when none is given (a chain with an adaptive ``--draft-stop`` drafts
    up to ``ADAPTIVE_MAX_DEPTH`` instead)."""

    summary: str
    needs: str = "draft"
    chain: bool = False
    batched: bool = False
    lossless: bool = True
    default_k: str = "4; batched: the batch policy's k for the batch size"


#: The one table of decoding methods (the CLI's ``--method`` choices, the API's ``method=``,
#: the server's and the bench's). A new method adds an entry here and its drafter in
#: :func:`make_drafter` (and :func:`~quickdraft.drafters.batched.make_batch_drafter` if it batches).
METHODS: dict[str, MethodSpec] = {
    "ar": MethodSpec("plain decoding (no drafter)", needs="nothing", batched=True, default_k="none (no drafts)"),
    "draft": MethodSpec("speculative decoding with a draft model (default)", chain=True, batched=True,
                        default_k="the cost model's k in the CLI and server (measured once per pair and "
                                  "machine, cached); 4 in the API until tune_num_speculative_tokens(); "
                                  "batched: the batch policy's k"),
    "ngram": MethodSpec("prompt lookup: continue an earlier match of the last n tokens (no model); else, "
                        "beside a target with a datastore of its own text (--datastore), the continuation "
                        "most of the tail's matches there share", needs="nothing", batched=True),
    "tree": MethodSpec("the draft model expands a token tree (--tree), verified in one pass",
                       default_k="4"),
    "multi-draft": MethodSpec("--num-drafts sequences from the draft merged into one tree", default_k="4"),
    "hybrid": MethodSpec("the n-gram continuation (prompt, then datastore) when one matches, else the draft "
                         "model", chain=True, batched=True),
    "layer-skip": MethodSpec("the target drafts for itself with sub-layers skipped (--skip-profile; no draft model)",
                             needs="target", chain=True, default_k="the k its skip profile was tuned at"),
    "early-exit": MethodSpec("self-speculation: the target's first --exit-layer layers + an exit head draft, "
                             "sharing its KV cache", needs="target", chain=True, batched=True),
    "medusa": MethodSpec("Medusa heads on the target's last hidden state propose a token tree (--heads DIR, "
                         "default: heads shipped for the target; --tree shapes it, one level per head)",
                         needs="heads", batched=True,
                         default_k="4 (one tree level per head, at most the number of heads); batched: a chain of 4"),
    "prophet": MethodSpec("a prophet transformer drafts a chain from the target's last hidden states (--heads DIR, "
                          "default: the prophet shipped for the target)", needs="heads", batched=True, default_k="4"),
    "eagle": MethodSpec("an EAGLE drafter (fc([token; target feature]) + one layer, at the target's width and read by "
                        "its LM head, or at a draft model's width with its own) grows "
                        "a token tree (--heads DIR, default: the drafter shipped for the target; --tree, default "
                        "on the CPU a chain as long as the cost model finds pays, on a GPU dynamic:10, EAGLE-2's "
                        "best nodes by cumulative confidence; --draft-stop heuristic: a chain whose length "
                        "adapts, up to 12)",
                        needs="heads", chain=True, batched=True,
                        default_k="the cost model's chain length on the CPU (1-8, measured once, cached), else 6 "
                                  "(the tree's depth); batched: a chain of 6"),
    "hybrid-eagle": MethodSpec("the n-gram continuation when 3+ tokens match, else an EAGLE drafter's chain (--heads DIR, "
                               "default: the drafter shipped for the target; --tree 1,...,1 sets the chain, "
                               "default 1,1); the drafter catches up on the n-gram's tokens when it next drafts",
                               needs="heads", chain=True, batched=True,
                               default_k="6 (the n-gram's most; the EAGLE chain is --tree's, at most k), "
                                         "batched too"),
    "auto": MethodSpec("the cost model picks the method, k and tree for this pair and machine (measured once, cached)",
                       needs="measured", default_k="the cost model's choice with the method"),
}
#: ``--tree`` when none is given (eagle has its own, :data:`.eagle.DEFAULT_TREE`).
DEFAULT_TREE = "2,2,1"
NEEDS_DRAFT = tuple(name for name, m in METHODS.items() if m.needs in ("draft", "measured"))
CHAIN_METHODS = tuple(name for name, m in METHODS.items() if m.chain)  # the methods --draft-stop applies to
BATCH_METHODS = tuple(name for name, m in METHODS.items() if m.batched)


@dataclass(frozen=True)
class DraftOptions:
    """Method settings beyond k (the CLI flags of the same names)."""

    tree: str | None = None  # None: the method's own default (2,2,1; eagle: a cost-model chain, dynamic:10 on GPUs)
    tree_children: str = "sample"  # sample (i.i.d. from q when sampling) or top (top-k, one-hot q)
    num_drafts: int = 3
    ngram_max: int = 3
    ngram_min: int | None = None  # None: the method's own (ngram_min_default)
    draft_stop: str = "fixed"  # when a chain stops drafting (drafters/draft_stop.py)
    skip_profile: str | None = None  # layer-skip: a JSON skip profile (default: the shipped one)
    exit_layer: int | None = None  # early exit: None = the head's layer (shipped head) or the default
    exit_head: str | ExitHead | None = None  # early exit: a head directory, "shared", a loaded head or None (shipped)
    share_kv: bool = True  # early exit: drafting writes the target's cache, verification resumes at L
    # medusa / prophet / eagle: a directory, loaded heads or None (those shipped for the target)
    heads: str | MedusaHeads | Prophet | EagleHead | None = None
    # eagle / prophet / early exit: how many of the head's most frequent tokens it scores (its
    # draft_vocab.json; None: the file's default, 0: all). A draft model's is load_pair's.
    draft_vocab: int | None = None
    # ngram / hybrid / hybrid-eagle: a retrieval datastore searched when the sequence's tail
    # occurs nowhere earlier in it (a directory, a loaded one, "none" (off) or None: the one
    # shipped for the target, if any; drafters/datastore.py)
    datastore: str | Datastore | None = None

    def __post_init__(self) -> None:
        """One-line errors for bad settings, before any model is loaded."""
        if self.tree is not None:
            parse_tree(self.tree)
        parse_draft_stop(self.draft_stop)
        if self.tree_children not in ("sample", "top"):
            raise ValueError(f"tree children must be sample or top, got {self.tree_children!r}")
        if self.num_drafts < 1:
            raise ValueError(f"--num-drafts must be >= 1, got {self.num_drafts}")
        if self.ngram_min is not None and not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"n-gram sizes need 1 <= --ngram-min <= --ngram-max, got {self.ngram_min} and {self.ngram_max}"
            )
        if isinstance(self.datastore, str) and self.datastore != "none" and not Path(self.datastore).is_dir():
            raise ValueError(f"--datastore {self.datastore}: no such directory (build one with `quickdraft "
                             f"train datastore`, or pass none)")
        if self.exit_layer is not None and self.exit_layer < 1:
            raise ValueError(f"--exit-layer must be >= 1, got {self.exit_layer}")
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise ValueError(f"--draft-vocab must be >= 0 (0: all), got {self.draft_vocab}")


def draft_shape(method: str, options: DraftOptions) -> Shape:
    if method == "tree":
        shape = parse_tree(options.tree or DEFAULT_TREE)
        if isinstance(shape, StaticTree) and options.tree_children == "top":
            return StaticTree(shape.widths, sample=False)
        return shape
    if method == "multi-draft":
        return MultiDraft(options.num_drafts)
    return Shape()


def make_drafter(
    method: str, draft: CausalLM | None, target_vocab_size: int, options: DraftOptions = DraftOptions(),
    target: CausalLM | None = None,
) -> Drafter:
    """The drafter of ``method``; a one-line ValueError for unknown methods or a missing draft.
    ``target`` is needed by self-speculative methods (early-exit, layer-skip), which draft with it."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if method == "auto":
        raise ValueError("method auto is chosen by measurement: use SpeculativeGenerator.from_pretrained(method='auto')")
    stop = parse_draft_stop(options.draft_stop)
    if not isinstance(stop, FixedStop) and method not in CHAIN_METHODS:
        raise ValueError(f"--draft-stop {options.draft_stop} stops chains; --method {method} does not draft one "
                         f"(use it with {', '.join(CHAIN_METHODS)})")
    if method == "ar":
        return NoDrafter()
    if method == "early-exit":
        from .early_exit import early_exit_drafter

        if target is None:
            raise ValueError("--method early-exit drafts with the target's own layers: pass the target")
        if options.draft_stop.startswith("cost"):
            # The cost policy weighs measured draft-step costs; they are measured for draft
            # models (auto-k) and skip drafts, not yet for an exit head.
            raise ValueError("--draft-stop cost needs measured draft costs, which early exit does not have "
                             "yet; use fixed, confidence:T, dv or heuristic")
        return early_exit_drafter(target, options, stop)
    if method == "ngram":
        return ngram_drafter(method, options, target)
    if method == "medusa":
        from .medusa import medusa_drafter

        shape = parse_tree(options.tree or DEFAULT_TREE)
        if not isinstance(shape, StaticTree):
            raise ValueError(f"--method medusa expands a static tree (children per level, e.g. 2,2,1), "
                             f"not --tree {options.tree}")
        return medusa_drafter(target, options.heads, shape.widths)
    if method == "prophet":
        from .prophet import ProphetDrafter, load_prophet_for

        return ProphetDrafter(target, load_prophet_for(target, options.heads, options.draft_vocab))
    if method == "eagle":
        return _eagle_drafter(target, options, stop)
    if method == "hybrid-eagle":
        from .hybrid import HybridDrafter

        return HybridDrafter(ngram_drafter(method, options, target),
                             _eagle_drafter(target, options, stop, hybrid=True), own_k=(HYBRID_EAGLE_K, "default"))
    shape = draft_shape(method, options)
    if method == "layer-skip":
        from .layer_skip import LayerSkipLM, load_profile

        if target is None:
            raise ValueError("--method layer-skip drafts with the target itself; pass the target")
        draft = LayerSkipLM(target, load_profile(target, options.skip_profile))
    if draft is None:
        raise ValueError(f"--method {method} needs a draft model (--draft); ngram and ar need none")
    model_drafter = DraftModelDrafter(draft, target_vocab_size, shape, stop)
    if method == "hybrid":
        from .hybrid import HybridDrafter

        return HybridDrafter(ngram_drafter(method, options, target), model_drafter)
    return model_drafter


#: The shortest tail prompt lookup matches, by method. A one-token tail matches too often by
#: chance: 2 beat 1 on every category of both shipped targets (session 32, docs/bench/
#: ngram_min_ab.py: embedded 1.47/1.18/1.49x -> 1.54/1.28/1.56x; SmolLM2 chat 0.86 -> 0.97x,
#: code 1.45 -> 1.51x; k = 4). Beside an EAGLE drafter a two-token match on chat displaces a
#: better guess: 3 took SmolLM2's chat from 1.21-1.23x to 1.27-1.28x plain decoding in two
#: paired runs, code level (1.80-1.81x -> 1.78-1.82x; docs/smollm2/datastore.md).
NGRAM_MIN = {"hybrid-eagle": 3}
NGRAM_MIN_DEFAULT = 2
#: The methods that search the target's shipped datastore when no --datastore is given.
#: Beside SmolLM2 it took ngram (k=4) from 1.02x to 1.18x plain decoding on chat (code
#: level) and hybrid with the draft model from 0.72x / 1.25x to 0.92x / 1.30x (chat / code);
#: beside the EAGLE drafter it cost 2-4% on code and gained at most that on chat, so
#: hybrid-eagle takes one only when named (docs/smollm2/datastore.md).
DATASTORE_BY_DEFAULT = frozenset({"ngram", "hybrid"})
DATASTORE_METHODS = ("ngram", "hybrid", "hybrid-eagle")  # the methods whose prompt lookup can search one


def ngram_min_default(method: str, ngram_max: int) -> int:
    return min(NGRAM_MIN.get(method, NGRAM_MIN_DEFAULT), ngram_max)


def ngram_drafter(method: str, options: DraftOptions, target: CausalLM | None) -> NgramDrafter:
    """``method``'s prompt lookup: ``options``' tail sizes (else the method's), and datastore
    (else the one shipped for ``target`` where the method searches one by default)."""
    low = options.ngram_min if options.ngram_min is not None else ngram_min_default(method, options.ngram_max)
    store = options.datastore
    if store is None and method not in DATASTORE_BY_DEFAULT:
        store = "none"
    return NgramDrafter(options.ngram_max, low, resolve_datastore(target, store))


#: The EAGLE chain of ``hybrid-eagle`` when no ``--tree`` is given, and its k (the n-gram's
#: most) when none is given. Short chains, because the n-gram takes the long runs:
#: SmolLM2's 12 code prompts (128 tokens, one run, every output the plain one's), beside
#: n-gram k=4 alone at 1.81x plain decoding: k=4 with an EAGLE chain of 1 1.82x, of 2
#: 1.90x; k=6, chain of 2 1.98x (docs/smollm2/bench.md, "Session 37"). Beside the embedded
#: target, whose EAGLE drafter is right far more often, EAGLE alone wins (chain of 8).
HYBRID_EAGLE_CHAIN = 2
HYBRID_EAGLE_TREE = ",".join(["1"] * HYBRID_EAGLE_CHAIN)
HYBRID_EAGLE_K = 6


def hybrid_eagle_chain(tree: str | None) -> int:
    """How many tokens ``hybrid-eagle``'s EAGLE chain drafts: ``--tree 1,...,1`` (one 1 a
    token; None: :data:`HYBRID_EAGLE_TREE`); a one-line ValueError for any other tree."""
    shape = parse_tree(tree or HYBRID_EAGLE_TREE)
    if not (isinstance(shape, StaticTree) and all(w == 1 for w in shape.widths)):
        raise ValueError(f"--method hybrid-eagle drafts a chain: pass --tree 1,1,...,1 (one 1 per token), "
                         f"not --tree {tree}")
    return len(shape.widths)


def _eagle_drafter(target: CausalLM | None, options: DraftOptions, stop, hybrid: bool = False) -> Drafter:
    """``--method eagle``'s drafter (or ``hybrid-eagle``'s chain, ``hybrid``)."""
    from .eagle import EagleDrafter, eagle_shape, load_eagle_head

    device = getattr(target, "device", None)
    adaptive = not isinstance(stop, FixedStop)
    # No --tree on the CPU: a chain as long as the cost model finds pays (generate's k);
    # with an adaptive --draft-stop, a chain as long as it may grow.
    by_cost_model = (not hybrid and options.tree is None and not (device is not None and device.type == "cuda")
                     and not adaptive)
    tree = options.tree or (",".join(["1"] * ADAPTIVE_MAX_DEPTH) if adaptive else
                            HYBRID_EAGLE_TREE if hybrid else None)
    if hybrid:
        hybrid_eagle_chain(tree)  # its one-line error for a tree
    shape = eagle_shape(tree, options.tree_children, device)
    return EagleDrafter(target, load_eagle_head(target, options.heads, options.draft_vocab), shape, by_cost_model,
                        stop)
