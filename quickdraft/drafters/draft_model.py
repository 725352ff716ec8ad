"""A smaller model with the same tokenizer drafts a chain, a token tree or several drafts."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..decoding.drafter import check_single_slot
from ..decoding.proposal import EMPTY, Proposal
from ..decoding.sampling import SamplingParams
from ..models.cpu_kernels import SpecRounds
from ..models.decode_linear import row_dependent_rounding
from ..models.lm import CausalLM, NativeLM
from .draft_stop import DraftStop, FixedStop, rounds_state_of
from .shapes import Node, Shape, as_proposal


def present_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits over the target's ids: same tokenizer, but padded vocabularies may differ."""
    size = logits.shape[-1]
    if size > vocab_size:
        return logits[..., :vocab_size]
    if size < vocab_size:
        return torch.cat([logits, logits.new_full((*logits.shape[:-1], vocab_size - size), float("-inf"))], -1)
    return logits


class DraftModelDrafter:
    """Leviathan / Chen speculative decoding's drafter, grown into trees by a ``Shape``.

    The draft keeps its own KV cache. It scores the proposal level by level: one pass over
    the nodes whose children the shape wants (a chain: one node a pass), with the tree
    mask when the nodes are not a chain. The last level is never fed (nothing needs its
    logits), so after a full acceptance the next ``propose`` feeds the last accepted node
    and the target's bonus token in one pass: the catch-up costs no extra pass.

    ``stop`` (a chain's draft-stop policy, ``--draft-stop``) decides how many tokens a
    chain gets: it caps the depth, may end the chain after any token, and learns from
    each verification. Trees and multi-draft keep the fixed policy.

    One sequence at a time (slot 0): the draft's cache is the model's own, of batch 1
    (``BatchedDraftModel`` drafts chains for many rows).
    """

    def __init__(self, model: CausalLM, target_vocab_size: int, shape: Shape | None = None,
                 stop: DraftStop | None = None) -> None:
        self.model = model
        self.vocab_size = target_vocab_size
        self.shape = shape or Shape()
        self.stop = stop or FixedStop()
        self.name = self.shape.name if self.stop.name == "fixed" else f"{self.shape.name}({self.stop.name})"
        self._drafted = 0  # tokens of the last proposal, for the policy's observe()
        self.params = SamplingParams()
        self.generator = torch.Generator()
        self._kv_rows: dict[int, int] = {}  # node -> offset of its KV row after the prefix

    def verify_width(self, k: int) -> int:
        return self.shape.width(k) + 1

    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        check_single_slot(self, slot)
        self.params, self.generator = params, generator
        self.model.reset(max_len)
        if prompt.shape[0] > 1:
            self.model.extend(prompt[:-1], logits="none")

    def _present(self, logits: torch.Tensor) -> torch.Tensor:
        return present_logits(logits, self.vocab_size)

    def _score(self, nodes: list[Node], grow: list[int], start: int, chain: bool) -> torch.Tensor:
        """Feed the nodes ``grow`` to the draft (after the prefix of ``start`` tokens and the
        nodes fed before); their logits ``[len(grow), V]``."""
        tokens = torch.tensor([nodes[i].token for i in grow])
        fed = len(self._kv_rows)
        for j, i in enumerate(grow):
            self._kv_rows[i] = fed + j
        if chain:
            return self._present(self.model.extend(tokens, logits="all"))
        total = fed + len(grow)
        mask = torch.zeros(len(grow), start + total, dtype=torch.bool)
        mask[:, :start] = True
        depths = []
        for row, i in enumerate(grow):
            depth, node = 0, i
            while node >= 0:
                mask[row, start + self._kv_rows[node]] = True
                node, depth = nodes[node].parent, depth + 1
            depths.append(depth - 1)
        positions = start + torch.tensor(depths)
        return self._present(self.model.extend(tokens, logits="all", positions=positions, mask=mask))

    def _last_fed(self) -> int:
        return max(self._kv_rows, key=self._kv_rows.get) if self._kv_rows else -1

    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        (k,) = ks  # one sequence: slot 0 (join refused any other)
        return [self._draft(sequences[0], k) if k > 0 else EMPTY]

    # The draft's one-token steps need not round like its multi-token passes: the target
    # decides what is accepted, so take the fastest kernels.
    @row_dependent_rounding()
    def _draft(self, sequence: torch.Tensor, k: int) -> Proposal:
        """The proposal of depth <= ``k`` after ``sequence``, grown by the shape."""
        start = sequence.shape[0]
        self._kv_rows = {}
        nodes: list[Node] = []
        frontier, chain = [-1], True  # chain: every node fed so far is an ancestor of the next
        depth_limit = self.stop.max_depth(self.shape.depth(k))
        # A policy that may end the chain token by token (a policy of ours says) is asked
        # after each one; fixed and heuristic ones set only its length, and a confidence
        # floor (confidence, dv) the C chain applies itself.
        stops_mid_chain = getattr(self.stop, "stops_mid_chain", True)
        floor = getattr(self.stop, "min_confidence", None)
        if (self.params.greedy and type(self.shape) is Shape and (not stops_mid_chain or floor is not None)
                and depth_limit > 0):
            # A greedy chain: what the draft has not seen yet and its steps in one C call
            # where its model allows (the same tokens as the loop below; the last one is not
            # fed, as there). The feed in the call saves a forward's Python: 0.94-0.97x the
            # decode time of the embedded pair at k = 8.
            burst = getattr(self.model, "greedy_chain", None)
            tokens = (burst(None, depth_limit - 1, self.vocab_size, feed=sequence[self.model.length :],
                            min_confidence=floor or 0.0) if burst else None)
            if tokens is not None:
                nodes = [Node(i - 1, token, None) for i, token in enumerate(tokens)]
                self._kv_rows = {i: i for i in range(len(tokens) - 1)}
                return self._proposal(nodes, self.shape.finish(nodes, k))
        logits = self._present(self.model.extend(sequence[self.model.length :], logits="last"))
        for depth in range(depth_limit):
            new = self.shape.grow(depth, nodes, frontier, logits, self.params, self.generator)
            if depth + 1 == depth_limit:
                break
            if stops_mid_chain:  # a chain: one new node, drawn from the row's distribution
                q = nodes[-1].q if nodes[-1].q is not None else logits[-1].float().softmax(-1)
                if not self.stop.keep_going(depth + 1, q):
                    break
            frontier = self.shape.frontier(depth, nodes, new, self.shape.width(k) - len(self._kv_rows))
            if not frontier:
                break
            chain = chain and len(frontier) == 1 and nodes[frontier[0]].parent == (self._last_fed())
            logits = self._score(nodes, frontier, start, chain)
        keep = self.shape.finish(nodes, k)
        return self._proposal(nodes, keep)

    @torch.inference_mode()  # (as NativeLM.greedy_chain: our kernels run inference only)
    def greedy_rounds(self, target: CausalLM, sequence: torch.Tensor, length: int, k: int, remaining: int,
                      context: int, stop_ids: Sequence[int], chunk: int,
                      ngram: tuple[int, int] | None = None) -> SpecRounds | None:
        """Greedy rounds of this draft's chains, verified by ``target``, in one C call
        (``NativeLM.spec_rounds``; ``ngram``: prompt lookup's tail sizes first, hybrid): the
        tokens, caches and counts the engine's rounds through :meth:`propose` and
        :meth:`verified` give, and the draft-stop policy's state. None where that call does
        not run (a tree or multi-draft, a stop policy that weighs costs, sampling, a draft our
        kernels do not run whole)."""
        spec_rounds, draft = getattr(target, "spec_rounds", None), self.model
        policy = rounds_state_of(self.stop)  # (fixed too: a state the C rounds read as fixed)
        if (spec_rounds is None or not self.params.greedy or type(self.shape) is not Shape or policy is None
                or not isinstance(draft, NativeLM) or draft.cache is None or draft.static is not None):
            return None
        chain = draft.model.chain_model(draft.cache, self.vocab_size, length + chunk + k + 1)
        if chain is None:
            return None
        out = spec_rounds(sequence, length, None, (0, 0, 0), None, k, k, ngram, remaining, context, chunk, stop_ids,
                          (chain, draft.length), policy)
        if out is not None:
            draft.length, draft.hidden_states = out.drafted, {}
            self._kv_rows, self._drafted = {}, 0
            self.stop.take_rounds_state(policy)
        return out

    def _proposal(self, nodes: list[Node], keep: list[int]) -> Proposal:
        if len(keep) < len(nodes):  # the kept nodes are renumbered: so are their cache rows
            new_index = {old: new for new, old in enumerate(keep)}
            self._kv_rows = {new_index[i]: s for i, s in self._kv_rows.items() if i in new_index}
        self._drafted = len(keep)
        return as_proposal(nodes, keep)

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        keep = []
        for node in path:  # the accepted nodes the draft has scored: a prefix of the path
            if node not in self._kv_rows:
                break
            keep.append(self._kv_rows[node])
        self.model.compact(length, keep)
        if self._drafted:
            self.stop.observe(self._drafted, len(path))
            self._drafted = 0

    def leave(self, slot: int) -> None:
        pass
