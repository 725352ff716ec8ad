"""``--method auto``: the cost model picks the method, k and tree shape for a pair and machine.

Acceptance is measured once, by *replaying* greedy decoding instead of running every
candidate. On calibration prompts the target decodes greedily (the reference output); one
teacher-forced pass of the draft over prompt + output gives, at every position, the rank of
the target's token among the draft's logits. Greedy acceptance of any candidate then
follows exactly from the ranks, with the correlation between neighbouring positions kept:

- a chain of k accepts the run of rank-0 positions, at most k;
- a full static tree ``<w1, w2, ...>`` with top-w children accepts depth d when the target's
  token at depth j is among the draft's top ``w_j`` for every j < d (each level of such a
  tree holds the top-w children of the accepted path's node, whichever path it was);
- prompt lookup replays :class:`~quickdraft.drafters.ngram.NgramDrafter` on the reference;
- hybrid takes the n-gram proposal when there is one, else the draft chain;
- the head methods with heads shipped for the target (Medusa, prophet, EAGLE, and beside
  an EAGLE drafter hybrid-eagle) cannot be replayed from ranks: they are run on the same
  prompts, their drafting timed (:mod:`.head_choice`).

Each replayed step costs what the engine will spend on it: the draft passes
(:meth:`StepCosts.t_drafting`) plus one target pass over the proposal + 1, from costs
measured on this machine
(:func:`~quickdraft.policy.autok.measure_step_costs`), each in the regime the candidate
decodes in (:func:`regime`): a draft model's candidates with verify passes timed after a
draft burst (which evicts the target's weights from the CPU caches: SmolLM2's 2-token pass
1.30 plain steps there, 0.98-1.06 after plain steps), prompt lookup and the head methods
with passes timed after plain steps. The candidate with the highest
predicted speedup wins. Sampled decoding accepts less than greedy: the choice is made for
greedy and used for both (docs/methods.md, "Choosing a method: `--method auto`").

Prompts of two kinds are calibrated apart (``kind``): completions (code and prose,
:data:`~quickdraft.policy.autok.CALIBRATION_PROMPTS`) and, for a model with a chat
template, chats (:data:`CHAT_CALIBRATION` through the template, ending at its end of turn):
an instruct model's replies are another text than its completions (SmolLM2: prompt lookup
1.5x plain decoding on code, 0.97x on chat), so each kind gets its own choice and cache
entry.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..chat import chat_prompt_ids, end_of_turn_ids
from ..decoding.engine import decode
from ..decoding.stopping import StopConditions
from ..drafters.datastore import TOKENS_FILE, shipped_datastore
from ..drafters.factory import DraftOptions, ngram_drafter
from ..drafters.ngram import NgramDrafter
from ..models.lm import CausalLM, eos_token_ids
from . import cache
from .autok import CALIBRATION_PROMPTS, measure_quiet_step_costs, measurement_source
from .cost_model import StepCosts
from .head_choice import (
    HEAD_SHAPES,
    head_methods_weighed,
    measure_head_method,
    shipped_head_methods,
)
from .timing import Noise

#: Static tree shapes auto considers (the chain is ``draft``).
TREE_SHAPES = ((2,), (2, 1), (2, 1, 1), (2, 2, 1), (3, 1, 1), (2, 1, 1, 1), (2, 2, 1, 1),
               (2, 1, 1, 1, 1), (3, 2, 1), (2, 1, 1, 1, 1, 1))
MAX_K = 12
#: The requests ``kind="chat"`` is calibrated on: user messages through the model's chat
#: template (its default system prompt, if any, included).
CHAT_CALIBRATION = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is, in two or three sentences.",
    "Give me three tips for writing clear commit messages.",
    "What is the difference between a list and a tuple in Python?",
)
KINDS = ("completion", "chat")


def calibration_ids(tokenizer, kind: str = "completion") -> list[list[int]]:
    """The calibration prompts of ``kind`` as token ids: completions tokenized as they are,
    chats rendered with the tokenizer's chat template."""
    if kind not in KINDS:
        raise ValueError(f"unknown calibration kind {kind!r}; use {' or '.join(KINDS)}")
    if kind == "chat":
        return [chat_prompt_ids(tokenizer, [{"role": "user", "content": text}]) for text in CHAT_CALIBRATION]
    return [tokenizer(text, verbose=False)["input_ids"] for text in CALIBRATION_PROMPTS]
