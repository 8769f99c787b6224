"""The project tokenizer: fixed special ids, lossless round trip, display strings, compressed vocab."""

import json
import re
import unicodedata
from pathlib import Path

import pytest

from engine.tokenizer import (
    SPECIAL_TOKENS,
    TokenizerError,
    build_compressed_vocab,
    load_tokenizer,
    text_key,
)

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "assets" / "tokenizer" / "tokenizer.json"
SAMPLE = ROOT / "assets" / "corpus" / "heldout_sample.txt"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


def test_special_ids_and_vocab(tok):
    assert tok.vocab_size == 4096
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.image_id, tok.dspark_noise_id) == (0, 1, 2, 3, 4)
    for name, token_id in SPECIAL_TOKENS.items():
        assert tok.backend.id_to_token(token_id) == name


def test_round_trip_on_heldout_sample(tok):
    text = SAMPLE.read_text(encoding="utf-8")[:60_000] + " café — 你好 \t\r\n"
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 2.5  # BPE actually compresses this kind of text
    with_bos = tok.encode("x = 1")
    assert with_bos[0] == 0 and with_bos[1:] == tok.encode("x = 1", add_bos=False)


def test_token_strings(tok):
    ids = tok.encode("def f(x):\n    return x")
    strings = tok.token_strings(ids)
    assert strings[0] == "<bos>"
    assert "".join(strings[1:]) == "def f(x):\n    return x"
    # "é" is two bytes; if they are separate tokens each is shown as a byte
    eacute = tok.token_strings(tok.encode("é", add_bos=False))
    assert "".join(eacute) in ("é", "<0xC3><0xA9>")
    assert tok.token_bytes(tok.encode("é", add_bos=False)[0])[:1] == b"\xc3"


def test_bad_input_is_a_clear_error(tok, tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([5000])


def _python_key(text: str) -> str:
    """Independent restatement of the release's key with the unicodedata module."""
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(ch for ch in s if unicodedata.category(ch) != "Mn").lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    s = s if s == " " else s.strip()
    return s or text


def test_key_collapses_case_space_and_accents():
    assert text_key("The") == text_key(" the") == text_key("THE") == text_key("\tthe\n") == "the"
    assert text_key("Café") == "cafe"
    assert text_key(" ") == " " and text_key("\n\n") == " " and text_key("  \t") == " "
    assert text_key("ﬁ") == "fi"  # NFKC ligature


def test_compressed_vocab(tok):
    lookup, size = tok.compressed_vocab()
    saved = json.loads((TOKENIZER.parent / "compressed_vocab.json").read_text())
    assert (lookup, size) == (saved["lookup"], saved["compressed_vocab_size"])
    assert (lookup, size) == build_compressed_vocab(tok.backend)  # the saved map is not stale
    assert len(lookup) == tok.vocab_size and size == len(set(lookup)) and size < tok.vocab_size
    # first-seen order: compressed id k first appears before k + 1
    firsts = {}
    for token_id, cid in enumerate(lookup):
        firsts.setdefault(cid, token_id)
    assert sorted(firsts) == list(range(size)) and sorted(firsts.values()) == [firsts[k] for k in range(size)]
    assert lookup[tok.pad_id] == 2  # the Engram pad's compressed id
    # the case / leading-space variants that exist as single tokens share one id
    variants = [tok.backend.token_to_id(t) for t in ("The", "Ġthe", "the", "ĠThe", "THE", "ĠTHE")]
    found = {lookup[i] for i in variants if i is not None}
    assert len([i for i in variants if i is not None]) >= 3 and len(found) == 1
    # every token's key, recomputed independently, gives the same partition
    keys = {}
    for token_id in range(tok.vocab_size):
        text = tok.backend.decode([token_id], skip_special_tokens=False)
        key = tok.backend.id_to_token(token_id) if "\ufffd" in text else _python_key(text)
        keys.setdefault(key, len(keys))
        assert keys[key] == lookup[token_id], (token_id, text)
