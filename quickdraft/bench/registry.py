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
return one row per setting to compare (e.g. one per k). A decoding method's name (one of
:data:`quickdraft.drafters.factory.METHODS`) takes whether it needs the draft model from that
table; for another name pass ``needs_draft=True`` when it uses ``ctx.draft``, so the bench
loads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from . import config as bench_config
from .config import BenchConfig, BenchError, register_method
from .context import BenchContext
from .methods import EngineMethod, HFMethod, Method

MethodFactory = Callable[[BenchContext, BenchConfig, int], list[Method]]


def make_rows(ctx: BenchContext, config: BenchConfig, methods: Sequence[str], k: int) -> list[Method]:
    """The rows of these methods, duplicates (same label) dropped."""
    rows: list[Method] = []
    for name in methods:
        method = bench_config.BENCH_METHODS[name]
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
                help="draft-model speculative decoding, at k and every --sweep k")
register_method("hf-ar", lambda ctx, config, k: [HFMethod("hf-ar")],
                help="transformers generate(), plain")
register_method("hf-assisted", lambda ctx, config, k: [HFMethod("hf-assisted", k)],
                needs_draft=True, help="transformers generate() with assistant_model (same draft and k)")
register_method("hf-lookup", lambda ctx, config, k: [HFMethod("hf-lookup", k, lookup=3)],
                help="transformers generate() with prompt_lookup_num_tokens=k (n-grams up to 3, as ngram's)")



def _llama_cpp_rows(speculative: bool) -> MethodFactory:
    def factory(ctx, config, k):
        from . import llama_cpp

        return (llama_cpp.speculative_rows if speculative else llama_cpp.plain_rows)(ctx, config, k)

    return factory


register_method("llama.cpp", _llama_cpp_rows(False),
                help="llama.cpp's llama-completion, plain greedy, same weights as GGUF (--llama-cpp DIR)")
register_method("llama.cpp-spec", _llama_cpp_rows(True), needs_draft=True,
                help="llama.cpp's llama-speculative-simple with the same draft, at each --llama-cpp-draft-max")


# Token trees, multi-draft and n-gram drafting (issue 10): one row per setting worth comparing.
def _drafter_rows(method: str, variants: list[dict]) -> MethodFactory:
    """Rows of ``method`` built by ``make_drafter``; a variant's ``rule`` (spectr) only
    applies when sampling and is skipped for greedy runs. A variant's ``k`` replaces the
    run's k (an adaptive ``draft_stop`` drafts up to it; ``"profile"``: the skip profile's),
    and its ``draft_stop`` is any ``--draft-stop`` policy, so policies combine with every
    chain method."""
    from ..drafters import DraftOptions, make_drafter

    def factory(ctx, config, k):
        rows = []
        for settings in variants:
            rule = settings.get("rule", "mss")
            if rule != "mss" and config.temperature == 0:
                continue
            options = DraftOptions(**{key: v for key, v in settings.items() if key not in ("rule", "k")},
                                   draft_vocab=config.draft_vocab)
            row_k = _variant_k(ctx, settings.get("k", k), options)
            rows.append(EngineMethod(
                method, lambda c, o=options, n=row_k: _bound(make_drafter(
                    method, c.draft, c.target.vocab_size, o, target=c.target), c, n), row_k,
                settings={"k": row_k, **{key: v for key, v in settings.items() if key != "k"}},
                acceptance=lambda params, r=rule: r))
        return rows

    return factory


def _variant_k(ctx, k, options) -> int:
    if k != "profile":
        return k
    from ..drafters.layer_skip import load_profile

    return load_profile(ctx.target, options.skip_profile).k


def _bound(drafter, ctx, k):
    from ..generator import bind_step_costs

    bind_step_costs(drafter, ctx.target, ctx.tokenizer, k)  # the cost policy's step costs
    return drafter


def _with_datastore_off(method: str) -> MethodFactory:
    """``method``'s row, and beside a target with a shipped datastore the row without it."""

    def factory(ctx, config, k):
        from ..drafters.datastore import shipped_datastore

        variants = [{"ngram_max": 3}]
        if shipped_datastore(ctx.target) is not None:
            variants.append({"ngram_max": 3, "datastore": "none"})
        return _drafter_rows(method, variants)(ctx, config, k)

    return factory


register_method("ngram", _with_datastore_off("ngram"),
                help="prompt lookup over prompt + output, else the target's datastore (no draft model)")
