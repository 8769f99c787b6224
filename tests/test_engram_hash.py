"""Engram hashing: prime layout against the release table sizes, hand-computed rows, decode continuation."""

import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.model.engram import (
    DEAD,
    EngramError,
    EngramLayout,
    compress_ids,
    is_prime,
    mark_dead,
    ngram_rows,
)
from engine.tokenizer import load_tokenizer

SPEC = Path("/work/shared/spec/inference_config.json")
ROOT = Path(__file__).resolve().parent.parent
RELEASE_TABLE_ROWS = (384006168, 384016682)


def release_cfg():
    if SPEC.is_file():
        return types.SimpleNamespace(**json.loads(SPEC.read_text()))
    return types.SimpleNamespace(
        engram_layer_ids=[1, 14], engram_num_embeddings=list(RELEASE_TABLE_ROWS), engram_max_ngram_size=4,
        engram_n_heads=8, engram_head_dim=256, engram_vocab_size=16000000, engram_compressed_vocab_size=99092,
        engram_pad_id=2, dim=5120, hc_mult=4, norm_eps=1e-20,
    )


@pytest.fixture(scope="module")
def layout():
    return EngramLayout.from_config(release_cfg())


def trial_division_prime(n: int) -> bool:
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


def test_is_prime_against_trial_division():
    assert [n for n in range(200) if is_prime(n)] == [n for n in range(200) if trial_division_prime(n)]
    for n in range(16_000_000, 16_000_400):
        assert is_prime(n) == trial_division_prime(n), n
    assert is_prime(2**61 - 1) and is_prime(2**89 - 1)
    # Carmichael numbers and a strong pseudoprime to bases 2, 3, 5, 7
    for composite in (561, 1105, 41041, 3215031751, (2**61 - 1) * 3):
        assert not is_prime(composite)


def test_prime_layout_matches_release_table_sizes(layout):
    flat = [p for layer in layout.primes for per_n in layer for p in per_n]
    assert len(flat) == 2 * 3 * 8 and len(set(flat)) == len(flat)
    assert all(trial_division_prime(p) and p > 16_000_000 - 1 for p in flat)
    # the strongest check: each layer's ranges add up exactly to the released table rows
    assert layout.rows_needed == RELEASE_TABLE_ROWS == layout.num_embeddings
    # drawn in order: within an n-gram size, consecutive primes with no prime skipped between them
    # (other than those taken by earlier slots)
    taken = set()
    for layer in layout.primes:
        for per_n in layer:
            start = 16_000_000 - 1
            for p in per_n:
                skipped = [q for q in range(start + 1, p) if q not in taken and trial_division_prime(q)]
                assert skipped == [], (p, skipped)
                taken.add(p)
                start = p
    # offsets: contiguous, disjoint ranges covering [0, rows) of each layer
    for i, layer in enumerate(layout.primes):
        sizes = [p for per_n in layer for p in per_n]
        offsets = layout.offsets[i]
        assert offsets[0] == 0
        assert all(offsets[k] + sizes[k] == offsets[k + 1] for k in range(len(sizes) - 1))
        assert offsets[-1] + sizes[-1] == layout.num_embeddings[i]


def test_multipliers(layout):
    bound = (2**63 - 1) // 99092 // 2
    for layer_id, mult in zip((1, 14), layout.multipliers):
        raw = np.random.default_rng(10007 * layer_id).integers(0, bound, size=4, dtype=np.int64)
        assert list(mult) == [int(v) * 2 + 1 for v in raw]
        assert all(m % 2 == 1 and (99092 - 1) * m < 2**63 for m in mult)
    assert layout.multipliers[0] != layout.multipliers[1]


def hand_rows(layout, layer, window):
    """Rows of one position from its look-back window [c_t, c_t-1, ...] with plain ints."""
    mult, out = layout.multipliers[layer], []
    for n in range(2, layout.max_ngram_size + 1):
        h = 0
        for k in range(n):
            h ^= window[k] * mult[k]
        for j in range(layout.n_heads):
            col = (n - 2) * layout.n_heads + j
            out.append(h % layout.primes[layer][n - 2][j] + layout.offsets[layer][col])
    return out


