"""The benchmark's methods by name (``quickdraft bench --methods NAME,...``).

Adding a method is one call::

    from quickdraft.bench.methods import EngineMethod
    from quickdraft.bench.registry import register_method

    def ngram_rows(ctx, config, k):
        return [EngineMethod("ngram", lambda ctx: NgramDrafter(...), k)]

    register_method("ngram", ngram_rows, help="prompt lookup, no draft model")

A factory ``factory(ctx, config, k)`` gets the :class:`~.context.BenchContext` (models,
tokenizer), the run's :class:`~.config.BenchConfig` and the run's k (given or the cost
model's choice), and returns the method's rows: objects with the :class:`~.methods.Method`
interface, usually :class:`~.methods.EngineMethod` (our decode loop with a drafter and
optionally an acceptance rule). Rows are told apart by their ``label`` (name + settings):
return one row per setting to compare (e.g. one per k). Pass ``needs_draft=True`` when the
method uses the draft model (``ctx.draft``), so the bench loads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .config import BenchConfig, BenchError
from .context import BenchContext
from .methods import EngineMethod, HFMethod, Method

MethodFactory = Callable[[BenchContext, BenchConfig, int], list[Method]]


@dataclass(frozen=True)
class BenchMethod:
    """A registered method: its rows' factory and whether it needs the draft model."""

    name: str
    factory: MethodFactory
    needs_draft: bool = False
    help: str = ""


BENCH_METHODS: dict[str, BenchMethod] = {}


def register_method(name: str, factory: MethodFactory, *, needs_draft: bool = False,
                    help: str = "") -> None:
    """Make ``name`` a benchmark method whose rows ``factory(ctx, config, k)`` returns."""
    BENCH_METHODS[name] = BenchMethod(name, factory, needs_draft, help)


def needs_draft(methods: Sequence[str]) -> bool:
    """Whether any of these methods uses the draft model."""
    return any(BENCH_METHODS[m].needs_draft for m in methods if m in BENCH_METHODS)


def make_rows(ctx: BenchContext, config: BenchConfig, methods: Sequence[str], k: int) -> list[Method]:
    """The rows of these methods, duplicates (same label) dropped."""
    rows: list[Method] = []
    for name in methods:
        method = BENCH_METHODS[name]
        if method.needs_draft and ctx.draft is None:
            raise BenchError(f"method {name!r} needs a draft model; pass --draft PATH")
        rows.extend(method.factory(ctx, config, k))
    seen: set[str] = set()
    return [r for r in rows if not (r.label in seen or seen.add(r.label))]


def _draft_drafter(ctx: BenchContext):
    from ..drafters import DraftModelDrafter

    return DraftModelDrafter(ctx.draft, ctx.target.vocab_size)


register_method("ar", lambda ctx, config, k: [EngineMethod("ar", None)],
                help="plain decoding (our loop): the baseline of every speedup")
register_method("draft", lambda ctx, config, k: [EngineMethod("draft", _draft_drafter, s)
                                                 for s in sorted({k, *config.sweep})],
                needs_draft=True, help="draft-model speculative decoding, at k and every --sweep k")
register_method("hf-ar", lambda ctx, config, k: [HFMethod("hf-ar")],
                help="transformers generate(), plain")
register_method("hf-assisted", lambda ctx, config, k: [HFMethod("hf-assisted", k)],
                needs_draft=True, help="transformers generate() with assistant_model (same draft and k)")


# Token trees, multi-draft and n-gram drafting (issue 10): one row per setting worth comparing.
def _drafter_rows(method: str, variants: list[dict]) -> MethodFactory:
    """Rows of ``method`` built by ``make_drafter``; a variant's ``rule`` (spectr) only
    applies when sampling and is skipped for greedy runs."""
    from ..drafters import DraftOptions, make_drafter

    def factory(ctx, config, k):
        rows = []
        for settings in variants:
            rule = settings.get("rule", "mss")
            if rule != "mss" and config.temperature == 0:
                continue
            options = DraftOptions(**{key: v for key, v in settings.items() if key != "rule"})
            rows.append(EngineMethod(
                method, lambda c, o=options: make_drafter(method, c.draft, c.target.vocab_size, o), k,
                settings={"k": k, **settings}, acceptance=lambda params, r=rule: r))
        return rows

    return factory


register_method("ngram", _drafter_rows("ngram", [{"ngram_max": 3}]),
                help="prompt lookup over prompt + output (no draft model)")
register_method("tree", _drafter_rows("tree", [{"tree": "2,1,1"}, {"tree": "2,2,1"}, {"tree": "dynamic:6"}]),
                needs_draft=True, help="the draft model expands a token tree")
register_method("multi-draft", _drafter_rows("multi-draft", [{"num_drafts": 2}, {"num_drafts": 2, "rule": "spectr"}]),
                needs_draft=True, help="sampled drafts merged into one tree (mss; spectr when sampling)")
register_method("hybrid", _drafter_rows("hybrid", [{"ngram_max": 3}]), needs_draft=True,
                help="n-gram continuation when one matches, else the draft model")


def _auto_rows(ctx, config, k):
    """The method, k and tree the cost model picks for this pair and machine (cached, as
    ``--method auto`` uses it); k here is the chosen one, not the run's."""
    from .method_choice import cached_method

    choice = cached_method(ctx.target, ctx.draft, ctx.tokenizer)
    factory = (lambda c: choice.drafter(c.draft, c.target.vocab_size)) if choice.method != "ar" else None
    return [EngineMethod("auto", factory, choice.k or None, settings={"chose": choice.label})]


register_method("auto", _auto_rows, needs_draft=True,
                help="the method, k and tree the cost model picks for this pair and machine")
