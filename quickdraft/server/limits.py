"""How much one request may ask for, checked before any work is done for it.

Without these bounds ``n: 1000000`` built a million jobs (20 s, +1.2 GB) before the queue
refused them, and a 100,000-string prompt list was tokenized (5 s) before anything looked
at it; meanwhile the event loop served nobody, ``/health`` included.
"""

from __future__ import annotations

from dataclasses import dataclass


class LimitError(ValueError):
    """A request over a limit: ``param`` names the field to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    """Per-request bounds (`quickdraft serve --max-n --max-prompts --max-request-tokens`)."""

    max_n: int = 16
    max_prompts: int = 32
    max_request_tokens: int = 65536  # prompts + completions over every choice

    def check_shape(self, n: int, prompts: int, generations_allowed: int) -> None:
        """Before tokenizing: the choices per prompt, the prompts, and the generations
        (prompts x n) against what the server can hold (rows + queue)."""
        if n > self.max_n:
            raise LimitError(f"n is {n} but this server allows at most {self.max_n} choices per prompt "
                             "(--max-n)", "n")
        if prompts > self.max_prompts:
            raise LimitError(f"the prompt list has {prompts} prompts but this server takes at most "
                             f"{self.max_prompts} per request (--max-prompts)", "prompt")
        if n * prompts > generations_allowed:
            raise LimitError(f"this request asks for {n * prompts} generations but the server holds at most "
                             f"{generations_allowed} (--max-batch-size + --max-queue); lower n or send "
                             "fewer prompts", "n")

    def check_tokens(self, prompt_lengths: list[int], budgets: list[int], n: int, param: str) -> None:
        """After tokenizing, before queueing: every choice's prompt and completion budget."""
        total = n * (sum(prompt_lengths) + sum(budgets))
        if total > self.max_request_tokens:
            raise LimitError(f"this request may take {total} tokens (prompts + max_tokens, times n) but this "
                             f"server allows {self.max_request_tokens} per request (--max-request-tokens); "
                             "lower max_tokens or n, or shorten the prompts", param)
