"""Text in, text out for many prompts at once: the batched engine behind
``SpeculativeGenerator.generate([...])`` and ``quickdraft generate --prompts-file``."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .decoding.batch_engine import MAX_BATCH_K, BatchEngine, cache_length
from .decoding.sampling import SamplingError, SamplingParams
from .decoding.stats import GenerationStats
from .decoding.stopping import StopConditions, check_count, cut_at_stop
from .decoding.verify import acceptance_for
from .drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from .drafters.batched import make_batch_drafter
from .drafters.draft_stop import FixedStop, parse_draft_stop
from .drafters.eagle import EagleDrafter
from .drafters.early_exit import EarlyExitDrafter
from .drafters.factory import BATCH_METHODS, DraftOptions, hybrid_eagle_chain
from .drafters.hybrid import HybridDrafter
from .drafters.medusa import MedusaDrafter
from .drafters.per_row import HEAD_BATCH_K
from .drafters.prophet import ProphetDrafter
from .drafters.shapes import Shape
from .text import Generation


@dataclass
class Request:
    """One prompt of a batch and its own settings (the keywords of ``generate``)."""

    prompt: str | Sequence[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    truncate_prompt: bool = False


def batch_method(drafter) -> tuple[str, object, DraftOptions]:
    """The batched method, draft model and options matching a single-sequence drafter."""
    method, draft, options = _batch_method(drafter)
    chain = drafter.model if isinstance(drafter, HybridDrafter) else drafter
    stop = getattr(chain, "stop", None) or getattr(chain, "stop_policy", None)  # its --draft-stop, if any
    if stop is not None and stop.name != "fixed":
        options = replace(options, draft_stop=stop.name)
    return method, draft, options


def _batch_method(drafter) -> tuple[str, object, DraftOptions]:
    if isinstance(drafter, NoDrafter):
        return "ar", None, DraftOptions()
    if isinstance(drafter, NgramDrafter):
        return "ngram", None, DraftOptions(ngram_max=drafter.ngram_max, ngram_min=drafter.ngram_min,
                                           datastore=drafter.datastore or "none")
    if isinstance(drafter, HybridDrafter) and isinstance(drafter.model, EagleDrafter):
        ngram, eagle = drafter.ngram, drafter.model
        return "hybrid-eagle", None, DraftOptions(
            ngram_max=ngram.ngram_max, ngram_min=ngram.ngram_min, datastore=ngram.datastore or "none",
            heads=eagle.head, tree=",".join(map(str, eagle.shape.widths)))
    if isinstance(drafter, HybridDrafter) and type(drafter.model.shape) is Shape:
        ngram = drafter.ngram
        return "hybrid", drafter.model.model, DraftOptions(ngram_max=ngram.ngram_max, ngram_min=ngram.ngram_min,
                                                           datastore=ngram.datastore or "none")
    if isinstance(drafter, DraftModelDrafter) and type(drafter.shape) is Shape:
        return "draft", drafter.model, DraftOptions()
    if isinstance(drafter, EarlyExitDrafter):  # batched early exit keeps its own cache (no sharing)
        return "early-exit", None, DraftOptions(exit_head=drafter.head)
    for method, cls, heads in (("medusa", MedusaDrafter, "heads"), ("prophet", ProphetDrafter, "prophet"),
                               ("eagle", EagleDrafter, "head")):
        if isinstance(drafter, cls):  # the loaded heads, a chain per row
            return method, None, DraftOptions(heads=getattr(drafter, heads))
    name = getattr(drafter, "name", type(drafter).__name__)
    raise ValueError(f"{name} does not batch: token trees, multi-draft and layer skip are batch 1; "
                     f"batched decoding supports {', '.join(BATCH_METHODS)}")


def make_batch_engine(
    target, method: str = "draft", draft=None, *, max_batch_size: int = 8, max_len: int | None = None,
    num_speculative_tokens: int | None = None, options: DraftOptions = DraftOptions(), drafter=None,
    policy=None, acceptance=acceptance_for, prefill_chunk: int | None = None, plain_when_faster: bool = False,
) -> BatchEngine:
    """A :class:`BatchEngine` for ``method`` (ar, draft, ngram, hybrid, early-exit, medusa,
    prophet, eagle or hybrid-eagle; ``options`` sets the n-gram sizes, the exit head and
    layer, the heads, and a ``draft_stop`` that sets chain lengths, each row's own): the
    method's batch drafter (or ``drafter``, the hook for new ones) and, when
    ``num_speculative_tokens`` is None, the batch policy measured for this target, drafter
    and batch size (``policy`` replaces it; a head method's rows draft its fixed k,
    ``drafters/per_row.py``; hybrid-eagle's that k alone, its EAGLE chain's beside other
    rows, :class:`~quickdraft.policy.batch_policy.LoneRowK`); ``prefill_chunk``: prompt
    tokens prefilled per step (:class:`BatchEngine`). ``plain_when_faster``: a head
    method's k is a default, not the caller's to keep: with several rows the engine decodes
    plainly where its own steps measure that faster
    (:class:`~quickdraft.policy.batch_policy.PlainWhenFaster`)."""
    from .policy.batch_policy import BatchPolicy, LoneRowK, PlainWhenFaster

    stop = parse_draft_stop(options.draft_stop)
    if stop.stops_mid_chain:
        # A batched drafter drafts every row's chain in one pass: a row cannot stop midway.
        raise ValueError(f"--draft-stop {options.draft_stop} ends a chain token by token, which batched rows do "
                         "not; use --draft-stop heuristic (each row's chain follows its acceptance) or fixed")
    if drafter is None:
        drafter = make_batch_drafter(method, draft, target, max_batch_size, cache_length(target, max_len), options)
    if num_speculative_tokens is None:  # a drafter whose k the batch policy cannot measure yet
        num_speculative_tokens = getattr(drafter, "fixed_k", None)
    if method == "hybrid-eagle" and policy is None and num_speculative_tokens:
        # k for a lone row; with more, prompt lookup proposes no longer than the EAGLE chain.
        chain = hybrid_eagle_chain(options.tree)
        policy, num_speculative_tokens = LoneRowK(num_speculative_tokens, min(num_speculative_tokens, chain)), None
    if plain_when_faster and method in HEAD_BATCH_K and (isinstance(policy, LoneRowK)
                                                         or (policy is None and num_speculative_tokens)):
        policy, num_speculative_tokens = PlainWhenFaster(policy or num_speculative_tokens), None
    engine = BatchEngine(target, drafter, max_batch_size=max_batch_size, max_len=max_len,
                         num_speculative_tokens=num_speculative_tokens, policy=policy, acceptance=acceptance,
                         draft_stop=None if isinstance(stop, FixedStop) else lambda: parse_draft_stop(options.draft_stop),
                         prefill_chunk=prefill_chunk)
    if policy is None and num_speculative_tokens is None and method != "ar":
        engine.policy = BatchPolicy.for_engine(engine)
    return engine


def generate_many(gen, requests: Sequence[Request], batch_size: int = 8,
                  num_speculative_tokens: int | None = None) -> list:
    """Generate every request with continuous batching (at most ``batch_size`` rows at a
    time; a finished row's place goes to the next request). ``num_speculative_tokens``
    None lets the batch policy choose k per batch size. Returns one ``Generation`` per
    request, in order."""

    check_count(batch_size, "batch_size", 1)
    method, draft, options = batch_method(gen.drafter)
    switch = num_speculative_tokens is None and method in HEAD_BATCH_K
    if switch:
        # A head method's rows have no batch policy: they draft the generator's k (the cost
        # model's, settled as for one prompt), not HEAD_BATCH_K (EAGLE: 6 where SmolLM2 pays at 2),
        # or decode plainly where that measures faster with several rows.
        num_speculative_tokens = gen.settled_k()
    encoded = []
    for req in requests:
        stats = GenerationStats()
        ids = gen._start(req.prompt, req.max_new_tokens, req.truncate_prompt, stats)
        encoded.append((ids, stats))
    if not encoded:
        return []
    longest = max(ids.numel() + req.max_new_tokens for (ids, _), req in zip(encoded, requests))
    engine = make_batch_engine(gen.target, method, draft, max_batch_size=min(batch_size, len(requests)),
                               max_len=longest + MAX_BATCH_K + 1, num_speculative_tokens=num_speculative_tokens,
                               options=options, plain_when_faster=switch)
    waiting = deque(range(len(requests)))
    running: dict[int, int] = {}  # engine row -> request index
    tokens: list[list[int]] = [[] for _ in requests]
    stats: list[GenerationStats | None] = [None] * len(requests)
    while waiting or running:
        while waiting and engine.free_slots:
            i = waiting.popleft()
            req = requests[i]
            stop = StopConditions(req.max_new_tokens, gen.eos_token_ids, req.stop, gen.tokenizer)
            running[engine.add(encoded[i][0], req.sampling, stop)] = i
        for row, update in engine.step().items():
            if update.error:  # offline, a failed row fails the run (the server fails that request alone)
                raise SamplingError(f"request {running[row]}: {update.error}")
            i = running[row]
            tokens[i].extend(update.tokens)
            if update.finish:
                update.stats.truncated_prompt_tokens = encoded[i][1].truncated_prompt_tokens
                stats[i] = update.stats
                del running[row]
    out = []
    for req, ids, st in zip(requests, tokens, stats):
        text = gen.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        out.append(Generation(cut_at_stop(text, req.stop), ids, st))
    return out


#: Per-line settings a prompts file may give (the rest come from the command line).
LINE_KEYS = ("prompt", "id", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")


def _setting(line: dict, key: str, default, kind, ok, requirement: str, where: str):
    value = line.get(key, default)
    if value is default:
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) or not ok(value):
        raise ValueError(f"{where}: \"{key}\" must be {requirement}, got {json_text(value)}")
    return value


def json_text(value) -> str:
    import json

    return json.dumps(value)[:40]


def read_prompts_file(path, defaults: Request, seed: int | None) -> list[tuple[Request, dict]]:
    """The requests of a JSONL file (one object per line: "prompt", optional "id",
    "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop"; blank lines are
    skipped), each with the settings it ends up with. ``defaults`` holds the command
    line's settings. Bad input is a one-line ValueError naming the line."""
    from .jsonl import read_objects

    out = []
    for where, line in read_objects(path, "prompts file"):
        unknown = sorted(set(line) - set(LINE_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; a line may have {', '.join(LINE_KEYS)}")
        if not isinstance(line.get("prompt"), str) or not line["prompt"]:
            raise ValueError(f"{where}: needs a non-empty \"prompt\" string")
        d = defaults.sampling
        max_new = _setting(line, "max_new_tokens", defaults.max_new_tokens, int, lambda v: v >= 1, "an integer >= 1", where)
        temperature = _setting(line, "temperature", d.temperature, float, lambda v: v >= 0, "a number >= 0", where)
        top_k = _setting(line, "top_k", d.top_k, int, lambda v: v >= 0, "an integer >= 0", where)
        top_p = _setting(line, "top_p", d.top_p, float, lambda v: 0 < v <= 1, "a number in (0, 1]", where)
        row_seed = _setting(line, "seed", seed, int, lambda v: True, "an integer", where)
        stop = line.get("stop", defaults.stop)
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"{where}: \"stop\" must be a string or a list of strings")
        params = SamplingParams(temperature, top_k, top_p, row_seed)
        request = Request(line["prompt"], max_new, params, [s for s in stop if s], defaults.truncate_prompt)
        settings = {"max_new_tokens": max_new, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                    "seed": row_seed, "stop": request.stop}
        if "id" in line:
            settings["id"] = line["id"]
        out.append((request, settings))
    if not out:
        raise ValueError(f"prompts file {path} has no prompts")
    return out
