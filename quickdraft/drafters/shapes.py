"""How a draft model grows a proposal: a chain, a static tree, a dynamic tree, N drafts.

A shape picks, level by level, the children of the nodes the draft model has just scored
(``children``), which of them to score next (``frontier``) and, at the end, which nodes
to keep (``finish``). The draft model drafter runs the levels; the shapes only choose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..decoding.proposal import Proposal
from ..decoding.sampling import SamplingParams, choose, draw, host_probabilities


@dataclass
class Node:
    parent: int  # index of the parent node, -1 for the root
    token: int
    q: torch.Tensor | None  # the draft distribution it was drawn from; None: chosen deterministically
    count: int = 1  # draws merged into this node (multi-draft)
    score: float = 0.0  # cumulative draft log-probability of its path (dynamic trees)
    chain: bool = False  # on the draft's argmax path (greedy multi-draft)


def draws(q: torch.Tensor, n: int, generator: torch.Generator) -> list[tuple[int, int]]:
    """``n`` i.i.d. draws from ``q`` merged into (token, count), in order of first draw."""
    counts: dict[int, int] = {}
    for token in draw(q, n, generator).tolist():
        counts[token] = counts.get(token, 0) + 1
    return list(counts.items())


def as_proposal(nodes: list[Node], keep: list[int]) -> Proposal:
    """The kept nodes (a topological order, ancestors included), renumbered, as a proposal."""
    new_index = {old: new for new, old in enumerate(keep)}
    kept = [nodes[i] for i in keep]
    tokens = torch.tensor([n.token for n in kept], dtype=torch.long)
    parents = torch.tensor([new_index.get(n.parent, -1) for n in kept], dtype=torch.long)
    probs = torch.stack([n.q for n in kept]) if kept and kept[0].q is not None else None
    counts = torch.tensor([n.count for n in kept]) if any(n.count > 1 for n in kept) else None
    return Proposal(tokens, parents, probs, counts)


class Shape:
    """A chain: one child per node, the draft's own choice (argmax, or a sample from q)."""

    name = "draft"

    def depth(self, k: int) -> int:
        return k

    def width(self, k: int) -> int:
        """The most nodes of a proposal of depth <= ``k``."""
        return k

    def root_count(self) -> int:
        return 1

    def children(
        self, depth: int, parent: Node | None, index: int, logits: torch.Tensor,
        params: SamplingParams, generator: torch.Generator,
    ) -> list[Node]:
        token, q = choose(logits, params, generator)
        return [Node(index, token, q)]

    def grow(self, depth: int, nodes: list[Node], frontier: list[int], logits: torch.Tensor,
             params: SamplingParams, generator: torch.Generator) -> list[int]:
        """Append the children of every frontier node (index -1: the root; row ``i`` of
        ``logits`` scores ``frontier[i]``) to ``nodes``; their indices."""
        new: list[int] = []
        for row, index in enumerate(frontier):
            parent = nodes[index] if index >= 0 else None
            for node in self.children(depth, parent, index, logits[row], params, generator):
                new.append(len(nodes))
                nodes.append(node)
        return new

    def frontier(self, depth: int, nodes: list[Node], new: list[int], budget: int) -> list[int]:
        """Which new nodes the draft scores next; at most ``budget`` (the draft's cache holds
        ``width(k)`` nodes after the sequence)."""
        return new[:budget]

    def finish(self, nodes: list[Node], k: int) -> list[int]:
        return list(range(len(nodes)))


class StaticTree(Shape):
    """SpecInfer's bounded expansion ``<w1, w2, ...>``: ``w_d`` children per node at depth d,
    the draft's top-w (deterministic, one-hot q) or ``w`` i.i.d. samples from q merged
    (sampling with ``sample=True``; fewer children when draws repeat)."""

    def __init__(self, widths: tuple[int, ...], sample: bool = True) -> None:
        self.widths, self.sample = widths, sample
        self.name = f"tree({','.join(map(str, widths))}{'' if sample else ',top'})"

    def depth(self, k: int) -> int:
        return min(k, len(self.widths))

    def width(self, k: int) -> int:
        return sum(math.prod(self.widths[: d + 1]) for d in range(self.depth(k)))

    def children(self, depth, parent, index, logits, params, generator):
        w = self.widths[depth]
        if self.sample and not params.greedy:
            q = host_probabilities(logits, params, generator)
            return [Node(index, t, q, c) for t, c in draws(q, w, generator)]
        return [Node(index, t, None) for t in torch.topk(logits, w).indices.tolist()]


