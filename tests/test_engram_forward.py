"""engram_forward against a plain float64 loop written from the release's formulas."""

import math

import pytest
import torch

from engine.model.engram import EngramError, engram_forward


def loop_reference(x, rows, wkv, q_weight, k_weight, eps, token_mask=None):
    """Per token, per copy, per channel, in float64 Python arithmetic over tensor elements."""
    x, rows, wkv = x.double(), rows.double(), wkv.double()
    qw, kw = q_weight.double(), k_weight.double()
    n_tok, hc, dim = x.shape
    out = x.clone()
    for t in range(n_tok):
        flat = rows[t].reshape(-1)
        kv = [float(torch.dot(wkv[o], flat)) for o in range(wkv.shape[0])]
        value = kv[hc * dim :]
        for c in range(hc):
            key = kv[c * dim : (c + 1) * dim]
            xs = [float(v) for v in x[t, c]]
            ms_x = sum(v * v for v in xs) / dim
            ms_k = sum(v * v for v in key) / dim
            dot = sum(xs[i] * float(qw[c, i]) * float(kw[c, i]) * key[i] for i in range(dim))
            dot = dot / math.sqrt(ms_x + eps) / math.sqrt(ms_k + eps) / math.sqrt(dim)
            root = math.sqrt(max(abs(dot), 1e-6))
            gate = 1.0 / (1.0 + math.exp(-(root if dot >= 0 else -root)))
            if token_mask is not None and not token_mask[t]:
                gate = 0.0
            for i in range(dim):
                out[t, c, i] = xs[i] + gate * value[i]
    return out


def make_inputs(seed, n_tok=5, hc=4, dim=16, n_rows=6, head_dim=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(dtype)
    return (
        r(n_tok, hc, dim),
        r(n_tok, n_rows, head_dim),
        r((hc + 1) * dim, n_rows * head_dim, scale=0.2),
        1 + r(hc, dim, scale=0.3),
        1 + r(hc, dim, scale=0.3),
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_forward_matches_float64_loop(seed):
    x, rows, wkv, qw, kw = make_inputs(seed)
    got = engram_forward(x, rows, wkv, qw, kw, eps=1e-20)
    want = loop_reference(x, rows, wkv, qw, kw, 1e-20)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    got64 = engram_forward(x.double(), rows.double(), wkv.double(), qw.double(), kw.double(), eps=1e-20)
    torch.testing.assert_close(got64, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got.double(), x.double())  # it does add something


def test_token_mask_and_gate_range():
    x, rows, wkv, qw, kw = make_inputs(3, n_tok=4)
    mask = torch.tensor([True, False, True, False])
    got = engram_forward(x, rows, wkv, qw, kw, eps=1e-6, token_mask=mask)
    torch.testing.assert_close(got[~mask], x[~mask], rtol=0, atol=0)
    want = loop_reference(x, rows, wkv, qw, kw, 1e-6, token_mask=mask.tolist())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # the added amount per copy is gate * value with gate in (0, 1), one value shared by the copies
    value = (rows.reshape(4, -1) @ wkv.T)[:, 4 * 16 :]
    gates = ((got - x)[mask] / value[mask].unsqueeze(1)).mean(-1)
    assert ((gates > 0) & (gates < 1)).all()


def test_signed_sqrt_gate():
    # a key anti-aligned with the stream gives dot < 0, so gate = sigmoid(-sqrt(|dot|)) < 1/2
    dim, hc = 4, 1
    x = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    rows = torch.ones(1, 1, 1, dtype=torch.float64)
    wkv = torch.tensor([[-0.5], [0.0], [0.0], [0.0], [1.0], [2.0], [3.0], [4.0]], dtype=torch.float64)
    ones = torch.ones(hc, dim, dtype=torch.float64)
    got = engram_forward(x, rows, wkv, ones, ones, eps=0.0)
    dot = (1.0 * -0.5) / math.sqrt(1 / 4) / math.sqrt(0.25 / 4) / math.sqrt(dim)  # = -2
    gate = 1 / (1 + math.exp(math.sqrt(abs(dot))))
    want = torch.tensor([1.0, 0.0, 0.0, 0.0]).double() + gate * torch.tensor([1.0, 2.0, 3.0, 4.0]).double()
    assert dot == -2.0 and gate < 0.5
    torch.testing.assert_close(got[0, 0], want, rtol=1e-12, atol=1e-12)
    # a zero stream: |dot| is floored at 1e-6 before the root, so gate = sigmoid(1e-3)
    got0 = engram_forward(torch.zeros_like(x), rows, wkv, ones, ones, eps=1e-20)
    torch.testing.assert_close(got0[0, 0], (1 / (1 + math.exp(-1e-3))) * torch.tensor([1.0, 2, 3, 4]).double())


def test_shape_errors():
    x, rows, wkv, qw, kw = make_inputs(0)
    with pytest.raises(EngramError, match="wkv must be"):
        engram_forward(x, rows, wkv[:-1], qw, kw, eps=1e-6)
    with pytest.raises(EngramError, match="rows_embed"):
        engram_forward(x, rows[:-1], wkv, qw, kw, eps=1e-6)
    with pytest.raises(EngramError, match="q_weight"):
        engram_forward(x, rows, wkv, qw[:-1], kw, eps=1e-6)
    short = wkv[:-1]  # fetched lazily: the product's width is checked instead
    with pytest.raises(EngramError, match="wkv gave"):
        engram_forward(x, rows, lambda: short, qw, kw, eps=1e-6, gemm=lambda flat, fetch: flat @ fetch().t())


def test_fetched_weight_matches_the_tensor():
    """wkv as a function: gemm gets the function (the kernel ops may never fetch it), same result."""
    x, rows, wkv, qw, kw = make_inputs(2)
    fetched = []
    got = engram_forward(x, rows, lambda: fetched.append(1) or wkv, qw, kw, eps=1e-20,
                         gemm=lambda flat, fetch: flat @ fetch().t())
    assert fetched == [1]
    assert torch.equal(got, engram_forward(x, rows, wkv, qw, kw, eps=1e-20))


def test_hashing_without_host_reads_gives_the_same_rows():
    """ngram_rows under a graph capture (branch_free: the range checks, which read values back, are
    skipped) gives the rows of the checked form, history and dead positions included."""
    from engine.capture import branch_free
    from engine.config import release_config
    from engine.model.engram import EngramLayout, mark_dead, ngram_rows

    layout = EngramLayout.from_config(release_config())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, layout.compressed_vocab_size, (64,), generator=g)
    history = mark_dead(torch.randint(0, layout.compressed_vocab_size, (40,), generator=g),
                        torch.rand(40, generator=g) < 0.2)
    dead = torch.rand(64, generator=g) < 0.1
    want = ngram_rows(layout, 1, ids, dead, history)
    with branch_free():
        got = ngram_rows(layout, 1, ids, dead, history)
    assert torch.equal(got, want) and want.shape == (64, 24)
