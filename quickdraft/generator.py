"""The high-level API: text in, text out, with a target, a tokenizer and a drafter."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .detokenize import IncrementalDetokenizer
from .drafters import METHODS, NEEDS_DRAFT, Drafter, DraftOptions, NoDrafter, make_drafter
from .engine import ContextOverflowError, decode
from .models.lm import CausalLM, load_model
from .models.loading import CheckpointError, resolve_pair
from .sampling import SamplingParams
from .stats import GenerationStats
from .stopping import StopConditions, cut_at_stop


@dataclass
class Generation:
    """A finished generation: the completion's text and ids (prompt excluded) and its stats."""

    text: str
    token_ids: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass
class TextChunk:
    """Text shown by one step, as segments ``(text, from_draft)``: ``from_draft`` marks text
    of draft tokens the target accepted (what a UI highlights)."""

    segments: list[tuple[str, bool]]

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.segments)


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer, loaded exactly as ``AutoTokenizer.from_pretrained`` does."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"no usable tokenizer in {model_dir}: {str(exc).splitlines()[0][:160]}") from None


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Draft and target must share a vocabulary (padded embedding sizes may differ)."""
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(
            f"draft {draft_name} and target {target_name} use different tokenizers; "
            "speculative decoding needs a draft with the target's tokenizer"
        )


class SpeculativeGenerator:
    """Generates text with a target model, speeding it up with a drafter when given one.

    >>> gen = SpeculativeGenerator.from_pretrained()          # embedded default pair
    >>> out = gen.generate("def fibonacci(n):", max_new_tokens=64)
    >>> out.text, out.stats.mean_accepted_tokens
    """

    def __init__(self, target: CausalLM, tokenizer, drafter: Drafter | None = None, acceptance: str = "mss") -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter or NoDrafter()
        self.acceptance = acceptance  # the sampling rule: mss, or spectr for multi-draft
        eos = list(target.eos_token_ids)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        self.eos_token_ids = eos

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path | None = None,
        draft: str | Path | None = None,
        method: str = "draft",
        backend: str = "auto",
        options: DraftOptions = DraftOptions(),
        acceptance: str = "mss",
    ) -> SpeculativeGenerator:
        """Load a target (default: the embedded default) and, for the methods that need one
        (draft, tree, multi-draft, hybrid), a draft (default: the embedded target's paired
        draft). ``options`` shape the method (tree, number of drafts, n-gram sizes);
        ``acceptance`` is the sampling rule (mss, or spectr for multi-draft)."""
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
        target_dir, draft_dir = resolve_pair(model, draft, need_draft=method in NEEDS_DRAFT)
        target = load_model(target_dir, backend)
        tokenizer = load_tokenizer(target_dir)
        draft_model = None
        if draft_dir is not None and method in NEEDS_DRAFT:
            check_same_tokenizer(tokenizer, load_tokenizer(draft_dir), str(target_dir), str(draft_dir))
            draft_model = load_model(draft_dir, backend)
        return cls(target, tokenizer, make_drafter(method, draft_model, target.vocab_size, options), acceptance)

    def encode(self, prompt: str | Sequence[int], truncate: bool = False, room: int = 1) -> torch.Tensor:
        """Token ids of ``prompt`` (tokenised as ``AutoTokenizer`` does with default arguments).

        A prompt that leaves no room in the context is an error, or with ``truncate`` loses
        its beginning so that ``room`` new tokens fit."""
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        limit = self.target.context_length - 1
        if len(ids) > limit:
            if not truncate:
                raise ContextOverflowError(
                    f"the prompt has {len(ids)} tokens but the model's context is "
                    f"{self.target.context_length}; shorten it or pass --truncate-prompt"
                )
            # Keep the end: it is what the continuation depends on.
            ids = ids[-max(1, self.target.context_length - room) :]
        return torch.tensor(ids, dtype=torch.long)

    def steps(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        num_speculative_tokens: int = 4,
        stop: Sequence[str] = (),
        stats: GenerationStats | None = None,
        truncate_prompt: bool = False,
    ):
        """The token-level step iterator of the engine for this prompt."""
        conditions = StopConditions(max_new_tokens, self.eos_token_ids, stop, self.tokenizer)
        return decode(
            self.target,
            self.encode(prompt, truncate_prompt, room=max_new_tokens),
            conditions,
            drafter=self.drafter,
            params=sampling,
            num_speculative_tokens=num_speculative_tokens,
            acceptance=self.acceptance,
            stats=stats,
        )

    def generate(self, prompt: str | Sequence[int], stop: Sequence[str] = (), **kwargs) -> Generation:
        """Generate a completion. Keyword arguments are those of :meth:`steps`."""
        stats = GenerationStats()
        ids: list[int] = []
        for step in self.steps(prompt, stop=stop, stats=stats, **kwargs):
            ids.extend(step.tokens)
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return Generation(cut_at_stop(text, stop), ids, stats)

    def stream(
        self, prompt: str | Sequence[int], stop: Sequence[str] = (), stats: GenerationStats | None = None, **kwargs
    ) -> Iterator[TextChunk]:
        """Stream the completion as text chunks, one per step (all accepted tokens together).

        The chunks concatenate to ``generate(...).text``: multi-byte characters are kept
        whole and text that might begin a stop string is held back until it is decided.
        """
        detok = IncrementalDetokenizer(self.tokenizer)
        pending: list[tuple[str, bool]] = []  # decoded but not yet shown (may start a stop string)
        recent = ""  # the tail of what was shown, to find stop strings that straddle chunks
        longest = max((len(s) for s in stop), default=0)
        for step in self.steps(prompt, stop=stop, stats=stats, **kwargs):
            pending.append((detok.push(step.tokens[: step.drafted]), True))
            pending.append((detok.push(step.tokens[step.drafted :]), False))
            text = "".join(t for t, _ in pending)
            show = len(text)
            if stop:
                window = recent + text
                found = len(cut_at_stop(window, stop))
                if found < len(window):  # a stop string completed: show up to it and end
                    yield TextChunk(_take(pending, found - len(recent))[0])
                    return
                show -= _stop_prefix_suffix(text, stop)
                recent = (recent + text[:show])[-longest:]
            shown, pending = _take(pending, show)
            if shown:
                yield TextChunk(shown)
        tail = "".join(t for t, _ in pending) + detok.flush()
        if tail:
            yield TextChunk([(tail, False)])


def _take(segments: list[tuple[str, bool]], n: int) -> tuple[list[tuple[str, bool]], list[tuple[str, bool]]]:
    """Split segments after ``n`` characters, dropping empty ones."""
    head, rest = [], []
    for text, from_draft in segments:
        if n >= len(text):
            head.append((text, from_draft))
        elif n > 0:
            head.append((text[:n], from_draft))
            rest.append((text[n:], from_draft))
        else:
            rest.append((text, from_draft))
        n -= len(text)
    return [s for s in head if s[0]], [s for s in rest if s[0]]


def _stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
