"""What the methods of one benchmark run share: the loaded models, the tokenizer, the EOS
ids, the transformers copies of the models and the prompts' token ids."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.lm import CausalLM, eos_token_ids
from ..models.placement import Placement
from .call_counter import CallCounter
from .config import BenchConfig, BenchError, needs_draft
from .prompts import BenchPrompt


class BenchContext:
    """The loaded models (our handles; transformers models lazily), the tokenizer, the EOS
    ids, and timings the methods keep across runs (``prefill_timings``)."""

    def __init__(self, target: CausalLM, tokenizer, draft: CausalLM | None = None,
                 target_dir: Path | None = None, draft_dir: Path | None = None) -> None:
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.target_dir = Path(target_dir or target.model_dir)
        self.draft_dir = Path(draft_dir or draft.model_dir) if (draft_dir or draft is not None) else None
        self.eos_token_ids = eos_token_ids(target, tokenizer)
        self.placement = Placement()  # where the transformers copies go: the models' own
        self._hf: dict[str, object] = {}
        self.counters: dict[str, CallCounter] = {}
        # seconds of each prompt's prefill, per transformers row (see HFMethod)
        self.prefill_timings: dict[tuple, list[float]] = {}
        self.llama_cpp = None  # the llama.cpp rows' binaries and GGUF files (llama_cpp.setup)
        self.chat_prompts: set[str] = set()  # ids of the run's chat prompts (auto's row decodes them as chats)

    def hf_model(self, which: str):
        """The transformers model ("target" or "draft") loaded from the same directory, on
        the same device and in the same dtype as ours, its forward calls counted in ``counters[which]``."""
        if which not in self._hf:
            from ..models.lm import load_hf_model
            from ..models.shared_embed import shared_tensors

            path = self.target_dir if which == "target" else self.draft_dir
            if path is None:
                raise BenchError("hf-assisted needs a draft model; pass --draft")
            placement = self.placement
            # a draft sharing the target's embeddings takes them from the loaded target
            shared = shared_tensors(path, self.target) if which == "draft" else None
            model = load_hf_model(path, placement.dtype, shared).to(placement.device).eval()
            self.counters[which] = CallCounter(model)
            self._hf[which] = model
        return self._hf[which]


def load_context(config: BenchConfig) -> BenchContext:
    """Load the target (default: the embedded default), its tokenizer and, when a method of
    ``config`` needs one, the draft (default: the embedded paired draft), as the generator
    does (:func:`~quickdraft.pair.load_pair`: same backend choice and fallback to
    transformers, same tokenizer check)."""
    from ..pair import load_pair

    placement = config.placement()
    pair = load_pair(config.model, config.draft, needs_draft(config.methods), config.backend,
                     draft_vocab=config.draft_vocab, placement=placement)
    ctx = BenchContext(pair.target, pair.tokenizer, pair.draft, pair.target_dir, pair.draft_dir)
    ctx.placement = placement
    return ctx


def chat_ids(ctx: BenchContext, prompt: BenchPrompt) -> list[int]:
    """A chat prompt's ids through the model's own template (as ``generate --chat`` renders
    it); every row, transformers' included, gets these ids."""
    from ..chat import ChatTemplateError, chat_prompt_ids

    try:
        return chat_prompt_ids(ctx.tokenizer, prompt.messages, str(ctx.target_dir.name))
    except ChatTemplateError as exc:
        raise BenchError(f"chat prompt {prompt.id}: {exc}; leave out the chat category "
                         "(--categories) for a model without one") from None


def stop_at_end_of_turn(ctx: BenchContext) -> None:
    """Add the chat template's end-of-turn tokens to the ids that end a generation, as
    ``generate --chat`` does (for every prompt of the run: the rows must stop alike)."""
    from ..chat import end_of_turn_ids

    ctx.eos_token_ids = list(dict.fromkeys([*ctx.eos_token_ids, *end_of_turn_ids(ctx.tokenizer)]))


@dataclass
class EncodedPrompt:
    """A prompt's token ids as run, and whether its beginning was cut to fit the context."""

    ids: torch.Tensor
    tokens: int  # before truncation
    truncated: bool

    @property
    def dropped(self) -> int:
        return self.tokens - int(self.ids.numel())


def encode_prompts(ctx: BenchContext, prompts: Sequence[BenchPrompt], room: int) -> list[EncodedPrompt]:
    """Token ids of every prompt. A prompt that leaves less than ``room`` tokens of the
    model's context for generation keeps its end (as ``--truncate-prompt`` does), so every
    row generates the same number of tokens; the truncation is recorded."""
    limit = ctx.target.context_length - room
    if limit < 1:
        raise BenchError(
            f"--max-new-tokens leaves no room for a prompt in the model's {ctx.target.context_length}-token context"
        )
    out = []
    for p in prompts:
        if p.is_chat:
            ids = chat_ids(ctx, p)
        else:
            ids = ctx.tokenizer(p.prompt)["input_ids"] or [ctx.eos_token_ids[0] if ctx.eos_token_ids else 0]
        kept = ids[-limit:]  # keep the end: it is what the continuation depends on
        out.append(EncodedPrompt(torch.tensor(kept, dtype=torch.long), len(ids), len(kept) < len(ids)))
    return out
