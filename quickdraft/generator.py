"""The high-level API: text in, text out, with a target, a tokenizer and a drafter.

>>> gen = SpeculativeGenerator.from_pretrained()          # embedded target + paired draft
>>> out = gen.generate("def median(values):", max_new_tokens=64, temperature=0.7, seed=1)
>>> stream = gen.stream("import os\\n", max_new_tokens=32)
>>> for chunk in stream:
...     print(chunk.text, end="")
>>> stream.stats.mean_accepted_tokens       # complete once the stream is exhausted
>>> gen.generate(messages=[{"role": "user", "content": "def f(x):"}])  # the model's chat template
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from .chat import Message, chat_prompt_ids, check_messages, end_of_turn_ids, has_chat_template
from .decoding.engine import Step, decode
from .decoding.sampling import SamplingParams
from .decoding.stats import GenerationStats
from .decoding.step import EMPTY_PROMPT, ContextOverflowError
from .decoding.stopping import StopConditions, check_count, cut_at_stop
from .drafters import (
    METHODS,
    NEEDS_DRAFT,
    Drafter,
    DraftModelDrafter,
    DraftOptions,
    NoDrafter,
)
from .drafters.draft_stop import ADAPTIVE_MAX_DEPTH
from .drafters.eagle import MAX_CPU_CHAIN, EagleDrafter
from .drafters.early_exit import EarlyExitDrafter
from .drafters.shapes import Shape
from .models.lm import CausalLM, eos_token_ids
from .resolve import MethodPlan, resolve_method
from .text import Generation, TextAssembler, TextChunk, TextStream, stop_strings

DEFAULT_NUM_SPECULATIVE_TOKENS = 4


def sampling_params(
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    sampling: SamplingParams | None = None,
) -> SamplingParams:
    """The :class:`SamplingParams` for keyword arguments, or ``sampling`` itself; giving
    both (a ``sampling`` object and a non-default keyword) is ambiguous and refused."""
    if sampling is None:
        return SamplingParams(temperature, top_k, top_p, seed)
    if (temperature, top_k, top_p, seed) != (0.0, 0, 1.0, None):
        raise ValueError("pass either sampling=SamplingParams(...) or temperature/top_k/top_p/seed, not both")
    return sampling


#: The width of a draft model's captured step (``capture=True``).
DRAFT_STEP_WIDTH = 2


def token_ids(prompt) -> list[int]:
    """A prompt given as token ids, as a list of ints; a ``TypeError`` that names what was
    given otherwise (an int or a float used to fail deep in the engine)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dim() != 1:
            raise TypeError(f"token ids must be a 1-D integer tensor, got {prompt.dtype} of shape {tuple(prompt.shape)}")
        return prompt.tolist()
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise TypeError(f"a prompt is text or a sequence of token ids, got {type(prompt).__name__}")
    ids = []
    for token in prompt:
        try:
            ids.append(operator.index(token))
        except TypeError:
            raise TypeError(f"token ids must be integers, got {type(token).__name__} {token!r}") from None
    return ids


def _cost_model_source(k: int, measured: bool, what: str) -> str:
    """Where a cost-model k came from, as resolve_k reports it."""
    if not k:
        return f"cost model: {what} is predicted slower, plain decoding"
    return "cost model, measured now" if measured else "cost model, cached"


