"""One server's models, engine, scheduler and app state from `quickdraft serve`'s options:
what `quickdraft serve` runs in its process, and what each Ray Serve replica runs."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..cli import CliError, choose_k, draft_options, notice, set_default_method

if TYPE_CHECKING:  # imported when a server loads, not when the CLI parses its options
    from .app import ServerState
    from .scheduler import Scheduler


def make_engine(
    choice: str,
    target,
    method: str,
    draft,
    max_batch_size: int,
    k: int | None,
    explicit_k: bool,
    options,
    acceptance: str,
    prefill_chunk: int | None = None,
    plain_when_faster: bool = False,
):
    """The engine for these settings: the batched one where it supports them (``choice``
    auto or batch), else :class:`~quickdraft.server.solo_engine.SoloEngine`.
    ``plain_when_faster``: ``make_batch_engine``'s (k is a head method's default, not -k)."""
    from ..batch_generate import make_batch_engine
    from ..drafters.draft_stop import parse_draft_stop
    from ..drafters.factory import BATCH_METHODS
    from .solo_engine import SoloEngine

    why_not = None
    if method not in BATCH_METHODS:
        why_not = f"the batched engine runs {', '.join(BATCH_METHODS)}, not {method}"
    elif target.backend != "native" or (draft is not None and draft.backend != "native"):
        why_not = "the batched engine needs the native runtime"
    elif parse_draft_stop(options.draft_stop).stops_mid_chain:
        why_not = f"batched rows cannot end a chain token by token (--draft-stop {options.draft_stop}); heuristic can"
    if choice == "batch" and why_not:
        raise CliError(f"--engine batch: {why_not}; use --engine solo or auto")
    if choice != "solo" and why_not is None:
        engine = make_batch_engine(
            target,
            method,
            draft,
            max_batch_size=max_batch_size,
            num_speculative_tokens=k if explicit_k else None,
            options=options,
            prefill_chunk=prefill_chunk,
            plain_when_faster=plain_when_faster,
        )
        engine.name = "batch"
        return engine
    return SoloEngine(
        target,
        method=method,
        draft=draft,
        max_batch_size=max_batch_size,
        num_speculative_tokens=k,
        options=options,
        acceptance=acceptance,
    )


@dataclass
class LoadedServer:
    """One server's engine and app state, built from `quickdraft serve`'s options: what
    `quickdraft serve` runs, and what each Ray Serve replica runs (``ray_serve.py``)."""

    state: ServerState
    scheduler: Scheduler
    k: int | None
    k_source: str | None


def auto_for(args: argparse.Namespace, gen, log: Callable[[str], None]):
    """``--method auto``'s generator for the requests ``--auto-for`` names (default:
    completions): one engine serves both endpoints, with one choice."""
    from ..chat import has_chat_template

    if gen.method_choice is None or getattr(args, "auto_for", None) != "chat":
        return gen
    if not has_chat_template(gen.tokenizer):
        raise CliError(f"--auto-for chat: {gen.target.model_dir.name} has no chat template; "
                       "use --auto-for completion")
    return gen.for_chats(log=log)


def load_server(args: argparse.Namespace, log: Callable[[str], None] = notice) -> LoadedServer:
    """Load the models, choose k, build the engine, its scheduler and the app's state."""
    import torch

    from .. import __version__
    from ..drafters.per_row import HEAD_BATCH_K
    from ..generator import SpeculativeGenerator
    from ..quiet import quiet_transformers
    from .app import ServerState
    from .auth import guard_settings
    from .metrics import ServerMetrics
    from .scheduler import Scheduler

    set_default_method(args, serving=True)
    if getattr(args, "auto_for", None) is not None and args.method != "auto":
        raise CliError("--auto-for goes with --method auto")  # before anything loads
    if args.threads:
        torch.set_num_threads(args.threads)
    options = draft_options(args)
    with quiet_transformers():
        gen = SpeculativeGenerator.from_pretrained(
            args.model,
            args.draft,
            args.method,
            args.backend,
            options,
            args.multi_draft_rule,
            remeasure=args.remeasure,
            log=log,
            draft_vocab=args.draft_vocab,
            device=getattr(args, "device", None),
            dtype=getattr(args, "dtype", None),
            quantize=getattr(args, "quantize", None),
            kv_cache=getattr(args, "kv_cache", None),
            kind=getattr(args, "auto_for", None) or "completion",
        )
    gen = auto_for(args, gen, log)
    k, k_source = choose_k(args, gen)
    plan = gen.plan
    # -k and auto's k hold at every batch size; otherwise the batched engine's own policy
    # picks k per batch size. A head method's batched rows have no such policy (they drafted
    # their fixed HEAD_BATCH_K: EAGLE chains of 6 on SmolLM2 while the cost model, and this
    # server's banner, said 2): they draft the k settled here, or, with several rows, none
    # where the engine measures plain steps faster (unless -k asks for that k throughout).
    head_default = plan.method in HEAD_BATCH_K and k is not None and args.num_speculative_tokens is None
    fixed_k = args.num_speculative_tokens is not None or plan.choice is not None or head_default
    engine = make_engine(
        args.engine,
        gen.target,
        plan.method,
        gen.draft,
        args.max_batch_size,
        k,
        fixed_k,
        plan.options,
        args.multi_draft_rule,
        prefill_chunk=getattr(args, "prefill_chunk", 0) or None,
        plain_when_faster=head_default,
    )
    policy = getattr(engine, "policy", None)
    if hasattr(policy, "prior") and gen.k_choice is not None and gen.k_choice.per_position:
        # The batch policy drafts under a generic prior until it has measured 64 draft
        # tokens; the pair's acceptance measured by the cost model is a better one: with it
        # a lone stream starts at generate's k instead of a lower one.
        policy.prior = list(gen.k_choice.per_position)
    name = args.served_model_name or args.model or gen.target.model_dir.name
    settings = {
        "method": plan.label,
        "num_speculative_tokens": k,
        "num_speculative_tokens_source": k_source,
        "engine": engine.name,
        "max_batch_size": args.max_batch_size,
        "max_queue": args.max_queue,
        "backend": gen.target.backend,
        "fingerprint": f"quickdraft-{__version__}-{plan.method}",
    }
    metrics = ServerMetrics(name, draft_positions=k or 0)
    scheduler = Scheduler(engine, metrics, args.max_queue)
    state = ServerState(
        name,
        gen.tokenizer,
        gen.eos_token_ids,
        gen.target.context_length,
        gen.target.vocab_size,
        scheduler,
        metrics,
        settings,
        args.chat_max_tokens,
        args.max_body_bytes,
        int(time.time()),
        **guard_settings(args),
    )
    return LoadedServer(state, scheduler, k, k_source)
