"""Runtime hooks later methods rely on: ragged batches, layer ranges, skipped sub-layers,
hidden states, arbitrary attention masks (token trees), and clear loading errors."""

import json

import pytest
import torch

from quickdraft.models.lm import load_model
from quickdraft.models.loading import CheckpointError, load_native, resolve_model_dir

ATOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    arch, path, _ = tiny_checkpoint
    return load_native(path)


def run(model, ids, start=0, cache=None, **kw):
    cache = cache or model.new_cache(ids.shape[0], 64)
    positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad():
        return model(ids, positions, cache, **kw)


def test_ragged_batch_equals_each_row_alone(model):
    torch.manual_seed(0)
    lengths = [9, 4, 6]
    rows = [torch.randint(0, 96, (n,)) for n in lengths]
    batch = torch.zeros(3, max(lengths), dtype=torch.long)  # right padding with token 0
    for b, r in enumerate(rows):
        batch[b, : len(r)] = r
    cache = model.new_cache(3, 64)
    positions = torch.arange(batch.shape[1]).expand(3, -1)
    with torch.no_grad():
        out = model(batch, positions, cache)
        # Then one decode step per row at its own position: rows advance at different rates.
        nxt = torch.tensor([[5], [6], [7]])
        step = model(nxt, torch.tensor(lengths)[:, None], cache)
    for b, r in enumerate(rows):
        alone = run(model, r[None])
        torch.testing.assert_close(out.logits[b, : len(r)], alone.logits[0], **ATOL)
        alone_step = run(model, torch.cat([r, nxt[b]])[None])
        torch.testing.assert_close(step.logits[b, 0], alone_step.logits[0, -1], **ATOL)


def test_int_positions_equal_explicit_positions_bit_for_bit(model):
    """The contiguous fast path (positions / slots given as an int: slice writes, rope by
    slicing) computes exactly what explicit position tensors do, cache included."""
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 12))
    caches = model.new_cache(2, 32), model.new_cache(2, 32)
    with torch.no_grad():
        for a, b in ((0, 7), (7, 8), (8, 11), (11, 12)):  # prefill, one token, three, one
            fast = model(ids[:, a:b], a, caches[0])
            slow = model(ids[:, a:b], torch.arange(a, b).expand(2, -1), caches[1])
            assert torch.equal(fast.logits, slow.logits), (a, b)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def test_layer_range_resumes_from_hidden_state(model):
    ids = torch.randint(0, 96, (1, 7))
    full = run(model, ids)
    cache = model.new_cache(1, 64)
    positions = torch.arange(7)[None]
    with torch.no_grad():
        first = model(ids, positions, cache, layers=(0, 1), logits="none")
        rest = model(None, positions, cache, hidden=first.hidden, layers=(1, model.config.n_layers))
    torch.testing.assert_close(rest.logits, full.logits, **ATOL)
    # Early-exit logits: the shared head applied after layer 1.
    torch.testing.assert_close(first.hidden, full_hidden(model, ids, 1), **ATOL)


def full_hidden(model, ids, layer):
    return run(model, ids, output_hidden_states=[layer]).hidden_states[layer]


def test_hidden_states_match_transformers(tiny_checkpoint, model):
    arch, path, hf = tiny_checkpoint
    ids = torch.randint(0, 96, (1, 6))
    ours = run(model, ids, output_hidden_states=range(model.config.n_layers + 1)).hidden_states
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states
    for i in range(model.config.n_layers):  # HF applies the final norm to its last entry
        torch.testing.assert_close(ours[i], ref[i], atol=1e-4, rtol=1e-4)


def test_skipping_sublayers_is_identity_on_the_residual(model):
    ids = torch.randint(0, 96, (1, 5))
    everything = range(model.config.n_layers)
    skipped = run(model, ids, skip_attn=everything, skip_mlp=everything)
    embedded = run(model, ids, layers=(0, 0))
    torch.testing.assert_close(skipped.hidden, embedded.hidden)
    # Skipping one MLP changes the output, and equals running that layer's attention only.
    partial = run(model, ids, skip_mlp={1})
    assert not torch.allclose(partial.logits, run(model, ids).logits)


def test_explicit_tree_mask(model):
    """A token tree flattened after a prefix: each node sees the prefix and its ancestors,
    at position prefix + depth. Each node's logits equal those of its path run linearly."""
    torch.manual_seed(3)
    prefix = torch.randint(0, 96, (1, 5))
    # Tree: a -> (b, c); b -> d. Flat order [a, b, c, d], parents [-1, 0, 0, 1].
    nodes = torch.tensor([[11, 12, 13, 14]])
    parents = [-1, 0, 0, 1]
    depth = [0, 1, 1, 2]
    n, p = 4, prefix.shape[1]
    tree = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            tree[i, j] = True
            j = parents[j]
    mask = torch.cat([torch.ones(n, p, dtype=torch.bool), tree], dim=1)[None]
    cache = model.new_cache(1, 64)
    with torch.no_grad():
        model(prefix, torch.arange(p)[None], cache)
        out = model(nodes, torch.tensor([[p + d for d in depth]]), cache,
                    slots=torch.arange(p, p + n)[None], mask=mask)
    paths = {0: [11], 1: [11, 12], 2: [11, 13], 3: [11, 12, 14]}
    for i, path in paths.items():
        linear = run(model, torch.cat([prefix, torch.tensor([path])], dim=1))
        torch.testing.assert_close(out.logits[0, i], linear.logits[0, -1], **ATOL)


def test_pickle_checkpoints_are_refused(tiny_checkpoint, tmp_path):
    (tmp_path / "config.json").write_text((tiny_checkpoint[1] / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="safetensors only"):
        load_model(tmp_path)


def test_remote_code_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "custom", "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(CheckpointError, match="trust_remote_code"):
        load_model(tmp_path)


def test_unsupported_model_type_names_supported_ones(tmp_path):
    from quickdraft.models.config import UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2, gpt2"):
        load_model(tmp_path, backend="native")


def test_corrupted_safetensors(tiny_checkpoint, tmp_path):
    _, path, _ = tiny_checkpoint
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:200])
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_model(tmp_path)


def test_unknown_model_name():
    with pytest.raises(CheckpointError, match="not found"):
        resolve_model_dir("no-such-model")
    with pytest.raises(CheckpointError, match="did you mean qd-stdlib-target\\?"):  # a typo
        resolve_model_dir("qd-stdlib-targt")
    with pytest.raises(CheckpointError, match="hub id as owner/name"):  # a bare hub name is not looked up
        resolve_model_dir("gpt2")


def test_hub_id_loads_from_the_huggingface_cache(tiny_family, tmp_path):
    """A hub id resolves through huggingface_hub's cache (offline here: no download)."""
    import os
    import shutil
    import subprocess
    import sys

    snapshot = tmp_path / "models--qd-test--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_family["target"], snapshot)
    (tmp_path / "models--qd-test--tiny" / "refs").mkdir()
    (tmp_path / "models--qd-test--tiny" / "refs" / "main").write_text("0123abcd")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    args = ["generate", "--model", "qd-test/tiny", "--method", "ar", "--prompt", "x", "--max-new-tokens", "3", "--json"]
    proc = subprocess.run([sys.executable, "-m", "quickdraft.cli", *args], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["new_tokens"] == 3


def test_unreachable_hub_id_is_a_clear_error():
    with pytest.raises(CheckpointError, match="could not be fetched from the hub"):
        resolve_model_dir("qd-test/not-in-any-cache")
