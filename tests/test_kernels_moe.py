"""The FP4 MoE kernels (kernels/moe.py), both paths, on the CPU under TRITON_INTERPRET=1, against the
float64 reference: the decode-time GEMV path and the grouped tensor-core path with its NIB K order."""

from interpreted import interpreted  # first: the interpreter before triton

import pytest
import torch

from engine import quant as Q
from moe_checks import close_but_one_token

_, fp4_tiles, moe_gemv, moe = interpreted("_formats", "fp4_tiles", "moe_gemv", "moe")


def _rel(a, b):
    a, b = a.double(), b.double()
    assert not torch.isnan(b).any()
    if a.norm() == 0:  # an all-zero reference (a rank that owns none of the slots): b must be zero too
        return float(b.abs().max()) if b.numel() else 0.0
    return ((a - b).norm() / a.norm()).item()


def _weights(gen, e, inter, dim, every_byte=False):
    wq = lambda o, i: Q.quantize_fp4(torch.randn(e, o, i, generator=gen), 32)
    w1, s1 = wq(inter, dim)
    w3, s3 = wq(inter, dim)
    w2, s2 = wq(dim, inter)
    if every_byte:
        # every FP4 byte (both nibbles: zeros, -0, the subnormal +-0.5, 6) and scale bytes down to 2^-127
        w1 = torch.arange(256, dtype=torch.int32).repeat(w1.numel() // 256 + 1)[: w1.numel()].reshape(w1.shape)
        w1 = w1.to(torch.uint8).view(torch.int8)
        s1 = (s1.view(torch.uint8).long() - torch.randint(0, 3, s1.shape, generator=gen)).clamp(0, 254)
        s1 = s1.to(torch.uint8).view(torch.float8_e8m0fnu)
    return w1, s1, w3, s3, w2, s2


def _case(gen, t, e=6, inter=64, dim=128, k=3, every_byte=False):
    x = torch.randn(t, dim, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    tw = torch.rand(t, k, generator=gen)
    return (x, *_weights(gen, e, inter, dim, every_byte), ids, tw)



def _every_byte_under_every_scale():
    """256 rows x 512: each row's 16 groups hold all 256 FP4 bytes; row r's scale byte is r % 241."""
    rows, kdim = 256, 512
    packed = torch.arange(256, dtype=torch.int32).repeat(rows, 1).to(torch.uint8).view(torch.int8)
    scale = (torch.arange(rows) % 241).to(torch.uint8)[:, None].expand(rows, kdim // 32).contiguous()
    return packed, scale.view(torch.float8_e8m0fnu)


def test_tile_decode_every_byte_and_scale():
    """The grouped GEMM's tile decode (float32 form; the bf16 form needs a GPU, where benches/kernels.py
    checks it the same way) for every FP4 byte under every E8M0 scale byte up to 2^113 (the float32
    form's scale word, 2^(byte - 113), leaves the exponent field past that; checkpoint scales sit near
    2^-10), subnormal products included: equal to engine.quant's decode, in NIB order."""
    packed, scale = _every_byte_under_every_scale()
    assert torch.equal(fp4_tiles.fp4_tile_decoded(packed, scale, False),
                       fp4_tiles.nib_order(Q.dequantize_fp4(packed, scale, 32)))


def test_fold_form_is_chosen_and_checked():
    """bf16_decode takes False, True or "fold" (the folded scale), refused otherwise on either path; fold_fits
    says whether every scale byte is in the folded factor's range (up to 2^1, byte 128)."""
    assert [fp4_tiles.decode_form(v) for v in (False, True, "fold")] == [0, 1, 2]
    ok = torch.full((4, 2), fp4_tiles.FOLD_MAX_SCALE_BYTE, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    high = ok.view(torch.uint8).clone()
    high[3, 1] += 1
    assert fp4_tiles.fold_fits(ok, ok) and not fp4_tiles.fold_fits(ok, high.view(torch.float8_e8m0fnu))
    for t in (1, 8):  # the GEMV path (2 pairs) and the grouped path (16 pairs, gemv_max_pairs 4)
        with pytest.raises(ValueError, match="bf16_decode must be False, True or 'fold', got 'bf16'"):
            moe.moe_fp4_triton(*_case(torch.Generator().manual_seed(0), t), bf16_decode="bf16", gemv_max_pairs=4)


_GPU_FOLD_CHECK = """
import torch
from engine import quant as Q
from kernels import fp4_tiles
rows = 256
pk = torch.arange(256, dtype=torch.int32).repeat(rows, 1).to(torch.uint8).view(torch.int8)
sb = (torch.arange(rows) % 241).to(torch.uint8)[:, None].expand(rows, 16).contiguous()
want = fp4_tiles.nib_order(Q.dequantize_fp4(pk, sb.view(torch.float8_e8m0fnu), 32))
got = fp4_tiles.fp4_tile_decoded(pk.cuda(), sb.cuda().view(torch.float8_e8m0fnu), "fold").cpu()
fits = sb[:, 0] <= fp4_tiles.FOLD_MAX_SCALE_BYTE
assert torch.equal(got[fits], want[fits].bfloat16().float()), (got[fits] - want[fits]).abs().max()
assert torch.isnan(got[~fits]).all()
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the folded decode's PTX needs a GPU")
def test_fold_decode_on_the_gpu():
    """Every FP4 byte under every E8M0 scale byte 0..240, compiled on the GPU (a fresh process: this module's
    kernels are the interpreter's): engine.quant's values in NIB order up to byte 128, NaN past it."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _GPU_FOLD_CHECK], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stderr[-3000:]


def test_nib_order_is_the_decoders_order():
    """Position 2 A + half of each 8-group holds index A + 4 half: a word's two halves side by side."""
    a = torch.arange(16.0).reshape(1, 16)
    got = fp4_tiles.nib_order(a)[0].tolist()
    assert got == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    packed = torch.tensor([[0x76543210, -0x1]], dtype=torch.int32).view(torch.int8)  # nibble n holds n
    scale = torch.full((1, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)   # 2^0
    decoded = fp4_tiles.fp4_tile_decoded(packed[:, :4].contiguous().repeat(1, 4), scale[:, :1].contiguous(), 0)
    codes = [Q.FP4_TABLE.tolist().index(v) for v in decoded[0, :8].tolist()]
    assert codes == [0, 4, 1, 5, 2, 6, 3, 7]



@pytest.mark.parametrize("t,iters", [(1, 1), (2, 2), (1, 4)])
def test_gemv_path(gen, t, iters):
    args = _case(gen, t)
    # dim 128 = 16 words, I 64 = 8 words: 4-word steps, so K splits of 4 / 2 / 1 steps (gate/up) and
    # 2 / 1 / 1 (down); the unrolled steps per split vary with iters
    got = moe.moe_fp4_triton(*args, gemv_block_n=32, gemv_block_kw=4, gemv_iters=iters, gemv_down_block_n=16,
                             gemv_down_block_kw=4, gemv_down_iters=iters)
    assert _rel(moe.moe_fp4_reference(*args), got) < 1e-5, gen.initial_seed()


@pytest.mark.parametrize("t,iters,every_byte", [(1, 1, False), (2, 2, False), (1, 4, True), (1, 8, False)])
def test_gemv_path_prefetch(gen, t, iters, every_byte):
    """gemv_prefetch (run 4's candidate): the rolled K loop with the next step's loads issued first,
    from one step per program to the whole K range in one program (iters 8: no K split, no atomics in
    gate/up), every FP4 byte and small scale bytes included."""
    args = _case(gen, t, every_byte=every_byte)
    got = moe.moe_fp4_triton(*args, gemv_block_n=32, gemv_block_kw=4, gemv_iters=iters, gemv_down_block_n=16,
                             gemv_down_block_kw=4, gemv_down_iters=iters, gemv_prefetch=True,
                             gemv_down_num_warps=2)
    assert _rel(moe.moe_fp4_reference(*args), got) < 1e-5, gen.initial_seed()


@pytest.mark.parametrize("t,iters,prefetch,hidden", [(1, 1, False, None), (2, 2, False, "reference"),
                                                     (1, 4, True, None), (3, 1, False, "fp32")])
def test_gemv_x_split_reads_the_same_values_in_the_same_order(gen, t, iters, prefetch, hidden):
    """gemv_x_split: the gate/up reads x from moe_gemv.split_vector's copy (entry 8 kw + j at j * K/8 + kw) instead
    of x itself; the same products summed in the same order, so the output is the same bit for bit (both numerics,
    K splits of several unrolled or prefetched steps, tokens sharing the copy), and the copy holds x's entries where
    the kernel's SPLIT_LAYOUT load looks for them."""
    args = _case(gen, t)
    knobs = dict(gemv_block_n=32, gemv_block_kw=4, gemv_iters=iters, gemv_down_block_n=16, gemv_down_block_kw=4,
                 gemv_down_iters=iters, gemv_prefetch=prefetch, hidden=hidden)
    want = moe.moe_fp4_triton(*args, **knobs)
    assert torch.equal(moe.moe_fp4_triton(*args, gemv_x_split=True, **knobs), want)
    x = args[0]
    xs = moe_gemv.split_vector(x)
    kw, j = torch.meshgrid(torch.arange(x.shape[1] // 8), torch.arange(8), indexing="ij")
    assert torch.equal(xs.reshape(t, -1)[:, (j * (x.shape[1] // 8) + kw).flatten()], x[:, (8 * kw + j).flatten()])


def test_gemv_split():
    assert moe_gemv._gemv_split(640, 128, 1) == (128, 1, 5)  # release gate/up: 640 words, 5 K splits
    assert moe_gemv._gemv_split(288, 64, 3) == (32, 3, 3)  # release down: 288 = 9 x 32 words
    assert moe_gemv._gemv_split(288, 32, 4) == (32, 3, 3)  # 4 steps do not divide 9: 3
    assert moe_gemv._gemv_split(16, 128, 2) == (16, 1, 1)
    assert moe_gemv._gemv_split(16, 2, 8) == (4, 4, 1)  # a step holds at least one scale group's 4 words


def test_gemv_path_every_fp4_byte(gen):
    args = _case(gen, 1, every_byte=True)
    got = moe.moe_fp4_triton(*args, gemv_block_n=64)
    assert _rel(moe.moe_fp4_reference(*args), got) < 1e-5, gen.initial_seed()


@pytest.mark.parametrize("block_k,group_m", [(32, 1), (64, 2)])
def test_grouped_path(gen, block_k, group_m):
    args = _case(gen, 13, e=4, k=2, every_byte=True)  # 26 pairs: several token blocks per expert
    got = moe.moe_fp4_triton(*args, gemv_max_pairs=0, block_m=16, block_n=32, block_k=block_k, group_m=group_m)
    assert _rel(moe.moe_fp4_reference(*args), got) < 1e-5, gen.initial_seed()


def _crowded_case(gen):
    """20 tokens, top-3 of 5 experts: experts 0 and 1 take every token (20 pairs each), the others a few or none."""
    x, w1, s1, w3, s3, w2, s2, _, tw = _case(gen, 20, e=5, k=3)
    ids = torch.stack([torch.tensor([0, 1, 2 + int(i) % 3]) for i in torch.randint(0, 9, (20,), generator=gen)])
    return x, w1, s1, w3, s3, w2, s2, ids.to(torch.int32), tw


def _agrees(want, got, hidden) -> bool:
    """Within 1e-5 of the float64 reference; with the engine's hidden state, but one token's rounding step."""
    return close_but_one_token(want, got, 1e-5) if hidden else _rel(want, got) < 1e-5


@pytest.mark.parametrize("hidden", [None, "reference"])
def test_split_tiles_take_the_crowded_experts_in_bigger_token_blocks(gen, hidden):
    """split_m: experts with more than block_m pairs run in split_m-token tiles of fewer weight rows, the others
    as before; every pair computed once (against the float64 reference), with and without the engine's hidden
    state. Skewed routing: experts 0 and 1 take every token (20 pairs each, past the 16-pair block), the others
    a few pairs or none."""
    args = _crowded_case(gen)
    ids = args[7]
    got = moe.moe_fp4_triton(*args, gemv_max_pairs=0, block_m=16, block_n=64, hidden=hidden, split_m=32)
    assert _agrees(moe.moe_fp4_reference(*args, hidden=hidden), got, hidden), gen.initial_seed()
    order, small, big = moe.moe_align(ids, 5, 16, 32)
    rows = {name: sorted(int(e) for e in blocks[0] if e >= 0) for name, blocks in (("small", small), ("big", big))}
    assert rows["big"] == [0, 1] and set(rows["small"]) <= {2, 3, 4}  # one 32-pair block each for 0 and 1
    with pytest.raises(ValueError, match="split_m"):
        moe.moe_fp4_triton(*args, gemv_max_pairs=0, block_m=16, block_n=64, split_m=16)


@pytest.mark.parametrize("hidden", [None, "reference"])
def test_down_tiles_apart_from_the_gate_up_tiles(gen, hidden):
    """down_block_n: the down GEMM in tiles of its own width (narrower or wider than the gate/up GEMM's), with
    and without split tiles; every pair once, against the float64 reference. down_maxnreg and maxnreg are launch
    options the interpreter ignores: here they only must be accepted."""
    args = _case(gen, 13, e=4, k=2)
    want = moe.moe_fp4_reference(*args, hidden=hidden)
    for tiles in (dict(block_n=32, down_block_n=64, maxnreg=168, down_maxnreg=0), dict(block_n=64, down_block_n=32),
                  dict(block_n=64, down_block_n=32, split_m=32)):
        got = moe.moe_fp4_triton(*args, gemv_max_pairs=0, block_m=16, hidden=hidden, **tiles)
        assert _agrees(want, got, hidden), (tiles, gen.initial_seed())
    with pytest.raises(ValueError, match="split_m"):  # 16 x 16 / 32 = 8 down rows a split tile: too few
        moe.moe_fp4_triton(*args, gemv_max_pairs=0, block_m=16, block_n=64, down_block_n=16, split_m=32)


class _Launches:
    """A kernel whose launches are recorded: (BM, BN, the register cap) each."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append((kwargs["BM"], kwargs["BN"], kwargs.get("maxnreg")))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("hidden", [None, "reference"])
def test_split_tiles_of_their_own_rows_and_cap(gen, hidden, monkeypatch):
    """split_n, split_maxnreg: the split tiles in rows and a register cap of their own beside narrow capped tiles
    (the same-area split tiles of a narrow tile are too few rows); every pair once, against float64, and each
    launch with the tiles and cap asked for (experts 0 and 1 crowded, the others not)."""
    args = _crowded_case(gen)
    want = moe.moe_fp4_reference(*args, hidden=hidden)
    up, down = _Launches(moe._moe_gate_up_kernel), _Launches(moe._moe_down_kernel)
    monkeypatch.setattr(moe, "_moe_gate_up_kernel", up)
    monkeypatch.setattr(moe, "_moe_down_kernel", down)
    got = moe.moe_fp4_triton(*args, gemv_max_pairs=0, block_m=16, block_n=32, maxnreg=168, down_block_n=32,
                             down_maxnreg=0, split_m=32, split_n=64, split_maxnreg=0, hidden=hidden)
    assert _agrees(want, got, hidden), gen.initial_seed()
    assert up.seen == [(16, 32, 168), (32, 64, None)] and down.seen == [(16, 32, None), (32, 64, None)]
    for rows in (8, 48 if hidden else 8):  # too few rows; the hidden state's whole 32-row groups
        with pytest.raises(ValueError, match="split_m"):
            moe.moe_fp4_triton(*args, gemv_max_pairs=0, block_m=16, block_n=32, split_m=32, split_n=rows,
                               hidden=hidden)


def test_no_limit_and_both_paths_agree(gen):
    args = _case(gen, 2)
    args = ((args[0].float() * 4).to(torch.bfloat16), *args[1:])  # well past the clamps
    want = moe.moe_fp4_reference(*args, swiglu_limit=3e38)
    a = moe.moe_fp4_triton(*args, swiglu_limit=3e38)
    b = moe.moe_fp4_triton(*args, swiglu_limit=3e38, gemv_max_pairs=0, block_m=16, block_n=32)
    assert _rel(want, a) < 1e-5 and _rel(want, b) < 1e-5, gen.initial_seed()
    assert _rel(moe.moe_fp4_reference(*args), want) > 1e-3  # the limit matters at these scales


@pytest.mark.parametrize("path", ["gemv", "grouped"])
def test_negative_ids_are_another_ranks_slots(gen, path):
    """Expert parallel: a rank holds experts [a, b) and passes the other slots as -1. Both paths add
    exactly the owned slots' share: the reference on the owned experts' stacks, and the float64 sum
    over slots computed expert by expert, where the two ranks' shares add up to the whole."""
    x, w1, s1, w3, s3, w2, s2, ids, tw = _case(gen, 5 if path == "grouped" else 2, e=4, k=2)
    knobs = dict(gemv_max_pairs=0, block_m=16, block_n=32) if path == "grouped" else {}
    whole = moe.moe_fp4_reference(x, w1, s1, w3, s3, w2, s2, ids, tw)
    shares = []
    for a, b in ((0, 2), (2, 4)):
        local = torch.where((ids >= a) & (ids < b), ids - a, -1).to(torch.int32)
        stacks = (w1[a:b], s1[a:b], w3[a:b], s3[a:b], w2[a:b], s2[a:b])
        got = moe.moe_fp4_triton(x, *stacks, local, tw, **knobs)
        want = moe.moe_fp4_reference(x, *stacks, local, tw)
        assert _rel(want, got) < 1e-5, gen.initial_seed()
        shares.append(got)
    assert _rel(whole, shares[0] + shares[1]) < 1e-5, gen.initial_seed()


def test_align_leaves_negative_ids_in_unused_blocks():
    ids = torch.tensor([[1, -1], [-1, 0], [1, -1]], dtype=torch.int32)
    order, expert, begin, end = moe.moe_align(ids, 2, 2)
    used = expert >= 0
    rows = torch.cat([order[int(b):int(e)] for b, e in zip(begin[used], end[used])]).tolist()
    assert sorted(rows) == [0, 3, 4]  # the pairs of experts 0 and 1 only, each once
    assert all(int(ids.flatten()[r]) == int(x) for b, e, x in zip(begin[used], end[used], expert[used])
               for r in order[int(b):int(e)].tolist())


@pytest.mark.parametrize("block_m,split_m", [(16, 32), (64, 128), (64, 96), (16, 48)])
def test_split_block_lists_hold_every_pair_at_their_tight_bounds(gen, block_m, split_m):
    """moe_align's split lists are sized tighter than one partial block a group (a block past the used ones is a
    program that only exits): whatever the routing (even, crowded into one or two experts, every expert just past
    block_m, slots computed elsewhere), the used blocks of both lists hold every pair of a real expert exactly once,
    each within its block's size, and no list is cut short (its last block unused or the pairs all placed)."""
    e, t, k = 24, 97, 4
    routings = [torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]),
                torch.arange(k).repeat(t, 1),  # four experts take every token
                (torch.arange(t * k) % e).view(t, k)]
    near = torch.arange(e).repeat_interleave(block_m + 1)[: t * k]  # experts just past block_m pairs
    routings.append(torch.cat([near, torch.full((t * k - near.numel(),), -1)]).view(t, k))
    skew = routings[0].clone()
    skew[::3, 1] = -1  # some slots another rank's
    routings.append(skew)
    for ids in routings:
        ids = ids.to(torch.int32)
        order, small, big = moe.moe_align(ids, e, block_m, split_m)
        placed = []
        for (expert, begin, end), size in ((small, block_m), (big, split_m)):
            used = expert >= 0
            assert ((end - begin)[used] <= size).all() and ((end - begin)[used] > 0).all()
            for b, x, ex in zip(begin[used].tolist(), end[used].tolist(), expert[used].tolist()):
                rows = order[b:x].tolist()
                assert all(int(ids.flatten()[r]) == ex for r in rows)
                placed += rows
        want = sorted(i for i, v in enumerate(ids.flatten().tolist()) if v >= 0)
        assert sorted(placed) == want, (block_m, split_m)


@pytest.mark.parametrize("block_m,sizes", [(64, (80, 96, 128)), (16, (24, 32)), (8, (16,))])
def test_tile_classes_put_each_expert_in_the_smallest_blocks_that_hold_it(gen, block_m, sizes):
    """moe_align_classes: every pair of a real expert in exactly one used block, no block past its size, and each
    expert's blocks the largest size but its last, which is the smallest size holding what is left (so a block is
    never more empty than the size below would leave it), over even, crowded and other-rank routings; sizes out of
    order refused."""
    e, t, k = 24, 97, 4
    classes = (block_m, *sizes)
    routings = [torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]),
                torch.arange(k).repeat(t, 1), (torch.arange(t * k) % e).view(t, k)]
    skew = routings[0].clone()
    skew[::3, 1] = -1
    routings.append(skew)
    for ids in routings:
        ids = ids.to(torch.int32)
        order, lists = moe.moe_align_classes(ids, e, block_m, sizes)
        placed, per_expert = [], {}
        for (expert, begin, end), size in zip(lists, classes):
            used = expert >= 0
            for b, x, ex in zip(begin[used].tolist(), end[used].tolist(), expert[used].tolist()):
                assert 0 < x - b <= size
                rows = order[b:x].tolist()
                assert all(int(ids.flatten()[r]) == ex for r in rows)
                placed += rows
                per_expert.setdefault(ex, []).append((b, x - b, size))
        assert sorted(placed) == sorted(i for i, v in enumerate(ids.flatten().tolist()) if v >= 0)
        for ex, blocks in per_expert.items():
            blocks.sort()
            assert all(n == size == classes[-1] for _, n, size in blocks[:-1])  # full largest blocks first
            _, n, size = blocks[-1]
            assert size == min(c for c in classes if c >= n), (ex, blocks)
    with pytest.raises(ValueError, match="ascending and past block_m"):
        moe.moe_align_classes(routings[0].int(), e, 64, (128, 96))


def test_token_blocks_of_several_sizes_are_refused_outside_the_register_operand_form(gen):
    """split_m as a tuple of sizes is the register-operand Gluon form's (blocks of 80 or 96 pairs are two MMAs
    there); the Triton forms' power-of-two blocks refuse it by name, before any launch."""
    args = _case(gen, 13, e=4, k=2)
    with pytest.raises(ValueError, match="token blocks of several sizes run in the register-operand form"):
        moe.moe_fp4_triton(*args, gemv_max_pairs=0, block_m=16, hidden="reference", split_m=(24, 32))
