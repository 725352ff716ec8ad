"""Statistics every generation reports (definitions: docs/methods.md, "Measures")."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

#: Fewer tokens than this from decode passes and a tokens/s figure says nothing (it would
#: be the prefill's tokens over next to no time): it is then not reported.
MIN_DECODE_TOKENS_FOR_RATE = 2
#: How the terminal summary says what ended a generation; the token budget goes unsaid
#: (the token count shows it).
STOPPED_BY_TEXT = {"eos": "ended at EOS", "stop_string": "ended at a stop string",
                   "context": "ended at the context limit"}


@dataclass
class GenerationStats:
    """Counts and timings of one generation.

    ``target_forward_passes`` counts every target pass. The first one is the prefill: it
    runs over the prompt (plus a draft proposed from the prompt) and its time is
    ``prefill_seconds``; the tokens it yields are ``prefill_tokens``. The other passes are
    ``decode_seconds``. ``mean_accepted_tokens`` = new tokens / target passes, 1.0 for
    plain decoding. ``prompt_tokens`` counts the prompt as decoded, after
    ``truncated_prompt_tokens`` were dropped from its beginning (``--truncate-prompt``).

    ``accepted_tokens`` counts the accepted draft tokens that are in the output: a step
    cut short by EOS or a stop string keeps none of the accepted tokens after the cut (nor
    an accepted EOS, which is never output), so 0 new tokens never come with accepted
    drafts. ``finish_reason`` is "stop" or "length"; ``stopped_by`` says which condition
    ended the generation: "eos", "stop_string", "max_new_tokens" or "context".
    """

    prompt_tokens: int = 0
    truncated_prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_tokens: int = 0
    target_forward_passes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    time_to_first_token: float = 0.0
    finish_reason: str = ""
    stopped_by: str = ""

    def record_step(self, drafted: int, accepted: int, emitted: int | None = None, passes: int = 1) -> None:
        """One target pass: ``drafted`` tokens proposed, ``accepted`` of them accepted, and
        ``emitted`` tokens output (default ``accepted + 1``: the accepted drafts and the
        target's own token). When EOS or a stop string cut the step, ``emitted`` is what is
        left, and only the accepted drafts among those count. ``passes``: the passes it
        stands for (a plain greedy chain's, in one call: one a token, nothing drafted)."""
        if emitted is None:
            emitted = accepted + 1
        accepted = min(accepted, emitted)
        if self.target_forward_passes == 0:
            self.prefill_tokens = emitted
        self.target_forward_passes += passes
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        missing = drafted - len(self.drafted_per_position)
        if missing > 0:
            self.drafted_per_position.extend([0] * missing)
            self.accepted_per_position.extend([0] * missing)
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: GenerationStats) -> GenerationStats:
        """Add ``other``'s counts and times to these (pooling several generations: the
        per-position counts are added position by position). ``time_to_first_token`` and
        ``finish_reason`` / ``stopped_by`` describe one generation and are left as they are.
        Returns ``self``."""
        self.prompt_tokens += other.prompt_tokens
        self.truncated_prompt_tokens += other.truncated_prompt_tokens
        self.new_tokens += other.new_tokens
        self.prefill_tokens += other.prefill_tokens
        self.target_forward_passes += other.target_forward_passes
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n
        self.prefill_seconds += other.prefill_seconds
        self.decode_seconds += other.decode_seconds
        return self

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0.0 when nothing was drafted; reported as null)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        return self.new_tokens / self.target_forward_passes if self.target_forward_passes else 1.0

    @property
    def decode_passes(self) -> int:
        """Target passes after the prefill (the ones ``decode_seconds`` times)."""
        return max(self.target_forward_passes - 1, 0)

    @property
    def decode_tokens(self) -> int:
        """New tokens that came from decode passes (not from the prefill)."""
        return max(self.new_tokens - self.prefill_tokens, 0)

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: new tokens / decode seconds (the benchmark's definition;
        0.0 without decode time). See :attr:`reported_tokens_per_second`."""
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def reported_tokens_per_second(self) -> float | None:
        """:attr:`tokens_per_second` when it means something: at least
        ``MIN_DECODE_TOKENS_FOR_RATE`` tokens came from decode passes; else None."""
        if self.decode_tokens < MIN_DECODE_TOKENS_FOR_RATE or self.decode_seconds <= 0:
            return None
        return self.tokens_per_second

    def to_dict(self) -> dict:
        """Every field plus the derived figures. A figure that would mean nothing is None
        (null in JSON): ``tokens_per_second`` without enough decode tokens,
        ``acceptance_rate`` when nothing was drafted (plain decoding)."""
        out = asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate if self.drafted_tokens else None,
            mean_accepted_tokens=self.mean_accepted_tokens,
            per_position_acceptance=self.per_position_acceptance,
            decode_tokens=self.decode_tokens,
            tokens_per_second=self.reported_tokens_per_second,
        )
        return out

    def summary(self) -> str:
        """One line for terminals: the figures of :meth:`to_dict`, those that mean something."""
        d = self.to_dict()
        noun = "token" if self.new_tokens == 1 else "tokens"
        timing = [] if d["tokens_per_second"] is None else [f"{d['tokens_per_second']:.1f} tok/s decode"]
        timing.append(f"TTFT {self.time_to_first_token * 1000:.0f} ms")
        ended = STOPPED_BY_TEXT.get(self.stopped_by)
        line = (f"{self.new_tokens} {noun}{f' ({ended})' if ended else ''} in "
                f"{self.prefill_seconds + self.decode_seconds:.2f}s "
                f"({', '.join(timing)}) | target passes {self.target_forward_passes}")
        if d["acceptance_rate"] is not None:
            line += (f", mean accepted {d['mean_accepted_tokens']:.2f}, acceptance "
                     f"{d['acceptance_rate']:.0%} ({self.accepted_tokens}/{self.drafted_tokens})")
        return line


#: Plain steps in a row after which the policy forgets the acceptance that turned
#: speculation off and drafts again under its prior (``RecentAcceptance.record_plain_step``).
FORGET_AFTER = 64


class RecentAcceptance:
    """Per-position acceptance over the last ``window`` verified proposals (all rows), so the
    policy follows the prompts in the batch now rather than every prompt since the engine
    started (long prompts accept less than short ones).

    A plain step proposes nothing, so it cannot tell the policy that acceptance has
    recovered: without forgetting, one poor stretch (a warm-up prompt where n-gram lookup
    found little) would turn speculation off for good. After ``forget_after`` plain steps
    in a row the window is emptied: the policy drafts again under its prior and measures
    afresh (a few steps; where speculation still does not pay, it turns it off again)."""

    def __init__(self, window: int = 256, forget_after: int = FORGET_AFTER) -> None:
        self.steps: deque[tuple[int, int]] = deque(maxlen=window)
        self.version = 0  # bumped with every recorded proposal (the policy caches on it)
        self.forget_after = forget_after
        self.plain_steps = 0  # plain steps since the last proposal

    def record_step(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.steps.append((drafted, accepted))
            self.version += 1
            self.plain_steps = 0

    def record_plain_step(self) -> None:
        """The policy ran a step as plain decoding (k = 0)."""
        self.plain_steps += 1
        if self.plain_steps >= self.forget_after and self.steps:
            self.steps.clear()
            self.version += 1
            self.plain_steps = 0

    @property
    def drafted_tokens(self) -> int:
        return sum(d for d, _ in self.steps)

    @property
    def per_position_acceptance(self) -> list[float]:
        depth = max((d for d, _ in self.steps), default=0)
        return [sum(a > i for d, a in self.steps if d > i) / sum(d > i for d, _ in self.steps) for i in range(depth)]