class SpeculativeGenerator:
    """Generates text with a target model, speeding it up with a drafter when given one.

    Output does not depend on the drafter: greedy output is token-for-token that of plain
    greedy decoding, sampled output has exactly the target's distribution.

    >>> gen = SpeculativeGenerator.from_pretrained()          # embedded default pair
    >>> out = gen.generate("def fibonacci(n):", max_new_tokens=64)
    >>> out.text, out.stats.mean_accepted_tokens

    ``num_speculative_tokens`` is the default draft length of :meth:`generate` and
    :meth:`stream`. Unless given (here or by setting the attribute), the first generation
    settles it with :meth:`resolve_k`: the cost model's choice for this pair and machine
    where the method has one (measured once, a few seconds, then cached; 0 when the draft
    is predicted to slow decoding down: 0 decodes plainly, without the drafter), else the
    method's own k (4 for a plain draft chain without a measurable draft).
    """

    def __init__(
        self,
        target: CausalLM,
        tokenizer,
        drafter: Drafter | None = None,
        num_speculative_tokens: int | None = None,
        acceptance: str = "mss",
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter or NoDrafter()
        self.eos_token_ids = eos_token_ids(target, tokenizer)
        # k until settled (given, set, or resolve_k on the first generation)
        self._k, self._k_settled = DEFAULT_NUM_SPECULATIVE_TOKENS, False
        if num_speculative_tokens is not None:
            self.num_speculative_tokens = num_speculative_tokens  # checked there
        self.log = log  # hears of a cost-model measurement before it runs (resolve_k on the first generation)
        self._remeasure = False  # whether that resolve_k measures again (from_pretrained's remeasure)
        self.acceptance = acceptance  # the sampling rule: mss, or spectr for multi-draft
        self.plan: MethodPlan | None = None  # the resolved method, when built by for_pair
        self.draft: CausalLM | None = None  # the draft model given to for_pair, if any
        self.method_choice = None  # what method="auto" chose (policy.method_choice.MethodChoice)
        self.k_choice = None  # the cost model's k choice, with its measured acceptance (policy.autok.KChoice)
        self._end_of_turn: list[int] | None = None  # found once, on the first chat
        # method="auto": the options and remeasure flag it was resolved with, and the
        # generator chats decode with (auto's choice measured on chats; for_chats)
        self._auto: tuple[DraftOptions, bool] | None = None
        self._for_chats: SpeculativeGenerator | None = None
        #: Run the target's chain passes at a fixed width (``capture=True`` in from_pretrained):
        #: captured as CUDA graphs on a GPU, eager at static shapes on the CPU.
        self.capture = False

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens a step proposes when a call does not say (0: plain decoding)."""
        return self._k

    @num_speculative_tokens.setter
    def num_speculative_tokens(self, k: int | None) -> None:
        """A k for every call that does not give one; None: settle it again (resolve_k) at
        the next generation."""
        if k is None:
            self._k_settled = False
            return
        self._k, self._k_settled = check_count(k, "num_speculative_tokens", 0), True

    def settled_k(self) -> int:
        """``num_speculative_tokens``, settled first by :meth:`resolve_k` (with
        from_pretrained's ``log`` and ``remeasure``) if nobody gave, set or resolved it yet."""
        if not self._k_settled:
            self.resolve_k(remeasure=self._remeasure, log=self.log)  # once: cached on disk, then here
        return self._k

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path | None = None,
        draft: str | Path | None = None,
        method: str | None = None,
        backend: str = "auto",
        options: DraftOptions | None = None,
        acceptance: str = "mss",
        remeasure: bool = False,
        log: Callable[[str], None] | None = None,
        draft_vocab: int | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        quantize: str | None = None,
        capture: bool = False,
        kv_cache: str | None = None,
        kind: str = "completion",
    ) -> SpeculativeGenerator:
        """Load a target (default: the embedded default) and, for the methods that need one
        (draft, tree, multi-draft, hybrid, auto), a draft (default: the embedded target's
        paired draft); for ``early-exit``, ``draft`` is an exit head directory or ``"shared"``
        (default: the head shipped for the target, if any). ``options`` shape the method
        (tree, number of drafts, n-gram sizes, exit layer; None: the defaults); ``acceptance`` is the sampling
        rule (mss, or spectr for multi-draft). ``method`` None: ``"draft"``, or the method a
        packaged model names for itself when no ``draft`` is given (smollm2-135m: ``"auto"``).

        ``method="auto"`` lets the cost model pick the method, k and tree shape for this
        pair and machine (measured once, a few seconds, then cached; ``remeasure`` measures
        again, ``log`` gets a line before a measurement); the choice is in
        :attr:`method_choice`; ``kind="chat"`` measures it on chats only (a generator for
        chats alone: :meth:`for_chats` is itself). ``draft_vocab``: how many of its most frequent tokens the
        draft model, EAGLE drafter, prophet or exit head scores (None: its ``draft_vocab.json``
        default, 0: all; output is the same either way).

        ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``; default cpu) and ``dtype``
        (``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"``/None: float32 on CPU,
        bfloat16 on CUDA) place both models, and ``quantize`` (``"auto"``/None, ``"none"``,
        ``"int8"``, ``"int4"``: docs/quantization.md) stores their block linears; an unusable one is a ``ValueError``
        (:class:`~quickdraft.models.placement.PlacementError`) before anything loads.
        ``kv_cache`` (``"auto"``/None, ``"float16"``): how the models' KV caches store keys
        and values (float16: CPU, float32 compute; half the memory, faster long contexts).
        ``capture``: the target's plain and verify passes of a chain run at one fixed width
        (``models/static_step.py``), captured with ``torch.compile(mode="reduce-overhead")``
        on CUDA (falling back to eager where that fails); native runtime only."""
        from .models.placement import resolve_placement
        from .models.registry import default_method
        from .pair import load_pair

        method = method or default_method(model, draft)
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
        options = DraftOptions() if options is None else options
        if draft_vocab is not None:  # the heads' too (a draft model's is load_pair's)
            options = dataclasses.replace(options, draft_vocab=draft_vocab)
        placement = resolve_placement(device, dtype, quantize, kv_cache)
        if method == "early-exit" and draft is not None:  # the draft is an exit head directory
            options, draft = dataclasses.replace(options, exit_head=str(draft)), None
        pair = load_pair(model, draft, need_draft=method in NEEDS_DRAFT, backend=backend, draft_vocab=draft_vocab,
                         method=method, placement=placement)
        gen = cls.for_pair(pair.target, pair.draft, pair.tokenizer, method, options, acceptance,
                           remeasure=remeasure, log=log, kind=kind)
        if capture and not hasattr(gen.target, "use_static_step"):
            raise ValueError("capture needs the native runtime for the target (drop --backend hf)")
        gen.capture = capture
        return gen

    @classmethod
    def for_pair(
        cls,
        target: CausalLM,
        draft: CausalLM | None,
        tokenizer,
        method: str = "draft",
        options: DraftOptions | None = None,
        acceptance: str = "mss",
        *,
        remeasure: bool = False,
        log: Callable[[str], None] | None = None,
        kind: str = "completion",
    ) -> SpeculativeGenerator:
        """The generator of ``method`` for models already loaded (what :meth:`from_pretrained`
        returns once it has loaded them): the method resolved by
        :func:`~quickdraft.resolve.resolve_method` (its result is :attr:`plan`; ``kind``:
        the requests ``auto`` chooses for, completions or chats), the drafter built, and the
        k the method itself fixes, if any, set."""
        options = DraftOptions() if options is None else options
        if kind == "chat" and not has_chat_template(tokenizer):  # no chats to measure: chat_ids says why
            kind = "completion"
        plan = resolve_method(target, draft, tokenizer, method, options, remeasure=remeasure, log=log, kind=kind)
        gen = cls(target, tokenizer, plan.drafter(draft, target), acceptance=acceptance, log=log)
        gen.plan, gen.method_choice, gen.draft = plan, plan.choice, draft
        gen._remeasure = remeasure
        if method == "auto":
            gen._auto = (options, remeasure)
            if kind == "chat":  # chosen for chats already
                gen._for_chats = gen
        fixed = (plan.k, "auto") if plan.k is not None else gen._method_k()
        if fixed is not None:  # the method's k until resolve_k settles it (it may measure better)
            gen._k = fixed[0]
        return gen

    def for_chats(self, log: Callable[[str], None] | None = None) -> SpeculativeGenerator:
        """The generator chats decode with: this one, except under ``method="auto"`` with a
        model that has a chat template, where auto's choice for completions need not suit
        replies (SmolLM2: prompt lookup 1.5x plain decoding on code, 0.97x on chat): then a
        generator sharing these models, with auto's choice measured on chats (once per
        machine, cached; ``log`` gets a line before a measurement), built on the first
        chat. :meth:`generate` and :meth:`stream` use it for ``messages=``."""
        if self._auto is None or not has_chat_template(self.tokenizer):
            return self
        if self._for_chats is None:
            options, remeasure = self._auto
            chats = SpeculativeGenerator.for_pair(self.target, self.draft, self.tokenizer, "auto", options,
                                                  self.acceptance, remeasure=remeasure, log=log, kind="chat")
            chats.capture = self.capture
            chats._for_chats = chats  # its own generator for chats
            self._for_chats = chats
        return self._for_chats

    def chat_ids(self, messages: Sequence[Message]) -> list[int]:
        """The prompt ids of a conversation: ``messages`` (``[{"role": "user", "content":
        "..."}, ...]``) through the model's own chat template, with the generation prompt.
        A model without a template raises :class:`~quickdraft.chat.NoChatTemplateError`."""
        name = Path(self.target.model_dir).name if self.target.model_dir else "this model"
        return chat_prompt_ids(self.tokenizer, check_messages(list(messages)), name)

    @property
    def end_of_turn_ids(self) -> list[int]:
        """The tokens that end the assistant's turn in a chat (see :func:`~quickdraft.chat.end_of_turn_ids`)."""
        if self._end_of_turn is None:
            self._end_of_turn = end_of_turn_ids(self.tokenizer)
        return self._end_of_turn

    def _prompt(self, prompt, messages) -> tuple[str | Sequence[int], list[int]]:
        """What to decode and the extra tokens that end it: a conversation's rendered ids end
        at the end of the assistant's turn; a prompt ends at EOS alone."""
        if (prompt is None) == (messages is None):
            raise ValueError("give either a prompt or messages (a chat), not both" if messages is not None
                             else "give a prompt or messages=[...] (a chat)")
        if messages is None:
            return prompt, []
        return self.chat_ids(messages), self.end_of_turn_ids

    def encode(self, prompt: str | Sequence[int], truncate: bool = False, room: int = 1) -> torch.Tensor:
        """Token ids of ``prompt`` (tokenised as ``AutoTokenizer`` does with default arguments).

        A prompt that leaves no room in the context is an error, or with ``truncate`` loses
        its beginning so that ``room`` new tokens fit (see :meth:`encode_prompt`)."""
        return self.encode_prompt(prompt, truncate, room)[0]

    def encode_prompt(
        self, prompt: str | Sequence[int], truncate: bool = False, room: int = 1
    ) -> tuple[torch.Tensor, int]:
        """:meth:`encode`, and how many tokens truncation dropped from the beginning."""
        if isinstance(prompt, str):
            # verbose=False: the tokenizer's "sequence length is longer than the maximum"
            # warning is ours to give (below), with the fix.
            ids = self.tokenizer(prompt, verbose=False)["input_ids"]
        else:
            ids = token_ids(prompt)
        if not ids:  # before anything measures or decodes
            raise ValueError(EMPTY_PROMPT)
        limit = self.target.context_length - 1
        dropped = 0
        if len(ids) > limit:
            if not truncate:
                raise ContextOverflowError(
                    f"the prompt has {len(ids)} tokens but the model's context is "
                    f"{self.target.context_length}; shorten it or pass --truncate-prompt"
                )
            # Keep the end: it is what the continuation depends on.
            keep = max(1, self.target.context_length - room)
            dropped = len(ids) - keep
            ids = ids[-keep:]
        return torch.tensor(ids, dtype=torch.long), dropped

    def steps(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        num_speculative_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        truncate_prompt: bool = False,
        sampling: SamplingParams | None = None,
        stats: GenerationStats | None = None,
    ) -> Iterator[Step]:
        """The engine's token-level steps for this prompt (parameters as in :meth:`generate`;
        ``stats``, if given, is filled in as the steps come; a chat decodes with
        :meth:`for_chats`). :meth:`generate` and :meth:`stream` consume these."""
        stats = stats if stats is not None else GenerationStats()
        prompt, stop_ids = self._prompt(prompt, messages)
        ids = self._start(prompt, max_new_tokens, truncate_prompt, stats)
        decoder = self if messages is None else self.for_chats()
        return decoder._decode(ids, max_new_tokens, temperature, top_k, top_p, seed,
                               num_speculative_tokens, stop, sampling, stats, stop_ids)

    def _start(self, prompt, max_new_tokens: int, truncate_prompt: bool, stats: GenerationStats) -> torch.Tensor:
        ids, dropped = self.encode_prompt(prompt, truncate_prompt, room=max_new_tokens)
        stats.prompt_tokens = ids.numel()
        stats.truncated_prompt_tokens = dropped
        return ids

    def _decode(self, ids, max_new_tokens, temperature, top_k, top_p, seed, num_speculative_tokens,
                stop, sampling, stats, stop_ids: Sequence[int] = ()) -> Iterator[Step]:
        params = sampling_params(temperature, top_k, top_p, seed, sampling)
        k = self.settled_k() if num_speculative_tokens is None else num_speculative_tokens
        # stop_ids end it as EOS does: not part of the output
        conditions = StopConditions(max_new_tokens, [*self.eos_token_ids, *stop_ids], stop_strings(stop),
                                    self.tokenizer)
        if k > 0:  # (0: plain decoding, the cost model predicts the draft to lose)
            bind_step_costs(self.drafter, self.target, self.tokenizer, k)
        if self.capture:  # one width per k: the widest pass this k feeds
            width = self.drafter.verify_width(k) if k > 0 else 1
            graphs = self.target.device.type == "cuda"
            self.target.use_static_step(width, compile=graphs)
            if k > 0 and hasattr(self.draft, "use_static_step"):
                # The draft's chain steps: one token, or two to catch up after a fully
                # accepted chain (its last token and the bonus); a prefill or a tree's
                # masked level stays on the ordinary path.
                self.draft.use_static_step(DRAFT_STEP_WIDTH, compile=graphs)
        return decode(self.target, ids, conditions, drafter=self.drafter, params=params,
                      num_speculative_tokens=k, acceptance=self.acceptance, stats=stats)

    def generate(
        self,
        prompt: str | Sequence[int] | list[str | Sequence[int]] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        num_speculative_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        truncate_prompt: bool = False,
        sampling: SamplingParams | None = None,
        batch_size: int = 8,
    ) -> Generation | list[Generation]:
        """Generate a completion of ``prompt`` (text, or token ids), or of every prompt of a
        list (``[text, ...]`` or ``[[ids], ...]``): one :class:`Generation` per prompt, in
        order, decoded together by the batched engine (docs/batching.md).

        Args:
            messages: a conversation instead of a prompt, ``[{"role": "system" | "user" |
                "assistant" | "developer", "content": "..."}, ...]``: rendered with the
                model's chat template (:class:`~quickdraft.chat.NoChatTemplateError`, a
                ``ValueError``, for a model without one); generation ends at the
                template's end-of-turn token, which is not part of the output.
            max_new_tokens: tokens to generate at most (EOS and stop strings end it sooner).
            temperature: 0 = greedy (the default); > 0 samples from the target's
                distribution at this temperature.
            top_k: keep only the k most likely tokens when sampling (0 = off).
            top_p: nucleus sampling: keep the smallest set of tokens with this much
                probability mass, in (0, 1] (1 = off).
            seed: seed of the sampling generator (None: a random seed). The same seed and
                settings give the same output.
            num_speculative_tokens: draft tokens proposed per step (k); None uses
                ``self.num_speculative_tokens`` (settled by :meth:`resolve_k` on the first
                generation unless set: a cost-model measurement of a few seconds, once per
                machine), 0 decodes without the drafter. Only speed depends on it, never
                the output.
            stop: a stop string or several; generation ends at the first one, which is cut
                from ``text`` (its tokens stay in ``token_ids``).
            truncate_prompt: drop the beginning of a prompt too long for the context
                (``stats.truncated_prompt_tokens`` tells how many tokens) instead of raising
                :class:`ContextOverflowError`.
            sampling: a :class:`SamplingParams` instead of ``temperature``, ``top_k``,
                ``top_p`` and ``seed`` (not both).
            batch_size: for a list of prompts, how many are decoded at once (the rest join
                as rows finish). Every prompt gets the settings above (each its own
                generator seeded with ``seed``: with a given ``num_speculative_tokens`` a
                row reproduces its solo output); None for ``num_speculative_tokens`` lets
                the batch policy pick k per batch size.

        Returns:
            :class:`Generation`: ``text`` and ``token_ids`` (prompt excluded) and ``stats``
            (a list of them for a list of prompts).
        """
        if messages is None and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            from .batch_generate import Request, generate_many

            params = sampling_params(temperature, top_k, top_p, seed, sampling)
            requests = [Request(p, max_new_tokens, params, stop_strings(stop), truncate_prompt) for p in prompt]
            return generate_many(self, requests, batch_size, num_speculative_tokens)
        stats = GenerationStats()
        out: list[int] = []
        for step in self.steps(prompt, messages=messages, max_new_tokens=max_new_tokens, temperature=temperature,
                               top_k=top_k, top_p=top_p, seed=seed, num_speculative_tokens=num_speculative_tokens,
                               stop=stop, truncate_prompt=truncate_prompt, sampling=sampling, stats=stats):
            out.extend(step.tokens)
        text = self.tokenizer.decode(out, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return Generation(cut_at_stop(text, stop_strings(stop)), out, stats)

    def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Message] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        num_speculative_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        truncate_prompt: bool = False,
        sampling: SamplingParams | None = None,
    ) -> TextStream:
        """Stream the completion as :class:`TextChunk` s, one per step (all the tokens
        accepted in a step come together). Parameters are those of :meth:`generate`.

        Returns a :class:`TextStream`: iterate over it for the chunks; its ``stats``,
        ``text`` and ``token_ids`` describe the generation (complete once it is exhausted),
        and ``result()`` gives the :class:`Generation`.

        The chunks concatenate to ``generate(...).text``: multi-byte characters are kept
        whole and text that might begin a stop string is held back until it is decided.
        """
        stats = GenerationStats()
        steps = self.steps(prompt, messages=messages, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_k=top_k, top_p=top_p, seed=seed, num_speculative_tokens=num_speculative_tokens,
                           stop=stop, truncate_prompt=truncate_prompt, sampling=sampling, stats=stats)
        token_ids: list[int] = []
        return TextStream(self._chunks(steps, stop_strings(stop), token_ids), steps, stats, token_ids)

    def _chunks(self, steps: Iterator[Step], stop: list[str], token_ids: list[int]) -> Iterator[TextChunk]:
        text = TextAssembler(self.tokenizer, stop)
        for step in steps:
            token_ids.extend(step.tokens)
            chunk = text.push(step)
            if text.stopped:
                # The engine stopped at the same token; let it finish so the stats
                # (decode time, finish reason) are complete.
                for step in steps:
                    token_ids.extend(step.tokens)
            if chunk:
                yield chunk
            if text.stopped:
                return
        tail = text.flush()
        if tail:
            yield tail

    def resolve_k(self, requested: int | None = None, *, remeasure: bool = False,
                  log: Callable[[str], None] | None = None) -> tuple[int | None, str | None]:
        """THE place k is settled, for the CLI, the server and API users alike: the k to
        decode with and where it came from, and ``num_speculative_tokens`` set to it.

        In order: None for a method that drafts nothing; ``requested`` (an explicit k);
        the choice of ``method="auto"``; for a chain with an adaptive draft-stop policy, the
        most it drafts; for layer skip, the k its profile was tuned at; for a draft model's
        plain chain, the cost model's k for this pair and machine (cached; measured when
        missing or with ``remeasure``; 0 = plain decoding when the draft is predicted to
        lose; ``log`` gets its summary line); for early exit and EAGLE's default CPU chain
        (checked before its own depth), the cost model's k for the target, its head and the
        machine (likewise); otherwise the method's default. The first :meth:`generate`,
        :meth:`stream` or :meth:`steps` without a k calls it when k is not settled yet."""
        if isinstance(self.drafter, NoDrafter):
            return None, None
        if requested is not None:
            k, source = requested, "given"
        elif self.method_choice is not None:
            k, source = self.num_speculative_tokens, "auto"
        elif isinstance(self.drafter, EagleDrafter) and self.drafter.k_by_cost_model:
            from .policy.head_choice import cached_eagle_k

            k, measured = cached_eagle_k(self.target, self.tokenizer, self.drafter.head,
                                         self.drafter.shape.depth(MAX_CPU_CHAIN), remeasure=remeasure, log=log)
            source = _cost_model_source(k, measured, "EAGLE")
        elif (fixed := self._method_k()) is not None:
            k, source = fixed
        else:
            chain = chain_drafter(self.drafter)
            if chain is self.drafter and type(chain.shape) is Shape:  # the cost model knows plain chains
                choice = self.tune_num_speculative_tokens(remeasure=remeasure, log=log)
                if log is not None:
                    log(choice.summary())  # cached or measured now, and how to re-measure
                k = choice.k
                source = _cost_model_source(k, choice.measured, "the draft")
            elif isinstance(self.drafter, EarlyExitDrafter):
                from .policy.exit_layer import cached_exit_k

                k, measured = cached_exit_k(self.target, self.tokenizer, self.drafter.head, self.drafter.share_kv,
                                            remeasure=remeasure, log=log)
                source = _cost_model_source(k, measured, "early exit")
            else:
                k, source = self.num_speculative_tokens, "default"
        self.num_speculative_tokens = k
        return k, source

    def _method_k(self) -> tuple[int, str] | None:
        """The k the drafter's method itself sets, with no measurement: an adaptive
        draft-stop policy's most (k caps the chain; the policy stops sooner), or the k a
        layer-skip profile was tuned at, or a drafter's own (``own_k``: eagle's tree depth).
        None for the others."""
        chain = chain_drafter(self.drafter)
        stop = chain.stop if chain is not None else getattr(self.drafter, "stop_policy", None)
        if stop is not None and stop.name != "fixed":
            return ADAPTIVE_MAX_DEPTH, "the most an adaptive --draft-stop drafts"
        if chain is not None and hasattr(chain.model, "profile"):
            return chain.model.profile.k, "skip profile"
        return getattr(self.drafter, "own_k", None)

    def tune_num_speculative_tokens(self, remeasure: bool = False, log=None):
        """Set ``num_speculative_tokens`` to the cost model's best k for this target, draft
        and machine: read from the auto-k cache, or measured (a few seconds for the
        embedded pair) and cached when missing or when ``remeasure``; 0 (decode without the
        draft) when even the best k is predicted to be slower than plain decoding. Returns the
        :class:`~quickdraft.policy.autok.KChoice` (k, measured costs, where it is cached).
        Needs a draft model."""
        from .policy.autok import cached_k

        if not isinstance(self.drafter, DraftModelDrafter):
            raise ValueError("choosing k by measurement needs a draft model; resolve_k() settles k for every method")
        choice = cached_k(self.target, self.drafter.model, self.tokenizer, remeasure=remeasure, log=log)
        self.num_speculative_tokens = choice.k
        self.k_choice = choice
        return choice


