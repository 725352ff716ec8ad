"""The contract of drafters that read the target (heads): both loops hand them the target's
hidden states of every token the target has seen and accepted, exactly once, in order,
taken from the verify passes (no extra pass), equal to a fresh pass over the sequence."""

from __future__ import annotations

import pytest
import torch

from quickdraft.batch_generate import make_batch_engine
from quickdraft.decoding.engine import decode
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.stats import GenerationStats
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftOptions, make_drafter
from quickdraft.drafters.batched import make_batch_drafter
from quickdraft.models.lm import HIDDEN_STATES_NEED_NATIVE, NativeLM, load_model

PROMPTS = ["def add(a, b):\n", "for i in range(10):\n    print(i, i * i)\n" * 3, "x"]


class Reader:
    """A real drafter that also reads the target: it proposes as ``inner`` does and records
    what ``observe`` hands it, per slot, as (start, {layer: states})."""

    def __init__(self, inner, layers: tuple[int, ...]) -> None:
        self.inner, self.reads_hidden, self.name = inner, layers, inner.name
        self.seen: dict[int, list[tuple[int, dict[int, torch.Tensor]]]] = {}

    def verify_width(self, k):
        return self.inner.verify_width(k)

    def join(self, slot, prompt, params, generator, max_len):
        self.seen[slot] = []
        self.inner.join(slot, prompt, params, generator, max_len)

    def propose(self, slots, sequences, ks):
        return self.inner.propose(slots, sequences, ks)

    def verified(self, slot, length, path):
        self.inner.verified(slot, length, path)

    def observe(self, slot, start, states):
        self.seen[slot].append((start, {layer: s.clone() for layer, s in states.items()}))

    def leave(self, slot):
        self.inner.leave(slot)


def check_states(target: NativeLM, sequence: list[int], seen, layers) -> None:
    """``seen`` covers positions 0 .. len(sequence) - 2 once, in order (the last token is not
    yet fed), and equals a fresh pass of the target over them."""
    starts = [start for start, _ in seen]
    sizes = [next(iter(states.values())).shape[0] for _, states in seen]
    assert starts == [sum(sizes[:i]) for i in range(len(sizes))] and sum(sizes) == len(sequence) - 1
    fresh = NativeLM(target.model)
    fresh.reset()
    fresh.extend(torch.tensor(sequence[:-1]), logits="none", output_hidden_states=layers)
    for layer in layers:
        got = torch.cat([states[layer] for _, states in seen])
        torch.testing.assert_close(got, fresh.hidden_states[layer], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("method,params", [("draft", SamplingParams()), ("tree", SamplingParams(0.8, seed=3))])
def test_batch_one_hands_the_accepted_tokens_states(models, method, params):
    tok, target, drafts = models
    layers = (1, target.config.n_layers)  # a middle layer (EAGLE-3 fuses a few) and the final state
    options = DraftOptions(tree="2,2,1")
    for text in PROMPTS[:2]:
        ids = torch.tensor(tok(text)["input_ids"])
        plain_stats, read_stats = GenerationStats(), GenerationStats()
        expected = [t for s in decode(target, ids, StopConditions(20, []), make_drafter(
            method, drafts["perturbed"], target.vocab_size, options), params, 3, stats=plain_stats) for t in s.tokens]
        reader = Reader(make_drafter(method, drafts["perturbed"], target.vocab_size, options), layers)
        out = [t for s in decode(target, ids, StopConditions(20, []), reader, params, 3, stats=read_stats)
               for t in s.tokens]
        assert out == expected  # reading changes nothing...
        assert read_stats.target_forward_passes == plain_stats.target_forward_passes  # ...and costs no pass
        assert read_stats.accepted_tokens > 0  # accepted tokens were handed over, not only plain steps
        check_states(target, ids.tolist() + out, reader.seen[0], layers)


def test_batched_rows_each_get_their_own_states(models):
    tok, target, drafts = models
    layers = (target.config.n_layers,)
    inner = make_batch_drafter("draft", drafts["perturbed"], target, 3, 512)
    reader = Reader(inner, layers)
    engine = make_batch_engine(target, max_batch_size=3, num_speculative_tokens=3, drafter=reader)
    prompts = [torch.tensor(tok(text)["input_ids"]) for text in PROMPTS]
    rows = {engine.add(ids, SamplingParams(), StopConditions(16, [])): i for i, ids in enumerate(prompts[:2])}
    out: dict[int, list[int]] = {}
    steps = 0
    while engine.active:
        if steps == 2:  # a row joining later is prefilled in its own pass
            rows[engine.add(prompts[2], SamplingParams(), StopConditions(16, []))] = 2
        slots = {row: engine._rows[row].slot for row in engine._rows}
        for row, update in engine.step().items():
            out.setdefault(rows[row], []).extend(update.tokens)
            if update.finish:
                check_states(target, prompts[rows[row]].tolist() + out[rows[row]], reader.seen[slots[row]], layers)
        steps += 1
    assert sorted(out) == [0, 1, 2]


def test_the_transformers_backend_says_it_cannot(tiny_family):
    target = load_model(tiny_family["target"], "hf")
    target.reset()
    with pytest.raises(ValueError, match="native runtime"):
        target.extend(torch.tensor([1, 2]), output_hidden_states=(1,))
    assert "--backend native" in HIDDEN_STATES_NEED_NATIVE
