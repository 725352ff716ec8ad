"""Host synchronisations per decode step, counted on the CPU.

On a GPU every read of a device tensor from the host (``.item()``, ``.tolist()``,
``int()``/``float()``/``bool()`` of a tensor, a copy to the CPU, ``nonzero``) waits for the
GPU to finish. Here the models' outputs are tagged as if they lived on a device
(:class:`OnDevice`, a tensor subclass whose tag follows every result computed from
them), and each host read of a tagged tensor is counted. A step may read the device once
to learn what the target accepted (the argmax, or the probabilities copied to the
sampler on the CPU), plus once per token a model drafter chooses on the host. The same
tag catches what would fail on a GPU: a CPU generator drawing from a device tensor, or
an op mixing device and host tensors. ``tests/test_gpu.py`` counts the real thing with
``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import pytest
import torch

from quickdraft.decoding.engine import decode
from quickdraft.decoding.sampling import SamplingParams
from quickdraft.decoding.stopping import StopConditions
from quickdraft.drafters import DraftModelDrafter, make_drafter
from quickdraft.drafters.ngram import NgramDrafter
from quickdraft.models import cpu_kernels
from quickdraft.models.lm import load_model
from quickdraft.pair import load_tokenizer

#: Tensor methods that read a tensor's values on the host (a GPU sync), by name.
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero", "cpu"}
#: Ops where a host tensor beside a device tensor is fine on a GPU (CPU index tensors).
INDEXING = {"__getitem__", "__setitem__", "index_select", "index_put_", "index_copy_", "gather"}


class OnDevice(torch.Tensor):
    """A CPU tensor standing for one on a GPU: host reads and device mix-ups are recorded."""

    reads: list[str] = []
    errors: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        to_host = name == "cpu" or (name == "to" and _to_cpu(args[1:], kwargs))
        if name in HOST_READS or to_host:
            cls.reads.append(name)
        elif "generator" in kwargs and kwargs["generator"] is not None:
            cls.errors.append(f"{name}: a CPU generator drawing from a device tensor")
        elif name not in INDEXING and _mixes(args):
            cls.errors.append(f"{name}: device and host tensors mixed")
        out = super().__torch_function__(func, types, args, kwargs)
        if to_host and isinstance(out, OnDevice):
            out = out.as_subclass(torch.Tensor)  # now a host tensor: reading it is free
        return out


def _to_cpu(args, kwargs) -> bool:
    device = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
    return device is not None and torch.device(device).type == "cpu"


def _mixes(args) -> bool:
    flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]
    host = [a for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, OnDevice) and a.dim() > 0]
    return bool(host) and any(isinstance(a, OnDevice) for a in flat)


class OnDeviceLM:
    """A CausalLM whose logits and hidden states are tagged :class:`OnDevice`."""

    def __init__(self, lm) -> None:
        self.__dict__["lm"] = lm

    def __getattr__(self, name):
        return getattr(self.lm, name)

    def extend(self, *args, **kwargs):
        out = self.lm.extend(*args, **kwargs)
        return None if out is None else out.as_subclass(OnDevice)

    @property
    def hidden_states(self):
        return {i: s.as_subclass(OnDevice) for i, s in self.lm.hidden_states.items()}


def reads_per_step(target, drafter, ids, k, params=SamplingParams(), n=24) -> list[int]:
    """Host reads of device tensors in each step of one generation (the first includes the
    prefill); fails on anything that would not run on a GPU."""
    OnDevice.reads.clear()
    OnDevice.errors.clear()
    counts, before = [], 0
    for _ in decode(target, ids, StopConditions(n), drafter=drafter, params=params, num_speculative_tokens=k):
        counts.append(len(OnDevice.reads) - before)
        before = len(OnDevice.reads)
    assert not OnDevice.errors, OnDevice.errors[:3]
    return counts


@pytest.fixture(scope="module")
def pair(tiny_family):
    tok = load_tokenizer(tiny_family["target"])
    target = OnDeviceLM(load_model(tiny_family["target"]))
    draft = OnDeviceLM(load_model(tiny_family["perturbed"]))
    ids = torch.tensor(tok("def add(a, b):\n    return")["input_ids"])
    return target, draft, ids


def test_the_tag_counts_what_a_gpu_would_wait_for():
    t = torch.randn(4, 6).as_subclass(OnDevice)
    OnDevice.reads.clear()
    t.argmax(-1).tolist(), int(t.argmax()), float(t[0, 0]), bool((t > 0).any())
    host = t.softmax(-1).to("cpu")
    host.sum().item()  # a host tensor: free
    assert OnDevice.reads == ["tolist", "__int__", "__float__", "__bool__", "to"]
    OnDevice.errors.clear()
    torch.multinomial(t.softmax(-1)[0], 1, generator=torch.Generator())
    torch.cat([t, torch.zeros(1, 6)])
    assert len(OnDevice.errors) == 2


def test_plain_decoding_reads_the_device_once_a_step(pair, monkeypatch):
    """Stepping (as on a GPU, where the one-call chains do not run): the argmax, once a step.
    The CPU's plain greedy chains read none: their tokens come back from C as host integers."""
    target, _, ids = pair
    counts = reads_per_step(target, None, ids, 0)
    if cpu_kernels.library() is not None:
        assert counts[0] == 1 and set(counts[1:]) == {0}, counts  # the prefill's step, then chains
    monkeypatch.setitem(target.__dict__, "greedy_chain", lambda *args, **kwargs: None)
    assert set(reads_per_step(target, None, ids, 0)) == {1}  # the argmax