CACHE_VERSION = 15  # 2: verify passes no longer padded to the drafter's width; 3: keyed by policy.cache;
#                   4: no token trees for a transformers-backend pair; 5: shipped head methods weighed;
#                   6: EAGLE one token ahead weighed too (HEAD_SHAPES); 7: an int8 EAGLE
#                   drafter, its chains without tree masks, and its chain of 5 weighed;
#                   8: plain steps timed after plain steps, verify passes after draft bursts;
#                   9: n-gram lookups of 2+ tokens; 10: plain steps timed after 16 plain steps;
#                   11: hybrid-eagle weighed beside a shipped EAGLE drafter;
#                   12: n-gram and head methods priced with draft-free step costs;
#                   13: n-gram and hybrid search the target's shipped datastore,
#                   hybrid-eagle's n-gram matches 3+ tokens; 14: t_ar a plain greedy chain's token;
#                   15: EAGLE chains of 2 and 3 weighed too


@dataclass(frozen=True)
class Candidate:
    """One configuration: ``method`` with ``k`` draft tokens (tree: ``tree`` widths)."""

    method: str
    k: int
    tree: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        if self.method == "tree":
            return f"tree {','.join(map(str, self.tree))}"
        shape = f" tree={','.join(map(str, self.tree))}" if self.tree else ""  # a head method's own shape
        return f"{self.method} k={self.k}{shape}"

    @property
    def nodes(self) -> int:
        """Most tokens one proposal holds (the verify width is this + 1)."""
        if self.method == "tree":
            return sum(math.prod(self.tree[: d + 1]) for d in range(len(self.tree)))
        return self.k


@dataclass
class Trace:
    """A calibration prompt, the target's greedy continuation, and at each continuation
    position the rank of the target's token among the draft's logits (0 = the draft's argmax)."""

    prompt: list[int]
    output: list[int]
    ranks: list[int]


def record_trace(target: CausalLM, draft: CausalLM, prompt: torch.Tensor, new_tokens: int, eos: list[int]) -> Trace:
    """Greedy reference output of the target and the draft's rank of each of its tokens."""
    output: list[int] = []
    for step in decode(target, prompt, StopConditions(new_tokens, eos)):
        output.extend(step.tokens)
    sequence = torch.cat([prompt, torch.tensor(output, dtype=torch.long)])
    draft.reset(sequence.numel() + 1)
    logits = draft.extend(sequence[:-1], logits=len(output)) if output else torch.empty(0, 1)
    logits = logits[:, : target.vocab_size]
    chosen = logits.gather(1, torch.tensor(output, dtype=torch.long)[:, None])
    ranks = (logits > chosen).sum(1).tolist()
    return Trace(prompt.tolist(), output, ranks)


def _accepted(candidate: Candidate, trace: Trace, t: int, ngram: NgramDrafter) -> tuple[int, int, int]:
    """Replay one step at output position ``t``: (accepted tokens, draft passes, proposed
    tokens)."""
    ranks, n = trace.ranks, len(trace.output)
    room = n - t - 1  # the engine never drafts past the budget
    if candidate.method in ("ngram", "hybrid"):
        k = min(candidate.k, room)
        sequence = torch.tensor(trace.prompt + trace.output[:t], dtype=torch.long)
        proposal = ngram.lookup(sequence, k).tokens.tolist() if k > 0 else []
        if proposal:
            accepted = 0
            while accepted < len(proposal) and proposal[accepted] == trace.output[t + accepted]:
                accepted += 1
            return accepted, 0, len(proposal)
        if candidate.method == "ngram":
            return 0, 0, 0
    widths = candidate.tree if candidate.method == "tree" else (1,) * candidate.k
    depth = min(len(widths), room)
    if depth <= 0:
        return 0, 0, 0
    accepted = 0
    while accepted < depth and ranks[t + accepted] < widths[accepted]:
        accepted += 1
    return accepted, depth, sum(math.prod(widths[: d + 1]) for d in range(depth))