register_method("tree", _drafter_rows("tree", [{"tree": "2,1,1"}, {"tree": "2,2,1"}, {"tree": "dynamic:6"}]),
                help="the draft model expands a token tree")
register_method("multi-draft", _drafter_rows("multi-draft", [{"num_drafts": 2}, {"num_drafts": 2, "rule": "spectr"}]),
                help="sampled drafts merged into one tree (mss; spectr when sampling)")
register_method("hybrid", _with_datastore_off("hybrid"),
                help="n-gram continuation (prompt, else datastore) when one matches, else the draft model")



def _medusa_rows(ctx, config, k):
    """Medusa with the heads shipped for the target: a chain (one candidate per head) and
    two trees, each as deep as the heads go."""
    from ..drafters.medusa import shipped_medusa

    if shipped_medusa(ctx.target) is None:
        raise BenchError("--methods medusa needs Medusa heads shipped for this target (the embedded target has "
                         "them); train some with `quickdraft train heads --kind medusa --target ...`")
    return _drafter_rows("medusa", [{"tree": "1,1,1,1", "k": 4}, {"tree": "2,2,1,1", "k": 4},
                                    {"tree": "3,2,2,1", "k": 4}])(ctx, config, k)


register_method("medusa", _medusa_rows, help="Medusa heads on the target's final state propose a token tree")


def _prophet_rows(ctx, config, k):
    """The prophet shipped for the target, at the run's k and at the k it was trained for."""
    from ..drafters.prophet import shipped_prophet
    from ..models.prophet import read_prophet_config

    path = shipped_prophet(ctx.target)
    if path is None:
        raise BenchError("--methods prophet needs a prophet shipped for this target (the embedded target has "
                         "one); train one with `quickdraft train heads --kind prophet --target ...`")
    gamma = read_prophet_config(path).gamma
    return _drafter_rows("prophet", [{"k": s} for s in sorted({k, gamma})])(ctx, config, k)


register_method("prophet", _prophet_rows, help="a prophet transformer drafts a chain from the target's last states")


def _eagle_rows(ctx, config, k):
    """The EAGLE drafter shipped for the target: chains of 1, 2, 5 and the run's k, chains
    whose length adapts (``--draft-stop heuristic`` and ``dv``, up to 12), and two dynamic
    trees (EAGLE-2). Short chains are there for targets whose verify pass costs nearly k + 1
    times a step (SmolLM2's int4 kernels are compute-bound): there, one EAGLE token ahead
    gained 1.09x (chat) / 1.25x (code) over plain decoding where a chain of 5 lost."""
    _need_shipped_eagle(ctx, "eagle")
    chains = sorted({1, 2, 5, max(k, 1)})  # and one as long as the run's k (the draft model's), when longer
    return _drafter_rows("eagle", [*({"tree": ",".join(["1"] * n), "k": n} for n in chains),
                                   {"draft_stop": "heuristic", "k": 12},  # a chain of 1-12, as acceptance goes
                                   {"draft_stop": "dv", "k": 12},  # ... or as the drafter's confidence goes
                                   {"tree": "dynamic:8", "k": 6},
                                   {"tree": "dynamic:12", "k": 6}])(ctx, config, k)


register_method("eagle", _eagle_rows, help="an EAGLE feature drafter grows a dynamic token tree (EAGLE-2)")


def _need_shipped_eagle(ctx, method: str) -> None:
    from ..drafters.eagle import shipped_eagle

    if shipped_eagle(ctx.target) is None:
        raise BenchError(f"--methods {method} needs an EAGLE drafter shipped for this target (the embedded target "
                         "has one); train one with `quickdraft train heads --kind eagle --target ...`")


def _hybrid_eagle_rows(ctx, config, k):
    """The n-gram's continuation (up to 4 or 6 tokens) where one matches, else the shipped
    EAGLE drafter's chain of 1 or 2."""
    _need_shipped_eagle(ctx, "hybrid-eagle")
    return _drafter_rows("hybrid-eagle", [{"tree": "1", "k": 4}, {"tree": "1,1", "k": 4},
                                          {"tree": "1,1", "k": 6}])(ctx, config, k)


register_method("hybrid-eagle", _hybrid_eagle_rows,
                help="n-gram continuation when one matches, else the EAGLE drafter's chain")

ADAPTIVE_STOPS = ["confidence:0.7", "dv", "heuristic", "cost"]


