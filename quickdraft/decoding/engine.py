"""The one decode loop. Drafters propose, acceptance rules verify, the target scores.

Plain decoding is this loop with a drafter that proposes nothing; every speculative
method plugs in a drafter and/or an acceptance rule instead of writing its own loop.
A proposal is a token tree (a chain is one): the target scores it in one pass, the rule
keeps one path, and the KV rows of that path are compacted into place.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..models.lm import CausalLM
from .drafter import Drafter, NoDrafter
from .proposal import EMPTY, Proposal, tree_attention
from .sampling import SamplingParams
from .stats import GenerationStats
from .step import accepted_states, check_prompt, draft_budget, emit
from .stopping import StopConditions, check_count
from .verify import AcceptanceRule, acceptance_for

#: The drafter slot of the one sequence: the batch-1 loop is a batch of one.
SLOT = 0
#: Tokens plain greedy decoding settles a call where the target runs greedy chains in one
#: C call (``NativeLM.greedy_chain``: each token the argmax of its own one-token pass, bit
#: for bit, ending at EOS): the loop's Python between steps, ~0.3 ms of a SmolLM2 step,
#: paid once for 8. It bounds how far a stop string can be overrun (tokens computed, never
#: emitted) and how often a stream hears of new text.
PLAIN_CHAIN = 8
#: Tokens a chain drafter's greedy rounds settle a call where they run in one C call
#: (``drafter.greedy_rounds``: EAGLE, draft-model and prompt-lookup chains and their
#: hybrids beside a native target, each round the tokens and caches this loop's round
#: gives): the Python between a round's calls, ~0.7 ms of a ~6 ms SmolLM2 round, paid once
#: for several. As PLAIN_CHAIN, it bounds how far a stop string can be overrun (tokens
#: computed, never emitted).
SPEC_CHUNK = 16


@dataclass
class Step:
    """Tokens emitted by one step. The first ``drafted`` of them were proposed by the drafter
    and accepted; the rest (at most one) is the target's own token. ``finish`` is set on the
    generation's last step ("stop" or "length"), so a caller stepping several generations
    knows a row is done without asking for another step."""

    tokens: list[int]
    drafted: int
    finish: str | None = None


def decode(
    target: CausalLM,
    prompt: torch.Tensor,
    stop: StopConditions,
    drafter: Drafter | None = None,
    params: SamplingParams = SamplingParams(),
    num_speculative_tokens: int = 4,
    acceptance: AcceptanceRule | str | None = None,
    stats: GenerationStats | None = None,
) -> Iterator[Step]:
    """Generate after ``prompt`` (``[T]`` token ids), yielding each step's tokens.

    ``num_speculative_tokens`` bounds the depth of each proposal (the drafter decides its
    shape; 0 decodes plainly, without the drafter: the k chosen when a draft is predicted to
    lose); ``acceptance`` is a rule, or the name of the lossless sampling rule ("mss",
    "spectr"). ``stats`` (if given) is filled in as generation proceeds; it is complete
    when the iterator is exhausted.
    """
    check_count(num_speculative_tokens, "num_speculative_tokens", 0)
    prompt = check_prompt(prompt, target.context_length, target.vocab_size)
    if drafter is None or num_speculative_tokens == 0:
        drafter, num_speculative_tokens = NoDrafter(), 1
    chains = isinstance(drafter, NoDrafter) and params.greedy and not callable(acceptance)
    rounds = getattr(drafter, "greedy_rounds", None) if params.greedy and not callable(acceptance) else None
    stats = stats if stats is not None else GenerationStats()
    generator = params.generator()
    if not callable(acceptance):
        acceptance = acceptance_for(params, generator, acceptance or "mss")
    reads = tuple(getattr(drafter, "reads_hidden", ()))  # a drafter that reads the target's states
    width = drafter.verify_width(num_speculative_tokens)
    max_len = min(target.context_length, prompt.numel() + stop.max_new_tokens) + width
    stats.prompt_tokens = prompt.numel()

    started = time.perf_counter()
    target.reset(max_len)
    drafter.join(SLOT, prompt, params, generator, max_len)
    try:
        # The sequence buffer holds prompt + emitted tokens; the target's cache holds a prefix
        # of it (none at first, then all but the last token). Each pass feeds the target what
        # its cache lacks plus the draft, so the first pass is the prefill and also verifies a
        # draft proposed from the prompt alone (as transformers' assisted generation does):
        # one target pass fewer per generation.
        sequence = torch.empty(max_len + 1, dtype=torch.long)
        sequence[: prompt.numel()] = prompt
        length = prompt.numel()
        decode_started = None
        while True:
            if chains and decode_started is not None:
                settled = _plain_chain(target, sequence, length, stop)
                if settled is not None:
                    emitted, finish = emit(settled, 0, 0, stop, sequence, length, target.context_length, stats,
                                           passes=len(settled))
                    length += len(emitted)
                    if emitted:
                        yield Step(emitted, 0, finish)
                    if finish:
                        break
                    continue
            if rounds is not None and decode_started is not None:
                done = rounds(target, sequence, length, num_speculative_tokens, stop.max_new_tokens - stop.count,
                              target.context_length, sorted(stop.eos), SPEC_CHUNK)
                if done is None:  # it cannot run them here: round by round, without asking again
                    rounds = None
                else:
                    finish = None
                    for drafted, accepted, count in done.rounds:
                        emitted, finish = emit(sequence[length : length + count].tolist(), drafted, accepted, stop,
                                               sequence, length, target.context_length, stats)
                        length += len(emitted)
                        if emitted:
                            yield Step(emitted, min(accepted, len(emitted)), finish)
                        if finish:
                            break
                    if finish:
                        break
                    if done.rounds and not done.refused:
                        continue  # (else this round in Python: the call could not run it)
            k = draft_budget(num_speculative_tokens, stop, length, target.context_length)
            proposal = drafter.propose([SLOT], [sequence[:length]], [k])[0] if k > 0 else EMPTY
            seen = target.length
            target_logits = _verify_pass(target, sequence, length, proposal, reads)
            verdict = acceptance(proposal, target_logits)
            path = verdict.path
            # Keep what the target has now seen and accepted (the accepted nodes' KV moved into
            # place after the prefix); drop the rest, in the drafter's cache too.
            target.compact(length, path)
            drafter.verified(SLOT, length, path)
            if reads:
                drafter.observe(SLOT, seen, accepted_states(target.hidden_states, length - seen, path))
            if decode_started is None:
                decode_started = time.perf_counter()
                stats.prefill_seconds = stats.time_to_first_token = decode_started - started
            accepted = proposal.tokens[: len(path)] if proposal.is_chain else proposal.tokens[path]
            settled = (accepted.tolist() if path else []) + [verdict.next_token]
            emitted, finish = emit(settled, proposal.depth, len(path), stop, sequence, length,
                                   target.context_length, stats)
            length += len(emitted)
            if emitted:
                yield Step(emitted, min(len(path), len(emitted)), finish)
            if finish:
                break

        stats.decode_seconds = time.perf_counter() - (decode_started or started)
    finally:
        drafter.leave(SLOT)  # also when the caller stops early


def _plain_chain(target: CausalLM, sequence: torch.Tensor, length: int, stop: StopConditions) -> list[int] | None:
    """Up to :data:`PLAIN_CHAIN` greedy tokens after ``sequence[:length]`` in one call of
    the target's greedy chain (what its cache lacks fed first, then a token at a time; it
    ends at EOS), never past the token budget or the context; None where the target has no
    such call (nothing fed)."""
    n = min(PLAIN_CHAIN, stop.max_new_tokens - stop.count, target.context_length - length)
    chain = getattr(target, "greedy_chain", None)
    if n < 2 or chain is None:
        return None
    return chain(None, n - 1, target.vocab_size, feed=sequence[target.length : length], stop_ids=sorted(stop.eos))


def _verify_pass(target: CausalLM, sequence: torch.Tensor, length: int, proposal: Proposal,
                 reads: tuple[int, ...] = ()) -> torch.Tensor:
    """One target pass over what its cache lacks plus the proposal: logits ``[n + 1, V]``
    (and the hidden states ``reads`` of everything fed, in ``target.hidden_states``)."""
    n = proposal.size
    fed = torch.cat([sequence[target.length : length], proposal.tokens]) if n else sequence[target.length : length]
    # Early exit with a shared cache: only the layers from ``start_layer`` run, resuming
    # from the drafter's hidden states of everything fed.
    extra = {} if proposal.hidden is None else {"hidden": proposal.hidden, "start_layer": proposal.start_layer}
    if reads:
        extra["output_hidden_states"] = reads
    if proposal.is_chain:
        return target.extend(fed, logits=n + 1, **extra)
    positions, mask = tree_attention(proposal, target.length, length)
    return target.extend(fed, logits=n + 1, positions=positions, mask=mask, **extra)
