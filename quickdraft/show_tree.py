"""``generate --show-tree``: draw one step's proposal tree with the accepted path marked."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .decoding.drafter import Drafter
from .decoding.proposal import Proposal
from .decoding.sampling import SamplingParams


class TreeRecorder:
    """Wraps a drafter and keeps the first non-empty proposal with its accepted path."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self.proposal: Proposal | None = None
        self.path: list[int] | None = None
        self._current: dict[int, Proposal] = {}  # slot -> its last proposal

    def verify_width(self, k: int) -> int:
        return self.drafter.verify_width(k)

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        self.drafter.join(slot, prompt, params, generator, max_len)

    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        proposals = self.drafter.propose(slots, sequences, ks)
        self._current.update(zip(slots, proposals))
        return proposals

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        current = self._current.pop(slot, None)
        if self.proposal is None and current is not None and current.size:
            self.proposal, self.path = current, list(path)
        self.drafter.verified(slot, length, path)

    def leave(self, slot: int) -> None:
        self._current.pop(slot, None)
        self.drafter.leave(slot)


def render_tree(proposal: Proposal, path: list[int], show: Callable[[int], str]) -> str:
    """Text drawing of the tree, one node a line; accepted nodes are marked ``[x]``."""
    kids = proposal.children()
    accepted = set(path)
    lines = [f"proposal: {proposal.size} nodes, depth {proposal.depth}, accepted {len(path)} "
             "([x] = accepted by the target)"]

    def walk(node: int, indent: str) -> None:
        children = kids.get(node, [])
        for i, child in enumerate(children):
            last = i == len(children) - 1
            mark = "[x]" if child in accepted else "[ ]"
            lines.append(f"{indent}{'`-- ' if last else '|-- '}{mark} {show(int(proposal.tokens[child]))!r}")
            walk(child, indent + ("    " if last else "|   "))

    walk(-1, "")
    return "\n".join(lines)