# Early exit (issue 11): the shared head and every head shipped for the target, each with
# and without sharing the target's KV cache (the A/B of what sharing saves in verification),
# each at the k the early-exit cost model picks for it (up to -k where given, else up to
# what generate's early-exit k goes to); then the trained head (shared KV) with the
# adaptive draft-stop policies, drafting up to 12.
def _early_exit_rows(ctx, config, k):
    from ..drafters.early_exit import SHARED, EarlyExitDrafter, resolve_exit_head, shipped_heads
    from ..policy.exit_layer import EXIT_MAX_K, measure_exit_layer

    heads = [str(path) for path in shipped_heads(ctx.target)]
    layer = resolve_exit_head(ctx.target, None, None).exit_layer  # the shipped head's layer, else the default
    rows = []
    for spec in [SHARED, *heads]:
        head = (resolve_exit_head(ctx.target, spec, layer) if spec == SHARED else
                resolve_exit_head(ctx.target, spec, None, config.draft_vocab))
        for share in (True, False):
            most = EXIT_MAX_K if config.k is None else min(config.k, EXIT_MAX_K)
            head_k = measure_exit_layer(ctx.target, ctx.tokenizer, {head.exit_layer: head}, max_k=most,
                                        share_kv=share, repeats=3).k
            settings = {"k": head_k, "L": head.exit_layer, "head": head.kind, "kv": "shared" if share else "own"}
            rows.append(EngineMethod("early-exit", lambda c, h=head, s=share: EarlyExitDrafter(c.target, h, share_kv=s),
                                     head_k, settings=settings))
    stops = [{"draft_stop": s, "k": 12} for s in ADAPTIVE_STOPS if s != "cost"]  # cost: draft models only
    return rows + _drafter_rows("early-exit", stops)(ctx, config, k)


register_method("early-exit", _early_exit_rows,
                help="the target's first L layers + an exit head (shared head and each shipped head; "
                     "with and without sharing the KV cache)")

class AutoMethod(EngineMethod):
    """``--method auto`` as users get it: the choice for completions, and for the run's chat
    prompts (``ctx.chat_prompts``) the choice measured on chats, as ``generate --chat`` and
    the server's ``--auto-for chat`` decode them."""

    def __init__(self, completion: EngineMethod, chat: EngineMethod | None) -> None:
        settings = dict(completion.settings)
        if chat is not None:
            settings["chats"] = chat.settings["chose"]
        super().__init__("auto", None, max(completion.k or 0, chat.k or 0 if chat else 0) or None, settings)
        self.speculative = completion.speculative or (chat is not None and chat.speculative)
        self.completion, self.chat = completion, chat

    def run(self, ctx, prompt, max_new_tokens, params, prompt_key=""):
        chat = self.chat is not None and prompt_key.removeprefix("warm-up:") in ctx.chat_prompts
        return (self.chat if chat else self.completion).run(ctx, prompt, max_new_tokens, params, prompt_key)


def _auto_rows(ctx, config, k):
    """The method, k and tree the cost model picks for this pair and machine (cached, as
    ``--method auto`` uses it), per kind of prompt where the run has chats; k here is the
    chosen one, not the run's."""
    from ..chat import has_chat_template
    from ..resolve import resolve_method

    def row(kind: str) -> EngineMethod:
        plan = resolve_method(ctx.target, ctx.draft, ctx.tokenizer, "auto", kind=kind)
        factory = (lambda c: plan.drafter(c.draft, c.target)) if plan.method != "ar" else None
        return EngineMethod("auto", factory, plan.k, settings={"chose": plan.choice.label})

    chats = bool(ctx.chat_prompts) and has_chat_template(ctx.tokenizer)
    return [AutoMethod(row("completion"), row("chat") if chats else None)]


register_method("auto", _auto_rows,
                help="the method, k and tree the cost model picks for this pair and machine")


# Layer skip and draft-stop policies (issue 11). Adaptive policies draft up to 12 (Draft &
# Verify's max) and stop sooner; the variants' draft_stop combines with any chain method.
register_method("draft-stop", _drafter_rows("draft", [{"draft_stop": s, "k": 12} for s in ADAPTIVE_STOPS]),
                needs_draft=True, help="the draft model with each adaptive --draft-stop policy (up to 12 tokens)")
register_method("layer-skip", _drafter_rows("layer-skip", [{"k": "profile"}, {"draft_stop": "dv", "k": 12},
                                                         {"draft_stop": "heuristic", "k": 12}]),
                help="the target drafts for itself with its tuned skip profile (fixed k, dv and heuristic)")
