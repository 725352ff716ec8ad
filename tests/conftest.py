"""Shared fixtures: tiny random checkpoints of every supported architecture, built locally."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Under pytest-xdist (`make test` runs two workers on CI's two cores) each worker gets one
# core; run alone, a test may use both.
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def one_thread_per_worker():
    """Tests that run the trainer, the bench or the server in-process let them set torch's
    thread count (to 2, say); left so, the rest of that worker's tests ran two threads on
    one core beside the other worker's: tiny-model decoding went ~10x slower."""
    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


def pytest_configure(config):
    """Under ``-n N`` xdist hands each worker its tests one at a time (``--maxschedchunk 1``
    unless the command line sets it). Its default first hands each worker a quarter of its
    share as one consecutive chunk: with the slow tests sorted first (below), the first
    worker got nearly every slow test and ran them one after another while the other
    finished the short ones and waited."""
    if getattr(config.option, "maxschedchunk", 0) is None and getattr(config.option, "dist", "no") == "load":
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.slow`` tests run first, so that under xdist the two workers end on
    short tests together instead of one waiting while the other finishes a minute-long
    one. ``@pytest.mark.gpu`` tests skip without a CUDA device, saying so, unless
    QUICKDRAFT_REQUIRE_GPU=1 (``make test-gpu``), where a missing GPU must fail them."""
    items.sort(key=lambda item: "slow" not in item.keywords)  # stable: file order otherwise
    if torch.cuda.is_available() or os.environ.get("QUICKDRAFT_REQUIRE_GPU") == "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def private_cache_dir(tmp_path_factory):
    """Tests never read or write the user's cache (auto-k choices): XDG_CACHE_HOME points
    to a temporary directory for the whole session (subprocesses inherit it). Noisy
    timings are cached too (QUICKDRAFT_NOISE_LIMIT=inf), so caching tests are deterministic."""
    patch = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("xdg-cache")
    patch.setenv("XDG_CACHE_HOME", str(path))
    # The tiny models' sub-millisecond timings jitter past the noise limit on a shared
    # machine: tests that cache a measurement cache it whatever the jitter (the noise
    # tests set their own limit and clock).
    patch.setenv("QUICKDRAFT_NOISE_LIMIT", "inf")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # The commands tests start (the CLI, the README's lines, scripts) run one torch thread
        # too, as this worker does: with torch's default of one per core, such a command's two
        # threads shared the cores with the other worker and waited on each other, taking twice
        # as long (one `quickdraft generate` measuring its k: 21 s instead of 10 s). Servers
        # keep the two threads tests/serving.py gives them.
        patch.setenv("OMP_NUM_THREADS", str(THREADS))
    yield path
    patch.undo()


TINY = dict(vocab_size=96, max_position_embeddings=128)


def hf_config(arch: str):
    """A tiny transformers config of one supported architecture."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, **TINY)
    if arch == "llama":
        return LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **common)
    if arch == "llama-gqa-tied":
        return LlamaConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **common)
    if arch == "llama3-rope":
        return LlamaConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=16),
            **common,
        )
    if arch == "mistral":
        return MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=None, **common)
    if arch == "qwen2":
        return Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **common)
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=96, n_positions=128)
    raise ValueError(arch)


ARCHS = ["llama", "llama-gqa-tied", "llama3-rope", "mistral", "qwen2", "gpt2"]


def save_tiny(arch: str, path: Path, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch)).float().eval()
    # Random init leaves biases at zero; perturb them so bias loading is tested too.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="session", params=ARCHS)
def tiny_checkpoint(request, tmp_path_factory):
    """(arch, directory, transformers model) for each supported architecture."""
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny(request.param, path)
    return request.param, path, model


TOKENIZER_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "héllo wörld — ünïcode ✓ 你好 🙂\n",
]


def build_tokenizer(path: Path, vocab_size: int = 300):
    """A small byte-level BPE saved the way transformers' AutoTokenizer loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TOKENIZER_TEXT * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(path)
    return fast


def save_llama(path: Path, vocab_size: int, layers: int, hidden: int, seed: int, eos: int, scale: float = 1.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=eos, bos_token_id=eos,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper distributions than the default init: more varied tokens
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """A tokenizer plus a tiny target, an exact copy of it (acceptance 1), a perturbed copy
    (high acceptance) and an unrelated draft (low acceptance), as Llama directories."""
    root = tmp_path_factory.mktemp("family")
    tok = build_tokenizer(root / "tok")
    vocab = len(tok)
    eos = tok.eos_token_id
    dirs = {}
    for name, seed, layers, hidden in [("target", 0, 2, 64), ("unrelated", 1, 1, 32)]:
        dirs[name] = root / name
        save_llama(dirs[name], vocab, layers, hidden, seed, eos, scale=20.0)
        tok.save_pretrained(dirs[name])
    import shutil

    from transformers import LlamaForCausalLM

    dirs["copy"] = root / "copy"
    shutil.copytree(dirs["target"], dirs["copy"])
    dirs["perturbed"] = root / "perturbed"
    model = LlamaForCausalLM.from_pretrained(dirs["target"])
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(dirs["perturbed"], safe_serialization=True)
    tok.save_pretrained(dirs["perturbed"])
    return dirs


@pytest.fixture(scope="module")
def models(tiny_family):
    """(tokenizer, target, {copy, perturbed, unrelated} drafts) of the tiny family, loaded."""
    from quickdraft.models.lm import load_model
    from quickdraft.pair import load_tokenizer

    tok = load_tokenizer(tiny_family["target"])
    target = load_model(tiny_family["target"])
    drafts = {name: load_model(tiny_family[name]) for name in ("copy", "perturbed", "unrelated")}
    return tok, target, drafts


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A real `quickdraft serve` on loopback over the embedded models (k=3, 4 rows, a queue
    of 6, a 100 kB body limit), shared by the server tests; stopped at the end."""
    from serving import ServerProcess

    log = tmp_path_factory.mktemp("server") / "serve.log"
    srv = ServerProcess(["-k", "3", "--max-batch-size", "4", "--max-queue", "6", "--max-body-bytes", "100000",
                         "--threads", "2"], log)
    yield srv
    srv.stop()