def test_rows_against_hand_computation(layout):
    ids = torch.tensor([5, 17, 99091, 3, 42, 7])
    pad = layout.pad_id
    for layer in (0, 1):
        rows = ngram_rows(layout, layer, ids)
        assert rows.shape == (6, 24) and rows.dtype == torch.long
        assert rows[4].tolist() == hand_rows(layout, layer, [42, 3, 99091, 17])
        assert rows[0].tolist() == hand_rows(layout, layer, [5, pad, pad, pad])  # sequence start
        assert rows[1].tolist() == hand_rows(layout, layer, [17, 5, pad, pad])
        assert (rows >= 0).all() and (rows < layout.num_embeddings[layer]).all()
    # a dead position blocks itself and everything before it
    dead = torch.tensor([False, False, True, False, False, False])
    rows = ngram_rows(layout, 0, ids, dead)
    assert rows[2].tolist() == hand_rows(layout, 0, [pad, pad, pad, pad])
    assert rows[3].tolist() == hand_rows(layout, 0, [3, pad, pad, pad])
    assert rows[4].tolist() == hand_rows(layout, 0, [42, 3, pad, pad])
    assert rows[5].tolist() == hand_rows(layout, 0, [7, 42, 3, pad])
    # one number written out completely: 2-gram, head 0, layer 0, position 4
    m = layout.multipliers[0]
    assert rows[4, 0].item() == ((42 * m[0]) ^ (3 * m[1])) % layout.primes[0][0][0] + 0


def test_decode_continuation_equals_full_sequence(layout):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 99092, (40,), generator=gen)
    dead = torch.zeros(40, dtype=torch.bool)
    dead[[6, 7, 8, 21]] = True
    marked = mark_dead(ids, dead)
    for layer in (0, 1):
        full = ngram_rows(layout, layer, ids, dead)
        for t in range(40):  # one token at a time, full history or only the last 3
            step = ngram_rows(layout, layer, ids[t : t + 1], dead[t : t + 1], history=marked[:t])
            short = ngram_rows(layout, layer, ids[t : t + 1], dead[t : t + 1], history=marked[max(0, t - 3) : t])
            assert torch.equal(step[0], full[t]) and torch.equal(short[0], full[t]), t
        for cut in (1, 5, 23):  # chunked prefill
            tail = ngram_rows(layout, layer, ids[cut:], dead[cut:], history=marked[:cut])
            assert torch.equal(tail, full[cut:])
    assert DEAD in marked.tolist()


def test_tokenizer_feeds_hash():
    tok = load_tokenizer(ROOT / "assets" / "tokenizer" / "tokenizer.json")
    lookup, size = tok.compressed_vocab()
    cfg = release_cfg()
    cfg.engram_compressed_vocab_size = size
    small = EngramLayout.from_config(cfg, compressed_pad_id=lookup[tok.pad_id])
    a_ids, b_ids = (tok.encode(s, add_bos=False) for s in ("The value is", " the value is"))
    assert a_ids != b_ids and len(a_ids) == len(b_ids)
    a, b = compress_ids(torch.tensor(a_ids), lookup), compress_ids(torch.tensor(b_ids), lookup)
    # case / leading-space variants hash to the same rows once compressed
    assert torch.equal(a, b) and torch.equal(ngram_rows(small, 0, a), ngram_rows(small, 0, b))
    c = compress_ids(torch.tensor(tok.encode("The value was", add_bos=False)), lookup)
    assert not torch.equal(ngram_rows(small, 0, c)[-1], ngram_rows(small, 0, a)[-1])


def test_bad_inputs(layout):
    with pytest.raises(EngramError, match="compressed ids"):
        ngram_rows(layout, 0, torch.tensor([99092]))
    with pytest.raises(EngramError, match="layer_index"):
        ngram_rows(layout, 2, torch.tensor([1]))
    with pytest.raises(EngramError, match="no Engram"):
        layout.index_of(3)
    assert layout.index_of(14) == 1
    cfg = release_cfg()
    cfg.engram_num_embeddings = [384006167, 384016682]
    with pytest.raises(EngramError, match="needs 384006168 table rows"):
        EngramLayout.from_config(cfg)
