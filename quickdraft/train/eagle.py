"""The EAGLE drafter's loss and held-out check (``quickdraft train heads --kind eagle``).

Self-distilled from the frozen target: per unrolled step ``k`` of the training-time test
(:meth:`~quickdraft.models.eagle.EagleHead.unrolled`), feature regression (SmoothL1 of the
drafter's output against the target's own final state there at unit RMS, EAGLE-1) plus soft
cross-entropy against the target's distribution over the draft vocabulary, weighted
``0.8 ** k`` (EAGLE-3: deeper steps are less sure). The vocabulary for a reduced LM head is
the most frequent tokens of the training text (:mod:`quickdraft.models.draft_vocab`). A
drafter narrower than the target (``--from-draft``) has no target-width output to regress:
soft cross-entropy alone, as in EAGLE-3.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..models.eagle import EagleHead, unit_rms
from .data import answer_runs, batch_parts, masked_mean, window_runs

STEP_DECAY = 0.8  # loss weight of unrolled step k: STEP_DECAY ** k


def frequent_tokens(stream: np.ndarray, vocab_size: int, size: int) -> tuple[torch.Tensor | None, float]:
    """The ``size`` most frequent token ids of ``stream`` (ties: lower id) and the share of
    the stream they cover; ``(None, 1.0)`` for ``size`` 0 or the whole vocabulary."""
    if size == 0 or size >= vocab_size:
        return None, 1.0
    counts = np.bincount(stream, minlength=vocab_size)
    ranking = np.argsort(-counts, kind="stable")[:size]
    return torch.as_tensor(np.sort(ranking), dtype=torch.long), float(counts[ranking].sum() / max(counts.sum(), 1))


def vocab_cover(stream: np.ndarray, ids: torch.Tensor | None) -> float:
    """The share of ``stream`` that a draft vocabulary ``ids`` (None: all) covers."""
    if ids is None:
        return 1.0
    return float(np.isin(stream, ids.cpu().numpy()).mean()) if stream.size else 0.0


def teacher_probs(head: EagleHead, t_logits: torch.Tensor) -> torch.Tensor:
    """The target's probabilities over the draft vocabulary ``[B, T, V']`` (mass of other
    tokens dropped: the drafter cannot propose them)."""
    probs = F.softmax(t_logits.float(), dim=-1)
    return probs if head.vocab_ids is None else probs[..., head.vocab_ids]


def eagle_loss(head: EagleHead, target, tokens: torch.Tensor, t_logits: torch.Tensor, features: torch.Tensor,
               steps: int, reg_weight: float, ce_weight: float, blind: torch.Tensor | None = None,
               runs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted loss of ``steps`` unrolled steps over windows ``tokens`` ``[B, T]``, with
    the target's logits and final states there; and each step's soft CE for the log.
    ``blind`` ``[B]``: windows the drafter reads with zero features, as the first round
    drafts before the prefill (their targets stay the target's). ``runs`` ``[B, T + 1]``
    (:func:`~.data.answer_runs` of the windows and their next token; None: every place
    counts): step k at place p counts where the token it predicts and the k drafted before
    it are answer tokens."""
    teacher = teacher_probs(head, t_logits)
    total = features.new_zeros(())
    logs = {}
    inputs = features if blind is None else features.masked_fill(blind[:, None, None], 0.0)
    for k, out in enumerate(head.unrolled(tokens, inputs, target, steps)):
        mask = None if runs is None else runs[:, k + 1 :] >= k + 1  # places k .. T - 1
        logp = F.log_softmax(head.sub_logits(out[:, k:], target).float(), dim=-1)
        ce = masked_mean(-(teacher[:, k:] * logp).sum(-1), mask)
        loss = ce_weight * ce
        if not head.own_width:  # a narrow layer's output is no target feature: nothing to regress
            final = features[:, k:, -out.shape[-1]:]  # a fused drafter's states end with the final one
            regress = F.smooth_l1_loss(out[:, k:], unit_rms(final), reduction="none").mean(-1)  # the drafter's scale
            loss = loss + reg_weight * masked_mean(regress, mask)
        total = total + STEP_DECAY ** k * loss
        logs[f"ce{k}"] = ce.item()
        # Top-1 agreement with the target (what greedy verification accepts): the soft CE
        # alone hides how much of it is the target's own entropy.
        logs[f"top1_{k}"] = masked_mean((logp.argmax(-1) == teacher[:, k:].argmax(-1)).float(), mask).item()
    return total, logs


def make_eagle_loss(states, steps: int, reg_weight: float, ce_weight: float, blind_share: float = 0.0):
    """The trainer's ``loss_fn`` (``states``: :class:`~quickdraft.train.heads.TargetStates`);
    ``blind_share`` of the windows, drawn each step, are read with zero features. Given
    :class:`~.data.Windows`, the loss counts answer tokens alone (:func:`eagle_loss`)."""
    def loss_fn(head: EagleHead, batch):
        windows, answers = batch_parts(batch)
        tokens = windows[:, :-1]
        t_logits, features = states(tokens)
        blind = torch.rand(tokens.shape[0]) < blind_share if blind_share > 0 else None
        return eagle_loss(head, states.target, tokens, t_logits, features, steps, reg_weight, ce_weight,
                          None if blind is None else blind.to(features.device),
                          None if answers is None else answer_runs(answers))

    return loss_fn


@torch.no_grad()
def eagle_agreement(head: EagleHead, states, stream: np.ndarray, seq_len: int, max_tokens: int,
                    steps: int, answers: np.ndarray | None = None) -> list[float]:
    """Top-1 agreement of each unrolled step with the target's greedy token, on held-out
    windows: step ``k``'s is the chance a tree node at depth ``k`` (its ancestors right)
    has the target's choice as its first candidate. ``answers`` (a flag per token of
    ``stream``): only where the loss counts (:func:`eagle_loss`), the target's answers."""
    hits, counts = torch.zeros(steps, device=states.device), torch.zeros(steps, device=states.device)
    for start in range(0, min(stream.size - 1, max_tokens), seq_len):
        window = states.window(stream, start, seq_len)
        if window.shape[1] < steps + 1:
            break
        runs = None if answers is None else window_runs(answers, start, window.shape[1], states.device)
        t_logits, features = states(window)
        greedy = t_logits.argmax(-1)
        for k, out in enumerate(head.unrolled(window, features, states.target, steps)):
            guess = head.logits(out[:, k:], states.target).argmax(-1)
            agree = guess == greedy[:, k:]
            if runs is not None:
                mask = runs[:, k + 1 :] >= k + 1
                agree, guess = agree & mask, guess[mask]
            hits[k] += agree.sum()
            counts[k] += guess.numel()
    return (hits / counts.clamp(min=1)).tolist()