class MultiDraft(Shape):
    """``n`` sequences sampled i.i.d. from the draft, merged into one tree (shared prefixes
    once): a node reached by c sequences gets c draws for its children. Greedy decoding
    only walks the tree, so one sequence is the draft's argmax chain (what the chain
    drafter proposes: the tree never accepts less) and the other ``n - 1`` are drawn from
    the unwarped draft distribution for variety."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.name = f"multi-draft({n})"

    def width(self, k: int) -> int:
        return self.n * k

    def root_count(self) -> int:
        return self.n

    def children(self, depth, parent, index, logits, params, generator):
        count = parent.count if parent is not None else self.n
        if not params.greedy:
            q = host_probabilities(logits, params, generator)
            return [Node(index, t, q, c) for t, c in draws(q, count, generator)]
        counts: dict[int, int] = {}
        on_chain = parent is None or parent.chain
        if on_chain:  # the argmax sequence keeps one draw at every level
            counts[int(logits.argmax())] = 1
            count -= 1
        if count > 0:
            for t, c in draws(logits.float().softmax(-1).to(generator.device), count, generator):
                counts[t] = counts.get(t, 0) + c
        argmax = next(iter(counts)) if on_chain else None
        return [Node(index, t, None, c, chain=t == argmax) for t, c in counts.items()]


class DynamicTree(Shape):
    """EAGLE-2: every scored node gets its top-``branch`` children, scored by cumulative
    draft log-probability; the best ``branch`` new nodes of a level that are among the best
    ``n`` so far are scored next (at most ``n`` scored in all); the best ``n`` nodes
    overall are kept (a child never outscores its parent, so the kept set
    contains every kept node's ancestors). Children are deterministic (one-hot q)."""

    def __init__(self, n: int, branch: int = 4) -> None:
        self.n, self.branch = n, min(branch, n)
        self.name = f"tree(dynamic:{n})"

    def width(self, k: int) -> int:
        return min(self.n, sum(self.branch ** (d + 1) for d in range(k)))

    def children(self, depth, parent, index, logits, params, generator):
        logp = logits.float().log_softmax(-1)
        top = torch.topk(logp, self.branch)
        base = parent.score if parent is not None else 0.0
        return [Node(index, t, None, 1, base + s) for t, s in zip(top.indices.tolist(), top.values.tolist())]

    def frontier(self, depth, nodes, new, budget):
        # Only a node among the best n so far can have a kept descendant (scores only fall).
        best = set(sorted(range(len(nodes)), key=lambda i: -nodes[i].score)[: self.n])
        grow = [i for i in sorted(new, key=lambda i: -nodes[i].score) if i in best]
        return sorted(grow[: min(self.branch, budget)])

    def finish(self, nodes, k):
        return sorted(sorted(range(len(nodes)), key=lambda i: -nodes[i].score)[: self.n])


#: The most nodes a tree may have: one verify pass scores them all (and a level's masks
#: and scores grow with them), so 50,50,50 (127,550 nodes) exhausted memory instead of
#: failing; the trees that pay hold 4-64.
MAX_TREE_NODES = 1024


def parse_tree(text: str) -> Shape:
    """``"2,2,1"`` (static widths) or ``"dynamic:N"``; a one-line error otherwise."""
    spec = text.strip()
    shape: Shape | None = None
    try:
        if spec.startswith("dynamic:"):
            n = int(spec.split(":", 1)[1])
            if n >= 1:
                shape, nodes = DynamicTree(n), n
        else:
            widths = tuple(int(w) for w in spec.split(","))
            if widths and all(w >= 1 for w in widths):
                shape = StaticTree(widths)
                nodes = shape.width(len(widths))
    except ValueError:
        pass
    if shape is None:
        raise ValueError(
            f"--tree {text!r} is not a tree shape; give children per level like 2,2,1 "
            "(each >= 1) or dynamic:N (N >= 1 nodes)"
        )
    if nodes > MAX_TREE_NODES:
        raise ValueError(f"--tree {text!r} has {nodes} nodes; at most {MAX_TREE_NODES} fit one verify pass "
                         "(trees that pay hold 4-64)")
    return shape
