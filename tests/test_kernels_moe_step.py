"""The per-expert GEMV of kernels/moe_step.py (`moe_fp4_triton(step="gemv")`) on the CPU under
TRITON_INTERPRET=1, against the float64 references: repeated experts, experts with 0, 1 and more tokens
than a block holds, both hidden-state numerics, negative ids."""

from interpreted import interpreted  # first: the interpreter before triton

import pytest
import torch

from engine import quant as Q

_, fp4_tiles, moe, moe_f8, moe_step = interpreted("_formats", "fp4_tiles", "moe", "moe_f8", "moe_step")


def _rel(a, b):
    a, b = a.double(), b.double()
    assert not torch.isnan(b).any()
    return ((a - b).norm() / a.norm()).item()


def _weights(gen, e, inter, dim, every_byte=False):
    wq = lambda o, i: Q.quantize_fp4(torch.randn(e, o, i, generator=gen), 32)
    w1, s1 = wq(inter, dim)
    w3, s3 = wq(inter, dim)
    w2, s2 = wq(dim, inter)
    if every_byte:  # every FP4 byte in w1 and w2 (zeros, -0, the subnormal +-0.5, 6)
        fill = lambda w: torch.arange(256, dtype=torch.int32).repeat(w.numel() // 256 + 1)[: w.numel()].reshape(
            w.shape).to(torch.uint8).view(torch.int8)
        w1, w2 = fill(w1), fill(w2)
    return w1, s1, w3, s3, w2, s2


def _ids(t, k, gen):
    """Expert 0 in every token but the last (more tokens than a block holds), expert 1 in the last only, the
    other slots over experts 2..5 (repeated), experts 6 and 7 unused."""
    ids = torch.stack([2 + torch.randperm(4, generator=gen)[: k - 1] for _ in range(t)])
    first = torch.zeros(t, 1, dtype=torch.long)
    first[-1] = 1
    return torch.cat([first, ids], 1).to(torch.int32)


def _case(gen, t, e=8, inter=64, dim=128, k=3, every_byte=False):
    x = torch.randn(t, dim, generator=gen).to(torch.bfloat16)
    ids = _ids(t, k, gen)
    tw = torch.rand(t, k, generator=gen)
    return (x, *_weights(gen, e, inter, dim, every_byte), ids, tw)


# dim 128 = 16 words, I 64 = 8 words: block_kw 8 -> 2 K steps (gate/up) and 1 (down); iters 1: K splits
CFGS = [dict(tokens=4, block_n=32, block_kw=8, iters=1, down_block_n=16, down_block_kw=4, down_iters=1),
        dict(tokens=2, block_n=16, block_kw=8, iters=2, down_block_n=32, down_block_kw=8, down_iters=2),
        dict(tokens=3, block_n=32, block_kw=16, iters=1, down_block_n=16, down_block_kw=4, down_iters=2),
        dict(tokens=1, block_n=64, block_kw=4, iters=4, down_block_n=64, down_block_kw=8, down_iters=1)]


@pytest.mark.parametrize("cfg", range(len(CFGS)))
def test_step_gemv_bf16_form(gen, cfg):
    args = _case(gen, 7)
    counts = torch.bincount(args[-2].flatten(), minlength=8)
    assert counts[0] > 4 and counts[1] == 1 and counts[-1] == 0  # many, one, none
    got = moe.moe_fp4_triton(*args, gemv_max_pairs=0, step="gemv", step_cfg=CFGS[cfg])
    assert _rel(moe.moe_fp4_reference(*args), got) < 1e-5, gen.initial_seed()


@pytest.mark.parametrize("hidden,cfg", [("reference", 0), ("reference", 1), ("fp32", 2), ("reference", 3)])
def test_step_gemv_hidden(gen, hidden, cfg):
    """The engine's numerics: compared as the existing tests compare the bf16 form's (the interpreter's
    bf16 casts truncate: 1e-2), and against the grouped GEMM with the same numerics."""
    x, *rest = _case(gen, 6, every_byte=cfg == 0)
    x = Q.fp8_roundtrip(x.float(), 32).to(torch.bfloat16)  # the engine's x: on the E4M3-per-32 grid
    args = (x, *rest)
    want = moe.moe_fp4_reference(*args, hidden=hidden)
    got = moe.moe_fp4_triton(*args, hidden=hidden, x_on_grid=True, gemv_max_pairs=0, step="gemv",
                             step_cfg=CFGS[cfg])
    grouped = moe.moe_fp4_triton(*args, hidden=hidden, x_on_grid=True, gemv_max_pairs=0, block_m=16, block_n=32)
    tol = 1e-2 if hidden == "reference" else 1e-5
    assert _rel(want, got) < tol and _rel(grouped, got) < tol, (gen.initial_seed(), _rel(want, got))


def test_step_gemv_negative_ids(gen):
    """Expert parallel: slots of another rank (-1) add nothing."""
    x, w1, s1, w3, s3, w2, s2, ids, tw = _case(gen, 5)
    local = torch.where(ids < 3, ids, -1).to(torch.int32)
    stacks = (w1[:3], s1[:3], w3[:3], s3[:3], w2[:3], s2[:3])
    got = moe.moe_fp4_triton(x, *stacks, local, tw, gemv_max_pairs=0, step="gemv", step_cfg=CFGS[0])
    assert _rel(moe.moe_fp4_reference(x, *stacks, local, tw), got) < 1e-5, gen.initial_seed()


def test_split_layout_and_k_split():
    v = torch.arange(32.0).reshape(2, 16)
    s = moe_step.split_layout(v)
    assert s.shape == (2, 8, 2) and s[1, 3, 1].item() == 16 + 8 + 3
    assert moe_step._k_split(640, 64, 2) == (64, 2, 5)  # release gate/up: 640 words
    assert moe_step._k_split(288, 32, 3) == (32, 3, 3)  # release down: 288 words
    assert moe_step._k_split(16, 2, 8) == (4, 4, 1)


def test_step_gemv_defaults(gen):
    """The default knobs (2 pairs per block) at these small widths, the engine's hidden state."""
    x, *rest = _case(gen, 9)
    x = Q.fp8_roundtrip(x.float(), 32).to(torch.bfloat16)
    got = moe.moe_fp4_triton(x, *rest, hidden="fp32", x_on_grid=True, gemv_max_pairs=0, step="gemv")
    assert _rel(moe.moe_fp4_reference(x, *rest, hidden="fp32"), got) < 1e-5, gen.initial_seed()