def replay(candidate: Candidate, trace: Trace, ngram: NgramDrafter | None = None) -> list[tuple[int, int, int]]:
    """The steps greedy decoding with ``candidate`` takes on ``trace``: per step (accepted
    draft tokens, draft passes, tokens proposed). Exact for greedy decoding: as many steps
    as the engine's target passes."""
    ngram = ngram or NgramDrafter()
    steps, t = [], 0
    while t < len(trace.output):
        step = _accepted(candidate, trace, t, ngram)
        steps.append(step)
        t += step[0] + 1
    return steps


def replay_speedup(candidate: Candidate, traces: Sequence[Trace], costs: StepCosts,
                   ngram: NgramDrafter | None = None) -> tuple[float, float]:
    """(predicted speedup over plain decoding, tokens per target pass) of ``candidate``
    on the traces, with the engine's costs: draft passes plus a verify pass over the
    proposal + 1 (a step that proposes nothing is a plain 1-token pass)."""
    seconds = tokens = passes = 0.0
    for trace in traces:
        for _, draft_passes, proposed in replay(candidate, trace, ngram):
            seconds += costs.t_drafting(draft_passes) if draft_passes else 0.0
            seconds += costs.t_verify(proposed + 1)
            passes += 1
        tokens += len(trace.output)
    if not seconds:
        return 1.0, 1.0
    return tokens * costs.t_ar / seconds, tokens / passes


#: The methods whose steps run a draft model: their verify passes follow a draft burst.
DRAFT_MODEL_METHODS = frozenset({"draft", "hybrid", "tree"})


def regime(method: str) -> str:
    """Which step costs price ``method``: ``"draft"`` (passes timed after a draft model's
    burst) for the methods that run the draft model, ``"free"`` (after plain steps) for
    prompt lookup and the head methods, which never touch it."""
    return "draft" if method in DRAFT_MODEL_METHODS else "free"


def candidates(max_k: int = MAX_K, with_draft: bool = True, trees: bool = True) -> list[Candidate]:
    """What auto weighs: n-gram, and with a draft the chain, hybrid and (``trees``: only the
    native runtime verifies a tree) token trees, at each k up to ``max_k``."""
    out = [Candidate("ngram", k) for k in range(1, max_k + 1)]
    if with_draft:
        out += [Candidate("draft", k) for k in range(1, max_k + 1)]
        out += [Candidate("hybrid", k) for k in range(1, max_k + 1)]
        if trees:
            out += [Candidate("tree", len(w), w) for w in TREE_SHAPES if len(w) <= max_k]
    return out


