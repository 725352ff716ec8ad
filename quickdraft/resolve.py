"""What a method name means for one loaded pair on this machine: THE place methods are
resolved, for the Python API, the CLI, the server and the bench alike.

``auto`` becomes the method, k and tree the cost model picks (measured once, cached; a
head method it picks gets its heads loaded as below);
``early-exit`` without a head shipped for the target gets the exit layer the cost model
predicts fastest; ``medusa``, ``prophet``, ``eagle`` and ``hybrid-eagle`` get their heads loaded (once,
shared by every drafter of the plan); every other method is taken as given. The k a request decodes with is
settled afterwards, once, by :meth:`~quickdraft.generator.SpeculativeGenerator.resolve_k`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from .drafters import METHODS, DraftOptions, make_drafter
from .models.lm import CausalLM, NativeLM
from .policy.method_choice import MethodChoice


@dataclass(frozen=True)
class MethodPlan:
    """A resolved method: never ``auto``, with the options that shape its drafter."""

    method: str
    options: DraftOptions = DraftOptions()
    choice: MethodChoice | None = None  # what auto chose and why (None: not auto)

    def drafter(self, draft: CausalLM | None, target: CausalLM):
        """The method's drafter for this target and draft."""
        return make_drafter(self.method, draft, target.vocab_size, self.options, target=target)

    @property
    def label(self) -> str:
        """How settings report the method: ``draft``, or ``auto: tree 2,2,1``."""
        if self.choice is None:
            return self.method
        return f"auto: {self.choice.label if self.choice.method == 'tree' else self.choice.method}"

    @property
    def k(self) -> int | None:
        """The k auto chose with the method (at least 1; None when not auto or plain)."""
        if self.choice is None or self.method == "ar":
            return None
        return max(self.choice.k, 1)


def resolve_method(
    target: CausalLM,
    draft: CausalLM | None,
    tokenizer,
    method: str,
    options: DraftOptions = DraftOptions(),
    *,
    remeasure: bool = False,
    log: Callable[[str], None] | None = None,
    kind: str = "completion",
) -> MethodPlan:
    """Resolve ``method`` for this target and draft (see the module docstring); ``log`` gets
    a line before a measurement, ``remeasure`` measures auto's choice again, ``kind``: the
    requests auto's choice is for (``completion`` or ``chat``,
    :func:`~quickdraft.policy.method_choice.calibration_ids`)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    if method == "early-exit":
        return MethodPlan(method, exit_layer_by_cost_model(target, tokenizer, options))
    if method == "medusa":  # loaded once: every drafter of the plan (a server's rows) shares them
        from .drafters.medusa import load_heads

        return MethodPlan(method, dataclasses.replace(options, heads=load_heads(target, options.heads)))
    if method == "prophet":  # loaded once, like Medusa's heads
        from .drafters.prophet import load_prophet_for

        prophet = load_prophet_for(target, options.heads, options.draft_vocab)
        return MethodPlan(method, dataclasses.replace(options, heads=prophet))
    if method in ("eagle", "hybrid-eagle"):
        from .drafters.eagle import load_eagle_head

        head = load_eagle_head(target, options.heads, options.draft_vocab)
        return MethodPlan(method, dataclasses.replace(options, heads=head))
    if method != "auto":
        return MethodPlan(method, options)
    from .policy.method_choice import cached_method

    choice = cached_method(target, draft, tokenizer, remeasure=remeasure, log=log, kind=kind)
    if choice.method in ("medusa", "prophet", "eagle", "hybrid-eagle"):  # their heads, loaded as above
        plan = resolve_method(target, draft, tokenizer, choice.method, choice.options())
        return dataclasses.replace(plan, choice=choice)
    return MethodPlan(choice.method, choice.options(), choice)


def exit_layer_by_cost_model(target: CausalLM, tokenizer, options: DraftOptions) -> DraftOptions:
    """Early exit with no head shipped for the target and no exit layer given: the shared
    head at the layer the cost model predicts to be fastest (measured briefly here)."""
    from .drafters.early_exit import SHARED, shipped_head

    if options.exit_layer is not None or options.exit_head not in (None, SHARED) or not isinstance(
            target, NativeLM) or shipped_head(target) is not None:
        return options
    from .policy.exit_layer import measure_exit_layer

    choice = measure_exit_layer(target, tokenizer, max_k=4, calibration_tokens=32, repeats=3)
    return dataclasses.replace(options, exit_layer=choice.layer)