def bind_step_costs(drafter, target: CausalLM, tokenizer, k: int) -> None:
    """Give a ``cost`` draft-stop policy the step costs it weighs (no-op for other policies):
    the cached auto-k measurement of a draft model, or (layer skip, whose draft is the
    target) a brief measurement of the skip draft."""
    from .drafters.draft_stop import CostStop

    chain = chain_drafter(drafter)
    if chain is None or not isinstance(chain.stop, CostStop):
        return
    if chain.stop.costs is None:
        from .policy.autok import CALIBRATION_PROMPTS, cached_k, measure_step_costs

        if hasattr(chain.model, "profile"):
            context = tokenizer(CALIBRATION_PROMPTS[0], verbose=False)["input_ids"]
            chain.stop.costs = measure_step_costs(target, chain.model, context, range(1, k + 2), repeats=3,
                                                  context_length=64)
        else:
            chain.stop.costs = cached_k(target, chain.model, tokenizer).costs


def chain_drafter(drafter) -> DraftModelDrafter | None:
    """The draft-model drafter inside ``drafter`` (itself, or hybrid's), if any."""
    drafter = getattr(drafter, "model", drafter) if not isinstance(drafter, DraftModelDrafter) else drafter
    return drafter if isinstance(drafter, DraftModelDrafter) else None