@dataclass
class MethodChoice:
    """What auto chose, and the predictions that chose it (``table``: label -> (speedup, tau))."""

    method: str
    k: int
    tree: tuple[int, ...]
    predicted: float
    table: dict[str, tuple[float, float]] = field(default_factory=dict)
    costs: StepCosts | None = None  # the draft-model candidates' (without a draft: every candidate's)
    free_costs: StepCosts | None = None  # prompt lookup's and the head methods' (:func:`regime`)
    measured: bool = True
    path: Path | None = None
    noise: Noise | None = None  # how noisy the step-cost timings were (None: read from the cache)
    measured_at: str | None = None
    kind: str = "completion"  # the calibration prompts' kind (KINDS)

    @property
    def label(self) -> str:
        return Candidate(self.method, self.k, self.tree).label

    def options(self) -> DraftOptions:
        """The chosen method's options (a tree's children: the draft's top-w, as replayed; a
        head method's defaults, as measured)."""
        if self.method in HEAD_SHAPES:
            return DraftOptions(tree=",".join(map(str, self.tree)) if self.tree else None)
        return DraftOptions(tree=",".join(map(str, self.tree)) or "2,2,1", tree_children="top")

    def best_per_method(self) -> dict[str, tuple[str, float, float]]:
        """The best candidate of each method: method -> (label, speedup, tau)."""
        best: dict[str, tuple[str, float, float]] = {}
        for label, (speedup, tau) in self.table.items():
            method = label.split()[0]
            if method not in best or speedup > best[method][1]:
                best[method] = (label, speedup, tau)
        return best

    def summary(self) -> str:
        """One line: the choice, the best of every other method, where it came from."""
        others = ", ".join(f"{label} {s:.2f}x" for m, (label, s, _) in
                           sorted(self.best_per_method().items(), key=lambda kv: -kv[1][1])
                           if m != self.method)
        source = measurement_source(self.measured, self.measured_at, self.path)
        kind = " for chats" if self.kind == "chat" else ""
        return (f"auto chose {self.label}{kind} (predicted {self.predicted:.2f}x; best of the others: {others}; "
                f"{source})")

    def to_json(self) -> dict:
        return {"method": self.method, "k": self.k, "tree": list(self.tree), "predicted": self.predicted,
                "table": {k: list(v) for k, v in self.table.items()},
                "step_costs": self.costs.to_dict() if self.costs else None,
                "free_step_costs": self.free_costs.to_dict() if self.free_costs else None}

    @classmethod
    def from_json(cls, data: dict, path: Path | None = None) -> MethodChoice:
        return cls(str(data["method"]), int(data["k"]), tuple(int(w) for w in data["tree"]),
                   float(data["predicted"]), {k: (float(v[0]), float(v[1])) for k, v in data["table"].items()},
                   StepCosts.from_dict(data["step_costs"]) if data.get("step_costs") else None,
                   StepCosts.from_dict(data["free_step_costs"]) if data.get("free_step_costs") else None,
                   measured=False, path=path, measured_at=data.get("measured_at"))


def choose_method(target: CausalLM, draft: CausalLM | None, tokenizer,
                  prompts: Sequence[str | Sequence[int]] = CALIBRATION_PROMPTS, new_tokens: int = 96,
                  max_k: int = MAX_K, ngram: NgramDrafter | None = None,
                  log: Callable[[str], None] | None = None, stop_ids: Sequence[int] = ()) -> MethodChoice:
    """Replay greedy decoding on ``prompts`` (texts, or token ids) for every candidate and
    pick the fastest predicted one (see the module docstring). Without a draft only n-gram
    and plain decoding compete. ``stop_ids`` end a reference output as EOS does (a chat's
    end of turn). Step-cost timings too noisy to trust are taken again (``log`` gets a
    line each time); ``noise`` says how noisy the kept ones were."""
    eos = [*eos_token_ids(target, tokenizer), *stop_ids]
    ngram = ngram or ngram_drafter("ngram", DraftOptions(), target)  # what --method ngram and hybrid search
    traces = []
    for prompt in prompts:
        text_ids = tokenizer(prompt, verbose=False)["input_ids"] if isinstance(prompt, str) else list(prompt)
        ids = torch.tensor(text_ids, dtype=torch.long)
        if draft is None:
            output = [t for s in decode(target, ids, StopConditions(new_tokens, eos)) for t in s.tokens]
            traces.append(Trace(ids.tolist(), output, [1] * len(output)))
        else:
            traces.append(record_trace(target, draft, ids, new_tokens, eos))
    longest = max(traces, key=lambda tr: len(tr.prompt) + len(tr.output))
    context = torch.tensor(longest.prompt + longest.output, dtype=torch.long)
    trees = all(lm.backend == "native" for lm in (target, draft) if lm is not None)
    weighed = candidates(max_k, draft is not None, trees)
    widths = sorted({*range(1, max_k + 2), *(c.nodes + 1 for c in weighed)})  # every full tree's pass
    # Each candidate is priced in the regime it decodes in (:func:`regime`): timed after a
    # draft burst, a verify pass can cost a third more than after plain steps.
    costs, noise = measure_quiet_step_costs(target, draft, context, widths, repeats=5, log=log)
    free_costs = costs
    if draft is not None:
        free_costs, free_noise = measure_quiet_step_costs(target, None, context, widths, repeats=5, log=log)
        noise = max(noise, free_noise, key=lambda n: n.spread / n.limit)
    priced = {"draft": costs, "free": free_costs}
    table = {c.label: replay_speedup(c, traces, priced[regime(c.method)], ngram) for c in weighed}
    # Head methods cannot be replayed from ranks: they are run (policy/head_choice.py).
    prompt_ids = [torch.tensor(tr.prompt, dtype=torch.long) for tr in traces]
    for method in head_methods_weighed(shipped_head_methods(target)):
        for k, tree in HEAD_SHAPES[method]:
            head = Candidate(method, k, tree)
            weighed.append(head)
            table[head.label] = measure_head_method(method, k, target, prompt_ids, [tr.output for tr in traces],
                                                    priced[regime(method)], tree=tree)
    table["ar"] = (1.0, 1.0)
    by_label = {c.label: c for c in weighed}
    best = max(table, key=lambda label: table[label][0])
    chosen = by_label.get(best, Candidate("ar", 0))
    return MethodChoice(chosen.method, chosen.k, chosen.tree, table[best][0], table, costs, free_costs,
                        noise=noise)


