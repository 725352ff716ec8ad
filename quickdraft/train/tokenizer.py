"""Byte-level BPE tokenizer for the embedded model family.

Vocabulary 8192 with a single special token ``<|endoftext|>`` that is eos, bos and pad and
separates documents in the packed stream.  Byte-level pre-tokenization (no prefix space),
byte-level decoder and no normalizer make ``decode(encode(s)) == s`` exact for any text.
Its chat template is the code template (``code_chat_template.jinja``): the models trained
here complete code, so a conversation stays a source file they continue.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

EOT = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192
CODE_CHAT_TEMPLATE_FILE = Path(__file__).with_name("code_chat_template.jinja")


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train a byte-level BPE on ``texts``; returns a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap(tok)


def wrap(tok):
    """Wrap a ``tokenizers.Tokenizer`` as a ``PreTrainedTokenizerFast`` with our specials."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=None,
        pad_token=EOT,
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=512,
    )
    # save_pretrained writes it as chat_template.jinja beside the model (the embedded ones ship it)
    fast.chat_template = CODE_CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")
    return fast


def save_tokenizer(tok, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    mark_fast_tokenizer_class(out_dir)


def mark_fast_tokenizer_class(out_dir: Path) -> None:
    """Name the class ``PreTrainedTokenizerFast`` in tokenizer_config.json.

    transformers 5 writes its internal ``TokenizersBackend``, which transformers 4.x cannot
    resolve; ``PreTrainedTokenizerFast`` loads the same tokenizer.json in both.
    """
    import json

    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for k in ("is_local", "local_files_only"):  # loader bookkeeping, not tokenizer config
        cfg.pop(k, None)
    cfg.setdefault("add_bos_token", False)
    cfg.setdefault("add_eos_token", False)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def token_byte_lengths(tok) -> list[int]:
    """UTF-8 byte length of every token id (0 for the special token)."""
    from tokenizers import pre_tokenizers  # noqa: F401  (ensures tokenizers is importable)

    byte_decoder = _bytelevel_decoder()
    vocab = tok.get_vocab()
    lengths = [0] * len(vocab)
    specials = set(tok.all_special_tokens)
    for piece, idx in vocab.items():
        lengths[idx] = 0 if piece in specials else sum(1 for ch in piece if ch in byte_decoder)
    return lengths


def _bytelevel_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode-to-byte mapping used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}