def test_prompt_lookup_reads_the_device_once_a_step(pair, monkeypatch):
    """Stepping (as on a GPU, where rounds in one C call do not run): the verify's argmax,
    once a step. The CPU's C rounds read none: their tokens come back as host integers."""
    target, _, ids = pair
    counts = reads_per_step(target, NgramDrafter(3, 1), ids, 4)
    if cpu_kernels.library() is not None:
        assert counts[0] == 1 and set(counts[1:]) == {0}, counts  # the prefill's step, then C rounds
    monkeypatch.setitem(target.__dict__, "spec_rounds", lambda *args, **kwargs: None)
    assert set(reads_per_step(target, NgramDrafter(3, 1), ids, 4)) == {1}


@pytest.mark.parametrize("k", [2, 5])
def test_a_draft_chain_reads_once_per_drafted_token_and_once_to_verify(pair, k, monkeypatch):
    """Stepping in Python (as on a GPU, where the one-call chain does not run): a read per
    drafted token. The CPU's one-call chain reads none: its catch-up and every token,
    the first included, come back from C as host integers."""
    from quickdraft.models.lm import NativeLM

    target, draft, ids = pair
    counts = reads_per_step(target, DraftModelDrafter(draft, target.vocab_size), ids, k)
    if cpu_kernels.library() is not None:
        assert set(counts) == {1}, counts  # the verify's only
    monkeypatch.setattr(NativeLM, "greedy_chain", lambda *args, **kwargs: None)
    counts = reads_per_step(target, DraftModelDrafter(draft, target.vocab_size), ids, k)
    assert max(counts) <= k + 1 and counts[0] == k + 1, counts


def test_sampled_chain_copies_each_distribution_to_the_sampler_once(pair):
    target, draft, ids = pair
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    counts = reads_per_step(target, DraftModelDrafter(draft, target.vocab_size), ids, 3, params)
    assert max(counts) <= 3 + 1, counts  # q of each drafted token, p of the verify pass


def test_a_token_tree_reads_once_per_scored_level_and_once_to_verify(pair):
    from quickdraft.drafters import DraftOptions

    target, draft, ids = pair
    drafter = make_drafter("tree", draft, target.vocab_size, DraftOptions(tree="2,2,1"))
    counts = reads_per_step(target, drafter, ids, 3)
    # top-2 of the root, then of each of its 2 children, then of 4 grandchildren: 7, + verify
    assert max(counts) <= 7 + 1, counts


def batch_step_reads(tiny_family, monkeypatch, params: SamplingParams, k: int) -> dict[int, int]:
    """Host reads of one batched draft-model step (after the prefills), at 1 and 4 rows."""
    from quickdraft.batch_generate import make_batch_engine
    from quickdraft.decoding import batch_engine
    from quickdraft.drafters import batched

    def tagged(forward):
        def run(*args, **kwargs):
            return [t if t is None else t.as_subclass(OnDevice) for t in forward(*args, **kwargs)]
        return run

    monkeypatch.setattr(batched, "ragged_forward", tagged(batched.ragged_forward))
    monkeypatch.setattr(batch_engine, "ragged_forward", tagged(batch_engine.ragged_forward))
    tok = load_tokenizer(tiny_family["target"])
    target, draft = load_model(tiny_family["target"]), load_model(tiny_family["perturbed"])
    reads = {}
    for rows in (1, 4):
        engine = make_batch_engine(target, method="draft", draft=draft, max_batch_size=rows, max_len=128,
                                   num_speculative_tokens=k)
        for i in range(rows):
            row_params = params if params.greedy else SamplingParams(params.temperature, seed=i)
            engine.add(torch.tensor(tok(f"def f{i}(a, b):\n")["input_ids"]), row_params, StopConditions(40))
        engine.step(), engine.step()  # the prefills (a row's draft prefill runs alone)
        OnDevice.reads.clear()
        OnDevice.errors.clear()
        engine.step()
        assert not OnDevice.errors, OnDevice.errors[:3]
        reads[rows] = len(OnDevice.reads)
    return reads


def test_a_batch_step_reads_the_device_once_per_draft_position_whatever_the_rows(tiny_family, monkeypatch):
    """The batched engine with the draft model: the greedy rows' draft tokens, and the
    target's argmax for every row, are read at once (8 server streams on an H200 ran no
    faster than one while each row read the device on its own)."""
    reads = batch_step_reads(tiny_family, monkeypatch, SamplingParams(), k=3)
    assert reads[4] == reads[1] <= 3 + 1, reads


def test_sampled_rows_copy_their_distributions_once_per_draft_position_and_once_to_verify(tiny_family,
                                                                                          monkeypatch):
    """Sampled rows: one copy of every row's q per draft position, and one of every row's
    p after verification (16 reads at 4 rows before the batched copies, 7 with q alone)."""
    reads = batch_step_reads(tiny_family, monkeypatch, SamplingParams(temperature=0.8), k=3)
    assert reads[4] == reads[1] <= 3 + 1, reads