def shipped_datastore_id(target: CausalLM) -> str | None:
    """The datastore ``--method ngram`` and ``hybrid`` search beside ``target`` (name and
    digest; part of auto's cache key), or None."""
    path = shipped_datastore(target)
    return None if path is None else f"{path.name}@{cache.file_digest(path / TOKENS_FILE)[:16]}"


def cached_method(target: CausalLM, draft: CausalLM | None, tokenizer, remeasure: bool = False,
                  log: Callable[[str], None] | None = None, kind: str = "completion") -> MethodChoice:
    """:func:`choose_method` for this pair and machine on the calibration prompts of
    ``kind`` (:func:`calibration_ids`), cached next to the auto-k choices (``--remeasure``
    measures again). A choice whose timings stayed too noisy is used but not cached
    (``log`` says so)."""
    log = log or (lambda msg: None)
    calibration = calibration_ids(tokenizer, kind)
    entry = cache.entry("method", CACHE_VERSION, {"target": target, "draft": draft if draft else "none"},
                        calibration=cache.digest(calibration), heads=shipped_head_methods(target),
                        datastore=shipped_datastore_id(target))
    if entry is not None and not remeasure:
        data = entry.load()
        if data is not None:
            try:
                cached = MethodChoice.from_json(data, entry.path)
            except (ValueError, KeyError, TypeError, AttributeError):
                cached = None  # not what this version writes: measure again
            if cached is not None:
                cached.kind = kind
                return cached
    log(f"measuring which method is fastest for this pair on this machine{' for chats' if kind == 'chat' else ''}, "
        f"once ({f'cached in {entry.path}' if entry is not None else 'not cached'}; --remeasure redoes it)")
    stop_ids = end_of_turn_ids(tokenizer) if kind == "chat" else ()
    choice = choose_method(target, draft, tokenizer, calibration, log=log, stop_ids=stop_ids)
    choice.measured_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    choice.kind = kind
    if choice.noise is not None and choice.noise.noisy:
        log(f"not caching the method choice: {choice.noise.describe()} (is the machine busy?); "
            "used for this run only, measured again next time")
    elif entry is not None:
        try:
            entry.store({**choice.to_json(), "measured_at": choice.measured_at})
            choice.path = entry.path
        except OSError as exc:
            log(f"could not write the method cache ({exc.strerror or exc}); the choice is not cached")
    return choice
