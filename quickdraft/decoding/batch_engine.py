"""The batched decode loop: many rows, each at its own pace, verified in one target pass.

Each step every active row proposes a chain (its own k), the target scores all rows in
ONE forward pass, and each row keeps its own number of accepted tokens. Rows are ragged:
own prompt length, positions, KV-cache row and sampling settings (its own generator).
Rows join (``add``) and leave (finish or ``cancel``) between steps; a freed cache row is
reused by the next row (continuous batching), so no row waits for the slowest.

It is ``engine.decode``'s loop for a batch (the same acceptance rules, sampling, stop
conditions and stats, per row): the first pass of a row is its prefill, which also
verifies a chain drafted from the prompt. Rows joining in the same step share a prefill
pass of their own (merged with the decode pass, a long prompt would pad every other row
to its length); every later step of every row shares one pass. With ``prefill_chunk``
the joining rows' prompts are prefilled a chunk a step instead (the rows already decoding
step in between), and a row's first pass feeds only the rest of its prompt. Batch
invariance: see ``models/ragged.py`` and docs/batching.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..models.lm import NativeLM
from ..models.ragged import Feed, ragged_forward, ragged_forward_keeping
from .drafter import Drafter, NoDrafter
from .proposal import EMPTY, Proposal
from .sampling import SamplingError, SamplingParams, argmax_ids, host_probabilities_rows
from .stats import GenerationStats, RecentAcceptance
from .step import accepted_states, check_prompt, draft_budget, emit
from .stopping import StopConditions, check_count
from .verify import AcceptanceRule, GreedyAcceptance, SpeculativeSampling, acceptance_for

#: Most draft tokens per step the policy considers.
MAX_BATCH_K = 8


def cache_length(target: NativeLM, max_len: int | None = None) -> int:
    """KV-cache rows a batched engine (and its drafter) keeps per row: slots past a row's
    end hold its chain (and the calibration's widest pass)."""
    return min(target.context_length, max_len or target.context_length) + 2 * MAX_BATCH_K + 16


class BatchFullError(RuntimeError):
    """Every row of the batch is taken; wait for one to finish (or cancel one)."""


@dataclass
class RowUpdate:
    """What one step did for one row: ``tokens`` emitted (may be empty), of which the first
    ``drafted`` were drafted and accepted (the rest: the target's own token); ``finish`` is
    "stop" (EOS or a stop string), "length" (token budget or context), "error" (``error``
    says why: this row alone failed, e.g. its distribution was NaN) or None while running;
    ``stats`` are the row's running stats; ``error_code`` what kind of failure: a sampling
    error (the row's numbers) or "server_error" (a bug that hit this row only)."""

    tokens: list[int]
    drafted: int
    finish: str | None
    stats: GenerationStats
    error: str | None = None
    error_code: str = "sampling_error"


@dataclass
class _Row:
    id: int
    slot: int
    sequence: torch.Tensor  # prompt + emitted tokens (the first ``length``)
    length: int
    params: SamplingParams
    generator: torch.Generator
    rule: AcceptanceRule
    stop: StopConditions
    stats: GenerationStats
    added: float
    cached: int = 0  # tokens in the target's cache row
    first_token: float | None = None
    proposal: Proposal = field(default_factory=lambda: EMPTY)
    states: dict[int, torch.Tensor] = field(default_factory=dict)  # this pass's, for a drafter that reads them
    draft_stop: object | None = None  # the row's own chain-length policy (``max_depth``, ``observe``), if any


class BatchEngine:
    """Batched speculative decoding over a native target: ``drafter`` proposes a chain per
    row, in the row's slot (a :class:`~quickdraft.decoding.drafter.Drafter` that serves
    ``max_batch_size`` slots; None: plain decoding).
    :func:`quickdraft.batch_generate.make_batch_engine` builds one by method name, with the
    method's batched drafter and the measured batch policy.

    ``num_speculative_tokens``: k for every batch size, or None for ``policy`` (an object
    with ``k(rows, acceptance, context)``, e.g. :class:`~quickdraft.policy.batch_policy.BatchPolicy`:
    the cost model's k for the current number of rows, 0 = plain decoding when speculation
    would not pay; a policy with ``observe(rows, k, tokens, seconds)`` is told each step's
    outcome, as :class:`~quickdraft.policy.batch_policy.PlainWhenFaster` needs); None for
    both is plain decoding. ``max_len`` bounds prompt + generated
    tokens of a row (default: the context); a drafter with a KV cache of its own needs
    :func:`cache_length` rows of it. ``acceptance(params, generator)`` makes a row's
    acceptance rule (default: the lossless one, ``verify.acceptance_for``).

    Not thread-safe: call ``add``, ``cancel`` and ``step`` from one thread (a server runs
    them in its step loop, between steps).

    ``prefill_chunk``: at most this many prompt tokens are prefilled per step, all joining
    rows together, oldest row first (a long prompt's prefill spread over several steps,
    the other rows decoding in between; its output is the same, bit for bit); None: each
    joining row's whole prompt in its first step.

    ``draft_stop``: makes each row's own chain-length policy (``--draft-stop heuristic``:
    ``max_depth(k)`` at each step, ``observe(drafted, accepted)`` after it), so a row's chain
    follows its own acceptance, up to the step's k; None: every row drafts k.
    """

    def __init__(
        self,
        target: NativeLM,
        drafter: Drafter | None = None,
        *,
        max_batch_size: int = 8,
        max_len: int | None = None,
        num_speculative_tokens: int | None = None,
        policy=None,
        acceptance: Callable[[SamplingParams, torch.Generator], AcceptanceRule] = acceptance_for,
        draft_stop: Callable[[], object] | None = None,
        prefill_chunk: int | None = None,
    ) -> None:
        if not isinstance(target, NativeLM):
            raise ValueError("batched decoding needs the native runtime for the target (--backend native)")
        check_count(max_batch_size, "max_batch_size", 1)
        if num_speculative_tokens is not None:
            check_count(num_speculative_tokens, "num_speculative_tokens", 0)
        if prefill_chunk is not None:
            check_count(prefill_chunk, "prefill_chunk", 1)  # (None: whole prompts)
        self.target = target
        self.model = target.model
        self.max_batch_size = max_batch_size
        self.context = min(target.context_length, max_len or target.context_length)
        self.cache = self.model.new_cache(max_batch_size, cache_length(target, max_len))
        self.drafter = drafter or NoDrafter()
        self.method = self.drafter.name
        self.reads = tuple(getattr(self.drafter, "reads_hidden", ()))  # the target's states the drafter reads
        self.num_speculative_tokens = num_speculative_tokens
        self.policy = policy
        self.acceptance = acceptance
        self.draft_stop = draft_stop
        # Prompt tokens prefilled per step, all joining rows together (None: whole prompts). A
        # drafter that reads the target's prefill (its states, or its cache: early exit)
        # takes it whole, in one pass.
        chunkable = not self.reads and getattr(self.drafter, "adopts_layer", None) is None
        self.prefill_chunk = prefill_chunk if chunkable else None
        self.pooled = RecentAcceptance()  # acceptance of recent proposals, for the policy
        self.prefill_seconds = 0.0  # time in the joining rows' prefill passes (target and drafter), all rows
        self.last_k: int | None = None  # draft tokens per row at the last step (None before the first)
        self._rows: dict[int, _Row] = {}
        self._free = list(range(max_batch_size))
        self._next_id = 0

    @property
    def active(self) -> int:
        """Rows decoding now."""
        return len(self._rows)

    @property
    def free_slots(self) -> int:
        """Rows that can still be added."""
        return len(self._free)

    @property
    def kv_cache_bytes(self) -> int:
        """The target's KV cache held by the rows in use (allocated once for every row: a
        free row's share is free); what the server reports, so a leaked row shows."""
        return (self.cache.k.nbytes + self.cache.v.nbytes) // self.max_batch_size * len(self._rows)

    def add(self, prompt: torch.Tensor, params: SamplingParams = SamplingParams(),
            stop: StopConditions | None = None) -> int:
        """Start a row after ``prompt`` (``[T]`` ids); returns its id. Its prefill runs in the
        next ``step``. Raises ContextOverflowError for a prompt that leaves no room in the
        context, BatchFullError when no row is free."""
        prompt = check_prompt(prompt, self.context, self.target.vocab_size)
        if not self._free:
            raise BatchFullError(f"all {self.max_batch_size} rows of the batch are taken")
        stop = stop or StopConditions(self.context - prompt.numel(), self.target.eos_token_ids)
        slot = self._free[0]
        generator = params.generator()
        sequence = torch.zeros(self.context + 1, dtype=torch.long)
        sequence[: prompt.numel()] = prompt
        stats = GenerationStats(prompt_tokens=prompt.numel())
        row = _Row(self._next_id, slot, sequence, prompt.numel(), params, generator,
                   self.acceptance(params, generator), stop, stats, time.perf_counter(),
                   draft_stop=None if self.draft_stop is None else self.draft_stop())
        started = time.perf_counter()
        # The row's tokens + a chain stay within its budget (``draft_budget``). Its prefill
        # waits for its first proposal. A drafter that serves fewer slots refuses this one
        # here, before the row takes it.
        self.drafter.join(slot, prompt, params, generator, min(self.context, prompt.numel() + stop.max_new_tokens))
        self.prefill_seconds += time.perf_counter() - started
        self._free.pop(0)
        self._next_id += 1
        self._rows[row.id] = row
        return row.id

    def cancel(self, row: int) -> None:
        """Drop a row now and free its cache row (unknown or finished ids are ignored)."""
        r = self._rows.pop(row, None)
        if r is not None:
            self.drafter.leave(r.slot)
            self._free.append(r.slot)
            self._free.sort()

    def k_for(self, rows: int, context: int | None = None) -> int:
        """Draft tokens per row this step, for ``rows`` rows of ``context`` tokens on
        average (0: plain decoding)."""
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        if self.policy is None:
            return 0
        return self.policy.k(rows, self.pooled, context)

    def step(self) -> dict[int, RowUpdate]:
        """One step for every active row; rows whose update has a finish are gone after it.
        A row whose prompt is still being prefilled in chunks (``prefill_chunk``) gets its
        next chunk, or waits, and no update."""
        rows, chunks = self._prefill_plan(list(self._rows.values()))
        if chunks:
            started = time.perf_counter()
            ragged_forward(self.model, self.cache, [Feed(r.slot, r.cached, r.sequence[r.cached : r.cached + n], 0)
                                                    for r, n in chunks])
            for r, n in chunks:
                r.cached += n
            self.prefill_seconds += time.perf_counter() - started
        if not rows:
            return {}
        # A policy that learns from the steps' speed hears of each step without a row's prefill.
        observe = getattr(self.policy, "observe", None) if self.num_speculative_tokens is None else None
        observe = observe if observe is not None and all(r.stats.target_forward_passes for r in rows) else None
        started = time.perf_counter()
        k = self.k_for(len(rows), sum(r.length for r in rows) // len(rows))
        self.last_k = k
        if k == 0 and self.num_speculative_tokens is None:
            self.pooled.record_plain_step()
        ks = [draft_budget(k, r.stop, r.length, self.context) for r in rows]
        for i, r in enumerate(rows):
            if r.draft_stop is not None and ks[i] > 0:
                ks[i] = r.draft_stop.max_depth(ks[i])
        # A joining row about to draft, with a drafter that can read the target's prefill
        # (early exit: the stream entering its exit layer), drafts nothing this step and
        # takes its prefill from the target's pass instead of running the first layers
        # over the prompt a second time (for a 1000-token prompt and a one-layer exit that
        # halves what the drafter spends on it).
        adopting = set()
        if getattr(self.drafter, "adopts_layer", None) is not None:
            for i, r in enumerate(rows):
                if ks[i] > 0 and not r.stats.target_forward_passes:
                    ks[i] = 0
                    adopting.add(r.slot)
        proposals = self.drafter.propose([r.slot for r in rows], [r.sequence[: r.length] for r in rows], ks)
        for r, p in zip(rows, proposals):
            # Rows verify chains in their own cache rows: a token tree, or hidden states the
            # drafter left in a shared cache (early exit at batch 1), has no place here.
            if not p.is_chain or p.hidden is not None:
                raise ValueError(f"the {self.method} drafter proposed a token tree or a shared-cache draft; "
                                 "the batched engine verifies plain chains (trees are batch 1)")
            r.proposal = p
        logits = self._verify(rows, adopting)
        rules = [r.rule for r in rows]
        choices, probs = greedy_choices(rules, logits), sampled_probabilities(rules, logits)
        updates = {}
        now = time.perf_counter()
        for i, (r, row_logits) in enumerate(zip(rows, logits)):
            try:
                updates[r.id] = self._advance(r, row_logits, now, choices.get(i), probs.get(i))
            except SamplingError as exc:  # this row's numbers, not the batch's: it fails alone
                updates[r.id] = RowUpdate([], 0, "error", r.stats, error=str(exc))
        if observe is not None:
            observe(len(rows), k, sum(len(u.tokens) for u in updates.values()), time.perf_counter() - started)
        for row_id, update in updates.items():
            if update.finish:
                self.cancel(row_id)
        return updates

    def _prefill_plan(self, rows: list[_Row]) -> tuple[list[_Row], list[tuple[_Row, int]]]:
        """The rows that step now (decoding, or joining with the rest of their prompt) and
        the chunks of prompt (row, tokens) prefilled before them, within ``prefill_chunk``
        tokens, oldest joining row first; a joining row beyond the budget waits."""
        if self.prefill_chunk is None:
            return rows, []
        budget, stepping, chunks = self.prefill_chunk, [], []
        for r in rows:  # in order of arrival
            if r.stats.target_forward_passes:  # decoding
                stepping.append(r)
                continue
            rest = r.length - r.cached  # prompt tokens its first pass would feed
            if rest <= budget:  # joins now, with the rest of its prompt
                budget -= rest
                stepping.append(r)
            elif budget > 0:  # a chunk now, the rest later
                chunks.append((r, budget))
                budget = 0
        return stepping, chunks

    def _verify(self, rows: list[_Row], adopting: set[int] = frozenset()) -> list[torch.Tensor]:
        """The target's logits per row (``[proposal + 1, V]``): the rows joining now share
        one prefill pass, the others one decode pass (a row's arithmetic is its own either
        way: ``models/ragged.py``). The drafter adopts the prefill of the rows in
        ``adopting`` (slots) from the joining rows' pass."""
        feeds = []
        for r in rows:
            fed = torch.cat([r.sequence[r.cached : r.length], r.proposal.tokens])
            feeds.append(Feed(r.slot, r.cached, fed, r.proposal.size + 1))
        out: list[torch.Tensor | None] = [None] * len(rows)
        joining = [i for i, r in enumerate(rows) if not r.stats.target_forward_passes]
        ongoing = [i for i, r in enumerate(rows) if r.stats.target_forward_passes]
        for group in (joining, ongoing):
            if not group:
                continue
            started = time.perf_counter()
            group_feeds = [feeds[i] for i in group]
            adopt = group is joining and any(rows[i].slot in adopting for i in group)
            keep = set(self.reads) | ({self.drafter.adopts_layer} if adopt else set())
            if keep:
                group_logits, kept = ragged_forward_keeping(self.model, self.cache, group_feeds, sorted(keep))
            else:
                group_logits, kept = ragged_forward(self.model, self.cache, group_feeds), [{}] * len(group)
            for i, row_logits, states in zip(group, group_logits, kept):
                out[i] = row_logits
                rows[i].states = states
            if group is joining:
                self.prefill_seconds += time.perf_counter() - started  # the drafter's share is not prefill
            if adopt:
                for i, states in zip(group, kept):
                    if rows[i].slot in adopting:
                        self.drafter.adopt(rows[i].slot, states[self.drafter.adopts_layer], self.cache)
        return out

    def _advance(self, r: _Row, logits: torch.Tensor, now: float, choice: list[int] | None = None,
                 probs: torch.Tensor | None = None) -> RowUpdate:
        """``choice`` / ``probs``: the row's greedy argmaxes / sampling distributions, read
        with every other row's (:func:`greedy_choices`, :func:`sampled_probabilities`)."""
        if choice is not None:
            verdict = r.rule.follow(r.proposal, choice)
        elif probs is not None:
            verdict = r.rule.decide(r.proposal, probs)
        else:
            verdict = r.rule(r.proposal, logits)
        accepted = len(verdict.path)
        first = r.stats.target_forward_passes == 0
        self.pooled.record_step(r.proposal.size, accepted)  # what the policy learns from: every accepted draft
        self.drafter.verified(r.slot, r.length, verdict.path)
        if r.draft_stop is not None and r.proposal.size:
            r.draft_stop.observe(r.proposal.size, accepted)
        if self.reads:
            self.drafter.observe(r.slot, r.cached, accepted_states(r.states, r.length - r.cached, verdict.path))
        r.states = {}
        r.cached = r.length + accepted  # the chain's accepted tokens stay in place
        emitted, finish = emit(r.proposal.tokens[:accepted].tolist() + [verdict.next_token], r.proposal.size,
                               accepted, r.stop, r.sequence, r.length, self.context, r.stats)
        r.length += len(emitted)
        if first:
            r.first_token = now
            r.stats.prefill_seconds = r.stats.time_to_first_token = now - r.added
        else:
            r.stats.decode_seconds = now - r.first_token
        return RowUpdate(emitted, min(accepted, len(emitted)), finish, r.stats)


def greedy_choices(rules: Sequence[AcceptanceRule], logits: Sequence[torch.Tensor]) -> dict[int, list[int]]:
    """The target's argmax for every greedy row (by index), read from the device at once: on
    a GPU one synchronisation for the batch instead of one per row."""
    greedy = [i for i, rule in enumerate(rules) if isinstance(rule, GreedyAcceptance)]
    if not greedy:
        return {}
    flat = argmax_ids([logits[i] for i in greedy])  # (no copy of the logits into one tensor)
    out, at = {}, 0
    for i in greedy:
        n = logits[i].shape[0]
        out[i], at = flat[at : at + n], at + n
    return out


def sampled_probabilities(rules: Sequence[AcceptanceRule], logits: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """The target's distributions for every speculatively sampled row (by index), copied to
    the host at once: on a GPU one synchronisation for the batch instead of one per row."""
    sampled = [i for i, rule in enumerate(rules) if isinstance(rule, SpeculativeSampling)]
    if not sampled:
        return {}
    probs = host_probabilities_rows([logits[i] for i in sampled], [rules[i].params for i in sampled],
                                    rules[sampled[0]].generator.device)
    return dict(zip(sampled, probs))
