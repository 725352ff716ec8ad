"""``--method eagle``: an EAGLE-style feature drafter (:mod:`quickdraft.models.eagle`) grows
a token tree, by default EAGLE-2's dynamic tree (``--tree dynamic:N``: the best N nodes by
cumulative draft confidence); the engine verifies it in one pass with its exact tree rule.

Before the prefill (no features yet) a chain drafts from the prompt fed with zero
features, and the prefill pass verifies it, as a draft model's first proposal is. Each
step the drafter first feeds the tokens the target accepted since the last step,
each with the target's own feature of the token before it (handed over by the hidden-state
contract, :mod:`quickdraft.decoding.drafter`: no extra target pass), up to the step's new
token; its output there scores the tree's first level. Tree nodes are then fed level by
level with their parent's output as feature and the tree mask. Their keys are thrown away
after the proposal: the next step writes the accepted tokens again, with the target's
features, so the drafter's cache only ever holds what training's step 0 saw.

Dynamic and top-k children are deterministic (one-hot q); ``--tree`` static widths and a
chain sample from the drafter when sampling and hand the verifier those q: both exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..decoding.drafter import EMPTY, Proposal, check_single_slot
from ..decoding.sampling import SamplingParams
from ..models import cpu_kernels
from ..models.decode_linear import row_dependent_rounding, use_decode_linears
from ..models.eagle import FILES as EAGLE_FILES
from ..models.eagle import EagleConfig, EagleHead, load_eagle
from ..models.lm import HIDDEN_STATES_NEED_NATIVE, CausalLM, NativeLM
from ..models.quant_linear import quantize_drafter
from .draft_stop import DraftStop, rounds_state_of
from .shapes import Node, Shape, StaticTree, as_proposal, parse_tree
from .shipped import shipped_for

#: ``--tree`` for eagle when none is given: on a GPU EAGLE-2's dynamic tree (a verify pass
#: of 11 tokens costs about one of 1); on the CPU, where a wide verify costs several steps,
#: a chain drafted in one call (embedded target, one bench run: chain of 6 2.09x plain
#: decoding, dynamic tree of 8 0.90x), as long as the cost model finds pays (k up to
#: MAX_CPU_CHAIN, ``policy.head_choice.cached_eagle_k``: a chain of 1-2 beside SmolLM2's
#: int4 target, 8 beside the embedded one).
DEFAULT_TREE = "dynamic:10"
DEFAULT_DEPTH = 6
MAX_CPU_CHAIN = 8
DEFAULT_CPU_TREE = ",".join(["1"] * MAX_CPU_CHAIN)
#: Prompt tokens the drafter reads (the last ones): it was trained on windows of 512, and
#: its one layer over a 1,000-token prompt cost ~80 ms before the first draft on the CPU,
#: as much as 20 decode steps of the embedded target. Positions stay the true ones (its
#: cache slots are shifted), so RoPE sees the distances it was trained on. Measured on
#: the 21 long and out-of-domain bench prompts (chain of 8, 128 tokens): mean tau 5.41
#: against 5.29 reading the whole prompt, 1.05x the tokens/s (windows of 128 / 256: tau
#: 5.22 / 5.25).
PROMPT_WINDOW = 512


class EagleDrafter:
    """Proposes a token tree from an EAGLE drafter (batch 1, slot 0)."""

    def __init__(self, target: NativeLM, head: EagleHead, shape: Shape, k_by_cost_model: bool = False,
                 stop_policy: DraftStop | None = None) -> None:
        """``stop_policy``: a chain's ``--draft-stop`` policy, one that never ends a chain
        midway (fixed, heuristic) or ends it on the drafter's confidence alone (confidence,
        dv): its chain is one C call either way; None = fixed."""
        if not isinstance(target, NativeLM):
            raise ValueError(HIDDEN_STATES_NEED_NATIVE)
        if stop_policy is not None and stop_policy.name != "fixed":
            if not (isinstance(shape, StaticTree) and all(w == 1 for w in shape.widths)):
                raise ValueError(f"--draft-stop {stop_policy.name} sets a chain's length; --method eagle drafts a "
                                 "tree here (pass --tree 1,1,...,1 or leave --tree out)")
            if getattr(stop_policy, "stops_mid_chain", True) and getattr(stop_policy, "min_confidence", None) is None:
                raise ValueError(f"--draft-stop {stop_policy.name} weighs more than the drafter's confidence token by "
                                 "token; an EAGLE chain is drafted in one call: use heuristic, confidence:T or dv")
        self.target, self.head, self.shape = target.model, head, shape
        self.stop_policy = None if stop_policy is None or stop_policy.name == "fixed" else stop_policy
        self._drafted = 0  # tokens of the last chain, for the policy's observe()
        # The k generate uses when none is given: for the default CPU chain the cost model's
        # chain length (the generator's resolve_k asks it), else, and in the API until then,
        # the default depth (no cost model knows a tree's cost yet).
        self.k_by_cost_model = k_by_cost_model
        self.own_k = (DEFAULT_DEPTH, "eagle's default depth")
        self.reads_hidden = head.feature_layers  # the final state, or the layers it fuses
        self.name = f"eagle({shape.name.removeprefix('tree(').removesuffix(')')})"
        if self.stop_policy is not None:
            self.name += f"({self.stop_policy.name})"
        self.params, self.generator = SamplingParams(), torch.Generator()
        self.cache = None
        self.features: torch.Tensor | None = None  # the target's states it reads, by position
        self.known = 0  # positions whose target feature has been observed
        self.fed = 0  # positions whose tokens the drafter's cache holds (with target features)
        self.offset = 0  # the position in slot 0: the prompt tokens before it are not read
        self.prompt = torch.empty(0, dtype=torch.long)  # fed once the prefill has given its features
        self.greedy_chains = False  # whether this sequence drafts greedy chains (_greedy_chain), set by join
        self.call = None  # their C call (EagleHead.chain_call), where it runs

    def verify_width(self, k: int) -> int:
        return self.shape.width(k) + 1

    @torch.inference_mode()
    def join(self, slot: int, prompt: torch.Tensor, params: SamplingParams, generator: torch.Generator,
             max_len: int) -> None:
        check_single_slot(self, slot)
        self.params, self.generator = params, generator
        if self.cache is None or self.cache.max_len < max_len:
            weight = self.target.embed.weight
            # On the CPU in float32 the drafter keeps its keys and values in float16 (its
            # attention still in float32): each level reads the whole cache (~600 slots
            # after a long prompt, as many bytes as its int8 weights), and a drafter's
            # rounding never changes what the target accepts. Embedded target, long
            # prompts: EAGLE's decode 0.975x the time, tau the same.
            narrow = weight.device.type == "cpu" and weight.dtype == torch.float32
            self.cache = self.head.new_cache(max_len, torch.float16 if narrow else None)
            width = weight.shape[1] * len(self.reads_hidden)
            self.features = torch.zeros(max_len, width, dtype=weight.dtype, device=weight.device)
        self.known = self.fed = self.offset = 0
        self.prompt = prompt
        self.greedy_chains = self._greedy_chain()
        # (checked and set up once a sequence, not each round: ~30 us a round in the decode
        # loop; only where our kernels run: elsewhere, say on a GPU, nothing to set up)
        runs = self.greedy_chains and cpu_kernels.fused_layers(self.features)
        self.call = self.head.chain_call(self.target, self.cache) if runs else None

    @torch.inference_mode()
    def observe(self, slot: int, start: int, states: dict[int, torch.Tensor]) -> None:
        # Kept at the target's width: a narrow drafter maps them where it feeds them, in
        # the chain's C call (the map as PyTorch calls here cost ~0.1-0.3 ms a round).
        m, width = states[self.reads_hidden[0]].shape
        for i, layer in enumerate(self.reads_hidden):  # side by side, as training's TargetStates
            self.features[start : start + m, i * width : (i + 1) * width] = states[layer]
        self.known = start + m
        if self.fed == 0 and self.known >= self.prompt.numel():
            self._feed_prompt()

    @row_dependent_rounding()
    def _feed_prompt(self) -> None:
        """Feed the prompt's last :data:`PROMPT_WINDOW` tokens once the prefill has given
        their features: the drafter's own prefill, in the engine's prefill as a draft
        model's is (fed at the first proposal, it cost the first decode step 30-40 ms on
        the long bench prompts, ~15% of a 128-token decode)."""
        n = self.prompt.numel()
        self.fed = self.offset = max(0, n - PROMPT_WINDOW)
        features = self.head.from_target(self.features[max(self.fed - 1, 0) : n - 1])  # p: token p - 1's
        if self.fed == 0:
            features = torch.cat([features.new_zeros(1, features.shape[1]), features])
        self.head.extend(self.prompt[self.fed :], features, self.target, self.cache, self.fed, 0)
        self.fed = n

    def propose(self, slots: Sequence[int], sequences: Sequence[torch.Tensor], ks: Sequence[int]) -> list[Proposal]:
        (k,) = ks  # one sequence: slot 0 (join refused any other)
        sequence = sequences[0]
        if k == 0 or self.shape.depth(k) == 0:
            return [EMPTY]
        # Drafting needs the feature of every token but the last, which the prefill gives;
        # before it, a chain drafts blind and rides in the prefill pass. (A one-token
        # prompt needs no feature but is not fed before the prefill either: `fed` says so.)
        if self.fed == 0 or self.known < sequence.shape[0] - 1:
            return [self._draft_blind(sequence, k) if self.fed == 0 and self.greedy_chains else EMPTY]
        return [self._draft(sequence, k)]

    @torch.inference_mode()
    @row_dependent_rounding()
    def _draft_blind(self, sequence: torch.Tensor, k: int) -> Proposal:
        """The first round's chain, before the target has seen the prompt: the prompt fed
        with zero features (the feature of the first token's predecessor in training). A
        draft model proposes there too, verified by the prefill pass; without this an EAGLE
        drafter's first pass yielded one token, against the draft's 4-6 (embedded target,
        chains of 8: the shipped drafter's first pass now 3.8 / 2.8 / 4.1 tokens, short /
        long / out-of-domain; docs/heads/README.md, session 28). Its keys sit in the slots
        the prompt's feed (``_feed_prompt``, after the prefill) writes again with the
        target's features, so ``fed`` stays 0 and nothing of it outlives the round."""
        n = sequence.shape[0]
        offset = max(0, n - PROMPT_WINDOW)
        zeros = self.features.new_zeros(n - offset, self.head.feature_size)
        depth = self._depth(k)
        tokens = self.head.greedy_chain(sequence[offset:], zeros, depth, n, self.cache, self.target, n - offset,
                                        min_confidence=self._floor(), call=self.call)
        if tokens is None:
            out = self.head.extend(sequence[offset:], zeros, self.target, self.cache, offset, 0)
            return self._chain(out[-1], n, n - offset, depth)
        return self._chain_proposal(tokens)

    @torch.inference_mode()
    def _draft(self, sequence: torch.Tensor, k: int) -> Proposal:
        n = sequence.shape[0]
        states = self.features[self.fed - 1 : n - 1]  # position p: the target's state at p - 1 (fed >= 1)
        base = n - self.offset  # the slot of position n
        fed, self.fed = self.fed, n
        if self.greedy_chains:  # map, feed and chain in one C call where our kernels run
            tokens = self.head.greedy_chain(sequence[fed:n], states, self._depth(k), n, self.cache, self.target,
                                            base, raw=True, min_confidence=self._floor(), call=self.call)
            if tokens is not None:
                return self._chain_proposal(tokens)
        return self._draft_stepwise(sequence, k, states, fed, base)

    @row_dependent_rounding()  # the target decides what is accepted: the fastest kernels
    def _draft_stepwise(self, sequence: torch.Tensor, k: int, states: torch.Tensor, fed: int, base: int) -> Proposal:
        """A round level by level in Python: the tree, or the chain where its C call cannot
        run. ``states``: the target's states of the tokens to feed from ``fed``; ``base``:
        the cache slot of the sequence's next position."""
        n = sequence.shape[0]
        chain = self.greedy_chains
        out = self.head.extend(sequence[fed:n], self.head.from_target(states), self.target, self.cache, fed,
                               fed - self.offset)
        if chain:
            return self._chain(out[-1], n, base, self._depth(k))
        nodes: list[Node] = []
        outputs = {-1: out[-1]}  # node -> the drafter's output there (its children's feature)
        slot_of: dict[int, int] = {}  # node -> its cache slot after the sequence
        frontier, logits = [-1], self.head.logits(out[-1:], self.target)
        depth_limit = self._depth(k)
        for depth in range(depth_limit):
            new = self.shape.grow(depth, nodes, frontier, logits, self.params, self.generator)
            if depth + 1 == depth_limit:
                break
            frontier = self.shape.frontier(depth, nodes, new, self.shape.width(k) - len(slot_of))
            if not frontier:
                break
            for i in frontier:
                slot_of[i] = len(slot_of)
            mask = torch.zeros(len(frontier), base + len(slot_of), dtype=torch.bool)
            mask[:, :base] = True
            for row, i in enumerate(frontier):
                node = i
                while node >= 0:  # itself and its ancestors, all fed at earlier levels
                    mask[row, base + slot_of[node]] = True
                    node = nodes[node].parent
            tokens = torch.tensor([nodes[i].token for i in frontier])
            parent_out = torch.stack([outputs[nodes[i].parent] for i in frontier])
            slots = torch.tensor([base + slot_of[i] for i in frontier])
            h = self.head.extend(tokens, parent_out, self.target, self.cache, torch.full_like(slots, n + depth),
                                 slots, mask[None])
            outputs.update(zip(frontier, h))
            logits = self.head.logits(h, self.target)
        proposal = as_proposal(nodes, self.shape.finish(nodes, k))
        self._drafted = proposal.tokens.numel()
        return proposal

    def greedy_rounds(self, target: CausalLM, sequence: torch.Tensor, length: int, k: int, remaining: int,
                      context: int, stop_ids: Sequence[int], chunk: int,
                      ngram: tuple[int, int] | None = None) -> cpu_kernels.SpecRounds | None:
        """Greedy rounds of this chain, verified by ``target``, in one C call
        (``NativeLM.spec_rounds``; ``ngram``: prompt lookup's tail sizes first, hybrid-eagle),
        until ``chunk`` tokens are settled or ``remaining`` / ``context`` / a stop id ends
        them: the tokens, caches and positions the engine's rounds through :meth:`propose`,
        :meth:`verified` and :meth:`observe` give, and the stop policy's state. None where
        that call does not run (a tree, a stop policy that weighs costs, sampling, before the
        prefill, a drafter without its C chain, or one that fuses layers without the final one)."""
        spec_rounds = getattr(target, "spec_rounds", None)
        policy = None if self.stop_policy is None else rounds_state_of(self.stop_policy)
        *taps, last = self.reads_hidden
        if (spec_rounds is None or not self.greedy_chains or (self.stop_policy is not None and policy is None)
                or self.call is None or last != self.target.config.n_layers or self.fed < 1
                or self.known < length - 1 or self.head.maps_features != self.call.maps or not self.params.greedy):
            return None
        widths = self.shape.widths  # a chain (greedy_chains)
        out = spec_rounds(sequence, length, self.call, (self.fed, self.known, self.offset),
                          self.features, k, len(widths), ngram, remaining, context, chunk, stop_ids, policy=policy,
                          taps=taps)
        if out is not None:
            self.fed, self.known, self._drafted = out.fed, out.known, 0
            if policy is not None:
                self.stop_policy.take_rounds_state(policy)
        return out

    def _depth(self, k: int) -> int:
        """How deep this round drafts: the shape's depth for k, or less where the stop
        policy says so."""
        depth = self.shape.depth(k)
        return depth if self.stop_policy is None else self.stop_policy.max_depth(depth)

    def _floor(self) -> float:
        """The confidence below which this round's chain ends (0: none)."""
        return getattr(self.stop_policy, "min_confidence", None) or 0.0

    def _greedy_chain(self) -> bool:
        """A chain of argmax tokens: each level one node, fed causally after the last."""
        shape = self.shape
        return (isinstance(shape, StaticTree) and all(w == 1 for w in shape.widths)
                and (self.params.greedy or not shape.sample))

    def _chain(self, out: torch.Tensor, n: int, base: int, depth: int) -> Proposal:
        """The tree loop's chain without its tree: node ``d`` at position ``n + d`` and slot
        ``base + d`` sees the cache and the nodes before it, which is what causal attention
        gives (no mask to build), and its token is the argmax over the draft vocabulary (no
        full-vocabulary scores to fill); it ends early after a token below the confidence
        floor. ``EagleHead.greedy_chain`` is the same in one C call."""
        tokens, h, floor = [], out[None], self._floor()
        for d in range(depth):
            token, confidence = self.head.best_token(h, self.target)
            tokens.append(token)
            if d + 1 == depth or confidence < floor:
                break
            h = self.head.extend(torch.tensor(tokens[-1:]), h, self.target, self.cache, n + d, base + d)
        return self._chain_proposal(tokens)

    def _chain_proposal(self, tokens: list[int]) -> Proposal:
        self._drafted = len(tokens)
        return Proposal.chain(torch.tensor(tokens))

    def verified(self, slot: int, length: int, path: list[int]) -> None:
        # (The tree's keys are overwritten next step by the accepted tokens, with the target's features.)
        if self.stop_policy is not None and self._drafted:
            self.stop_policy.observe(self._drafted, len(path))
        self._drafted = 0

    def leave(self, slot: int) -> None:
        self.known = self.fed = self.offset = 0


def eagle_shape(tree: str | None, tree_children: str = "sample", device: torch.device | None = None) -> Shape:
    """The shape ``--tree`` gives eagle: ``dynamic:N`` or static widths (``1,1,1,1`` is a
    chain), whose children are sampled from the drafter when sampling unless
    ``tree_children`` is ``top``. None: :data:`DEFAULT_TREE` on a GPU, else
    :data:`DEFAULT_CPU_TREE`."""
    default = DEFAULT_TREE if device is not None and device.type == "cuda" else DEFAULT_CPU_TREE
    shape = parse_tree(tree or default)
    if isinstance(shape, StaticTree) and tree_children == "top":
        return StaticTree(shape.widths, sample=False)
    return shape


def shipped_eagle(target: CausalLM) -> Path | None:
    """The EAGLE drafter packaged for this target, if any."""
    return next(iter(shipped_for(target, EAGLE_FILES, EagleConfig)), None)


def load_eagle_head(target: CausalLM | None, head: str | EagleHead | None,
                    draft_vocab: int | None = None) -> EagleHead:
    """``head`` as a loaded drafter for ``target``: loaded already (as it is), from a
    directory, or (None) the one shipped for the target; a one-line error when there is
    none. ``draft_vocab``: how many of its most frequent tokens it scores (``load_eagle``)."""
    if not isinstance(target, NativeLM):
        raise ValueError(HIDDEN_STATES_NEED_NATIVE)
    if isinstance(head, EagleHead):
        return head
    path = head or shipped_eagle(target)
    if path is None:
        raise ValueError("--method eagle (and hybrid-eagle) needs an EAGLE drafter for this target: pass --heads DIR "
                         "(train one with `quickdraft train heads --kind eagle --target ...`)")
    head = load_eagle(path, target.model, draft_vocab)
    # int8 wherever our kernels run (int4 beside an int4 target): a level reads the layer,
    # fc and the reduced head (the embedded target's: 15 MB in float32, as much as 1.5 of
    # its 8 layers); measured beside the float32 embedded target 1.14x / 1.16x the tokens/s
    # of a chain of 5 / dynamic tree of 8 (tau 4.46 -> 4.40 / unchanged), and beside
    # SmolLM2's int4 layers likewise. Its rounding never changes what the target accepts.
    if head.embed_scale.dtype == torch.float32:
        quantize_drafter(head, beside=target.model)
    if target.decode_linears:  # the target's CPU decode kernels serve the drafter's few-row steps too
        use_decode_linears(head)
    return head
