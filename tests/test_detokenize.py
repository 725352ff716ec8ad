"""Incremental detokenisation keeps multi-byte UTF-8 characters whole."""

from conftest import build_tokenizer

from quickdraft.decoding.detokenize import IncrementalDetokenizer

TEXT = "naïve café — 你好世界 🙂🚀 x = 'ü'\n\tdef ƒ(): return '✓'"


def test_token_by_token_deltas_rebuild_the_text_without_broken_characters(tmp_path):
    tok = build_tokenizer(tmp_path)
    ids = tok(TEXT)["input_ids"]
    assert tok.decode(ids) == TEXT
    # Byte-level BPE splits these characters over several tokens: the check is meaningful.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_chunks_of_several_tokens(tmp_path):
    tok = build_tokenizer(tmp_path)
    ids = tok(TEXT)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3)] + [detok.flush()]
    assert "".join(deltas) == TEXT
