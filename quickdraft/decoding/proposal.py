"""What a drafter proposes: a token tree (a chain is the tree whose parents are i - 1).

Node ``i`` has token ``tokens[i]`` and parent ``parents[i]`` (``-1``: a child of the last
token of the sequence, the root). Parents come before their children, so node order is a
topological order and a node's depth is its parent's depth + 1. The target verifies the
whole tree in one pass: node ``i`` sits in cache slot ``prefix + i``, at position
``prefix + depth(i)``, and attends to the prefix, its ancestors and itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Proposal:
    """A token tree proposed after the sequence.

    ``probs[i]`` is the draft distribution node ``i`` was drawn from (``q(. | parent)``,
    shared by siblings), or ``probs`` is None for a deterministic drafter (q is then
    one-hot). ``counts[i]`` is how many i.i.d. draws landed on node ``i`` when duplicates
    were merged (multi-draft; None: one each). Siblings are in the order they were drawn.

    ``hidden`` (early exit with a shared KV cache): the residual stream at layer
    ``start_layer`` of every token the verify pass feeds (what the target's cache lacks,
    then the nodes), whose keys and values below that layer the drafter already wrote
    into the target's cache; verification then runs only the layers from ``start_layer``.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    start_layer: int = 0
    is_chain: bool = field(init=False)

    def __post_init__(self) -> None:
        # (as lists: torch's elementwise == and all() took ~8 us a proposal, every round)
        self.is_chain = self.parents.tolist() == list(range(-1, self.tokens.shape[0] - 1))

    @classmethod
    def chain(cls, tokens: torch.Tensor, probs: torch.Tensor | None = None) -> Proposal:
        return cls(tokens, torch.arange(-1, tokens.shape[0] - 1), probs)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def children(self) -> dict[int, list[int]]:
        """Node -> its children in order (``-1``: the root)."""
        kids: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents.tolist()):
            kids.setdefault(parent, []).append(i)
        return kids

    def depths(self) -> torch.Tensor:
        """Depth of every node (0 for children of the root)."""
        if self.is_chain:
            return torch.arange(self.size)
        depth: list[int] = []
        for parent in self.parents.tolist():
            depth.append(0 if parent < 0 else depth[parent] + 1)
        return torch.tensor(depth, dtype=torch.long)

    @property
    def depth(self) -> int:
        """Length of the longest path (0 for an empty proposal)."""
        return 0 if self.size == 0 else int(self.depths().max()) + 1

    def ancestors(self) -> torch.Tensor:
        """``[n, n]`` boolean: ``[i, j]`` iff ``j`` is ``i`` or one of its ancestors."""
        n = self.size
        anc = torch.eye(n, dtype=torch.bool)
        for i, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                anc[i] |= anc[parent]
        return anc


EMPTY = Proposal.chain(torch.empty(0, dtype=torch.long))


def tree_attention(proposal: Proposal, cached: int, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[T]`` and mask ``[T, cached + T]`` for feeding ``sequence[cached:prefix]``
    (causal), then the proposal's nodes (``T = prefix - cached + n``)."""
    lead = prefix - cached
    positions = torch.cat([torch.arange(cached, prefix), prefix + proposal.depths()])
    mask = torch.ones(lead + proposal.size, prefix + proposal.size, dtype=torch.bool).tril(diagonal=cached)
    mask[lead:, prefix:] = proposal.ancestors()
    return positions, mask
