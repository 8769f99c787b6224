"""Sparse attention kernel (kernels/sparse_attn.py) under TRITON_INTERPRET=1: the in-register decoders
bit for bit against engine.quant, and the split-KV path (partials + merge with the sink) and the two-pass
decode form (kernels/sparse_attn_decode.py) against the float64 reference."""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("these tests run the kernels under TRITON_INTERPRET=1", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kernels._formats  # noqa: E402
import kernels.sparse_attn  # noqa: E402
import kernels.sparse_attn_decode  # noqa: E402

for _m in (kernels._formats, kernels.sparse_attn, kernels.sparse_attn_decode):  # jit functions made without
    importlib.reload(_m)                                                        # the interpreter

from engine import quant as Q  # noqa: E402
from kernels import sparse_attn as A  # noqa: E402
from kernels import sparse_attn_decode as AD  # noqa: E402
from tests.sparse_attn_inputs import attention_inputs, every_fp4_code_and_scale  # noqa: E402

@triton.jit
def _fp4_probe(kvh_ptr, kvs_ptr, ent_ptr, out_ptr, BN: tl.constexpr, D: tl.constexpr):
    ent = tl.load(ent_ptr + tl.arange(0, BN))
    x, s = A._raw_tile(kvh_ptr, kvs_ptr, kvh_ptr, kvs_ptr, ent, False, D)
    kv = A._fp4_decode(x, s, BN, D, tl.float32)
    tl.store(out_ptr + tl.arange(0, BN)[:, None] * D + tl.arange(0, D)[None, :], kv)


@triton.jit
def _win_probe(winw_ptr, wins_ptr, ent_ptr, out_ptr, BN: tl.constexpr, D: tl.constexpr):
    ent = tl.load(ent_ptr + tl.arange(0, BN))
    x, s = A._raw_tile(winw_ptr, wins_ptr, winw_ptr, wins_ptr, ent, True, D)
    kv = A._win_decode(x, s, BN, D, tl.float32)
    tl.store(out_ptr + tl.arange(0, BN)[:, None] * D + tl.arange(0, D)[None, :], kv)


@triton.jit
def _fp4_bytes_probe(kvb_ptr, kvs_ptr, ent_ptr, out_ptr, BN: tl.constexpr, D: tl.constexpr):
    ent = tl.load(ent_ptr + tl.arange(0, BN))
    b, s = AD._fp4_bytes(kvb_ptr, kvs_ptr, ent, D, 0, D)
    kv = AD._fp4_bytes_decoded(b, s, BN, D, tl.float32)
    tl.store(out_ptr + tl.arange(0, BN)[:, None] * D + tl.arange(0, D)[None, :], kv)


def test_fp4_bytes_decode_every_code_and_scale():
    """The bf16x2 form's decode (bytes + bit placement of e2m1_scaled_pairs, its float32 lanes here): all
    256 bytes against all E4M3 scale bytes, a skipped slot as zeros: exact, at 2^-8 of the value."""
    d, n = 64, 64
    packed, sc = every_fp4_code_and_scale(d, n)
    ent = torch.tensor(list(range(n - 1, -1, -1)), dtype=torch.int32)
    ent[7] = -1
    out = torch.empty(n, d)
    _fp4_bytes_probe[(1,)](packed.view(torch.uint8), sc, ent, out, BN=n, D=d)
    want = Q.dequantize_fp4(packed, sc.view(torch.float8_e4m3fn), 16).float()[ent.clamp_min(0).long()]
    want[7] = 0
    assert torch.equal(out * 256, want)


def test_fp4_decode_every_code_and_scale():
    """All 256 packed bytes against all 256 E4M3 scale bytes (NaN scales excepted), incl. subnormal
    scales and the E2M1 codes 0/1 that go through float32 subnormals: exact, at 2^-8 of the value."""
    d, n = 64, 64
    packed, sc = every_fp4_code_and_scale(d, n)
    scale = sc.view(torch.float8_e4m3fn)
    ent = torch.tensor(list(range(n - 1, -1, -1)), dtype=torch.int32)  # rows out of order
    ent[5] = -1  # a skipped slot decodes to zeros
    out = torch.empty(n, d)
    _fp4_probe[(1,)](packed.view(torch.int16), sc, ent, out, BN=n, D=d)
    want = Q.dequantize_fp4(packed, scale, 16).float()[ent.clamp_min(0).long()]
    want[5] = 0
    assert torch.equal(out * 256, want)


@triton.jit
def _win_bytes_probe(winb_ptr, wins_ptr, ent_ptr, out_ptr, BN: tl.constexpr, D: tl.constexpr, DC: tl.constexpr):
    ent = tl.load(ent_ptr + tl.arange(0, BN))
    for c in tl.static_range(0, D // DC):
        kv = AD._win_bytes_decoded(winb_ptr, wins_ptr, ent, D, c * DC, DC, BN, tl.float32)
        tl.store(out_ptr + tl.arange(0, BN)[:, None] * D + c * DC + tl.arange(0, DC)[None, :], kv)


@pytest.mark.parametrize("dc", [16, 64])
def test_window_bytes_decode_every_byte(dc):
    """The bf16x2 form's window decode, in chunks narrower than a scale group and wider: every E4M3 byte
    but NaN, E8M0 scales 2^-118 .. 2^8, exact at 2^-8 of the value; a skipped slot as zeros."""
    d, n = 64, 64
    b = torch.arange(n * d, dtype=torch.int64).remainder(256).to(torch.uint8)
    b = torch.where((b & 0x7F) == 0x7F, torch.zeros_like(b), b).view(n, d)
    s = (torch.arange(n * d // 32, dtype=torch.int64).remainder(127) + 9).to(torch.uint8).view(n, d // 32)
    ent = torch.arange(n, dtype=torch.int32).flip(0)
    ent[3] = -1
    out = torch.empty(n, d)
    _win_bytes_probe[(1,)](b, s, ent, out, BN=n, D=d, DC=dc)
    want = Q.dequantize_fp8(b.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), 32).float()[ent.long()]
    want[3] = 0
    assert torch.equal(out * 256, want)


def test_window_decode_every_byte():
    """All 256 E4M3 bytes but NaN, E8M0 scales 2^-118 .. 2^8: exact, at 2^-8 of the value."""
    d, n = 64, 64
    b = torch.arange(n * d, dtype=torch.int64).remainder(256).to(torch.uint8)
    b = torch.where((b & 0x7F) == 0x7F, torch.zeros_like(b), b).view(n, d)
    s = (torch.arange(n * d // 32, dtype=torch.int64).remainder(127) + 9).to(torch.uint8).view(n, d // 32)
    ent = torch.arange(n, dtype=torch.int32).flip(0)
    out = torch.empty(n, d)
    _win_probe[(1,)](b.view(torch.int32), s, ent, out, BN=n, D=d)
    want = Q.dequantize_fp8(b.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), 32).float()
    assert torch.equal(out * 256, want[ent.long()])


def _rel(a, b):
    assert not torch.isnan(b).any(), "NaN in the kernel's output (unwritten or invalid)"
    a, b = a.double(), b.double()
    return ((a - b).norm() / a.norm()).item()


@pytest.mark.parametrize("layout", ["heads", "entries"])
@pytest.mark.parametrize("split,block_h,d_split", [(1, 16, 1), (2, 16, 1), (3, 8, 1), (None, 16, 1),
                                                   (1, 16, 2), (3, 8, 2)])
def test_split_kv_matches_reference(poisoned, split, block_h, d_split, layout):
    """Selected tiles 0..2 and window tiles 0..1 (block 16) shared over 1-3 splits and two head blocks;
    split 3 leaves the last split without window tiles; d_split 2: each program writes half the
    output columns (the poisoned buffers show a half left unwritten). Last row: nothing selected ->
    zeros."""
    g = torch.Generator().manual_seed(7 + (split or 0))
    args = attention_inputs(g, t=3, h=16, d=64, n=50, w=30, k=40, wn=20)
    args[3][-1], args[6][-1] = -1, -1
    want = A.sparse_attn_reference(*args)
    got = A.sparse_attn_triton(*args, block_h=block_h, block_n=16, num_warps=4, split=split, d_split=d_split,
                               layout=layout)
    assert _rel(want, got) < 1e-2  # bf16 output; the interpreter truncates to bf16
    assert (got[-1] == 0).all()
    # float_out: the same bf16 values as float32, rounded to nearest even in the kernel (one step from the
    # interpreter's truncated bf16 at most), on the split path's merge and the single program's store
    fo = A.sparse_attn_triton(*args, block_h=block_h, block_n=16, num_warps=4, split=split, d_split=d_split,
                              layout=layout, float_out=True)
    assert fo.dtype == torch.float32 and torch.equal(fo.bfloat16().float(), fo)
    assert ((fo - got.float()).abs() <= 2.0 ** -7 * fo.abs() + 1e-30).all() and _rel(want, fo) < 1e-2


@pytest.mark.parametrize("n_sel,n_win,block_n,split", [(500, 128, 64, 2), (500, 128, 32, 4), (0, 128, 64, 3),
                                                      (500, 0, 64, 16), (7, 3, 64, 2), (0, 0, 64, 2)])
def test_split_shares_cover_each_list_once_in_whole_tiles(n_sel, n_win, block_n, split):
    """A decode batch's splits of a (token, head block) (the one-pass Triton kernels'): every
    selected and window slot in exactly one split, each split's share whole tiles, no more splits than the longer
    list has tiles (so none of them is all empty)."""
    s, sel_per, win_per = A.split_shares(n_sel, n_win, block_n, split)
    tiles = max(-(-n_sel // block_n), -(-n_win // block_n), 1)
    assert 1 <= s <= min(split, tiles) and sel_per % block_n == 0 and win_per % block_n == 0
    for n, per in ((n_sel, sel_per), (n_win, win_per)):
        covered = [i for sp in range(s) for i in range(sp * per, min((sp + 1) * per, n))]
        assert covered == list(range(n))
    assert s == min(split, tiles)


@pytest.mark.parametrize("layout", ["heads", "entries"])
def test_split_with_only_window_work_and_dominant_sink(poisoned, layout):
    """One selected tile over 3 splits: splits 1-2 hold window tiles only. Head 0's sink is huge, so its
    output must vanish (the merge adds the sink once, not once per split)."""
    g = torch.Generator().manual_seed(3)
    args = attention_inputs(g, t=2, h=16, d=64, n=20, w=60, k=16, wn=48, q_scale=0.5)
    args[7][0] = 30.0
    want = A.sparse_attn_reference(*args)
    one = A.sparse_attn_triton(*args, block_n=16, num_warps=4, split=1, layout=layout)
    got = A.sparse_attn_triton(*args, block_n=16, num_warps=4, split=3, layout=layout)
    assert _rel(want, got) < 1e-2 and _rel(want, one) < 1e-2
    assert got[:, 0].abs().max() < 1e-6 < got[:, 1].abs().max()


@pytest.mark.parametrize("layout,opts", [("heads", {"split": 1}), ("entries", {"split": 2}),
                                         ("two_pass", {"two_pass": {"decode": "float32"}}),
                                         ("two_pass", {"two_pass": {"decode": "bf16x2"}})])
def test_window_only_calls_take_a_zero_width_selection(poisoned, layout, opts):
    """A layer without a global branch (SWA-only) selects nothing: a zero-width selection (a null pointer, which
    the wrapper does not launch with) gives what a slot of -1 gives, with no selected tile scored."""
    for wn in (48, 16):  # three window tiles; one (the two passes' single tile: a one-tile softmax row)
        g = torch.Generator().manual_seed(8)
        args = attention_inputs(g, t=3, h=16, d=64, n=4, w=60, k=1, wn=wn)
        args[3][:] = -1
        want = A.sparse_attn_reference(*args)
        none = args[3][:, :0]
        assert none.shape == (3, 0) and none.data_ptr() == 0
        got = A.sparse_attn_triton(*args[:3], none, *args[4:], block_n=16, layout=layout, **opts)
        assert _rel(want, got) < 1e-2
        assert torch.equal(got, A.sparse_attn_triton(*args, block_n=16, layout=layout, **opts))


def test_rejects_bad_head_dim_and_layout():
    g = torch.Generator().manual_seed(0)
    args = attention_inputs(g, t=1, h=16, d=96, n=8, w=8, k=4, wn=4)
    with pytest.raises(ValueError, match="head dim"):
        A.sparse_attn_triton(*args)
    args = attention_inputs(g, t=1, h=16, d=64, n=8, w=8, k=4, wn=4)
    with pytest.raises(ValueError, match="layout"):
        A.sparse_attn_triton(*args, layout="columns")


class _HostTraffic(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op that touches a host tensor or reads a value back to the host while the inputs
    live on the 'meta' device (a stand-in for CUDA: shapes without data). Either one breaks a CUDA
    graph capture (a host->device copy of a fresh tensor, a .item() sync)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat = torch.utils._pytree.tree_leaves((args, kwargs, out))
        if func is torch.ops.aten._local_scalar_dense.default or any(
                isinstance(x, torch.Tensor) and x.device.type != "meta" for x in flat):
            self.seen.append(str(func))
        return out


class _Recorder:
    """Stands in for a jit kernel: `kernel[grid](*args)` records the launch instead of running it."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, args, kw))


def _host_use_of(fn, args):
    """fn(*args) on 'meta' with every kernel recorded, not run -> (host uses found, the launches of the
    one-pass kernel, of its merge, of the two-pass scoring and of the weighted sum)."""
    spy, kern, merge, scores, wsum = _HostTraffic(), _Recorder(), _Recorder(), _Recorder(), _Recorder()
    meta = [x.to("meta") for x in args]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(A, "_sparse_attn_kernel", kern)
        mp.setattr(A, "_sparse_attn_t_kernel", kern)
        mp.setattr(A, "_merge_kernel", merge)
        for form in ("", "_bf16x2"):
            mp.setattr(AD, f"_scores{form}_kernel", scores)
            mp.setattr(AD, f"_weighted_sum{form}_kernel", wsum)
        with spy:
            fn(*meta)
    launches = (kern.launches, merge.launches, scores.launches, wsum.launches)
    host_args = [f"host tensor handed to a kernel: {tuple(a.shape)}"
                 for ran in launches for _, a_, _ in ran for a in a_
                 if isinstance(a, torch.Tensor) and a.device.type != "meta"]
    return spy.seen + host_args, *launches


@pytest.mark.parametrize("split,layout", [(1, "heads"), (4, "heads"), (4, "entries")])
def test_wrapper_keeps_everything_on_the_device(split, layout):
    """The decode path under CUDA-graph rules: with the inputs on a device, no host tensor is made,
    copied or handed to a kernel and nothing is read back, for one split and for partials + merge."""
    g = torch.Generator().manual_seed(5)
    args = attention_inputs(g, t=2, h=64, d=512, n=40, w=30, k=500, wn=128)
    bad, kern, merge, _, _ = _host_use_of(
        lambda *a: A.sparse_attn_triton(*a, block_n=32, split=split, d_split=2, layout=layout), args)
    assert bad == []
    assert len(kern) == 1 and len(merge) == (split > 1)


def test_host_traffic_check_catches_a_host_constant():
    """Negative control for the check above: a wrapper that makes its scale a host tensor per call
    (the pattern that broke graph capture) is flagged."""
    g = torch.Generator().manual_seed(5)
    args = attention_inputs(g, t=1, h=16, d=64, n=8, w=8, k=4, wn=4)

    def leaky(q, *rest):
        return A.sparse_attn_triton(q, *rest[:-1], rest[-1] * torch.tensor(1.0).to(q.device))
    bad, *_ = _host_use_of(leaky, args)
    assert bad


@pytest.mark.parametrize("t,cache_entries,layout,bh,bn,split", [(256, 4096, "two_pass", 64, 64, 0),
                                                                  (256, (1 << 33) // 512 + 1, "heads", 64, 32, 1),
                                                                  (8, 4096, "entries", 64, 32, 2),
                                                                  (64, 4096, "two_pass", 64, 128, 0)])
def test_default_layout_is_two_pass_unless_offsets_overflow(t, cache_entries, layout, bh, bn, split):
    """Without a layout the wrapper takes the measured best: a prefill in the two passes' bf16x2 form (64 heads x
    64 entries, 128 output columns a pass-2 program, no register cap: H100 runs 35d-35f), unless the cache is past
    their int32 offsets; then the heads kernel, 64 x 32. A small decode call (8 tokens) takes the one-pass kernel,
    64 heads x 32 entries in 2 splits, merged; a decode batch (64 tokens) the bf16x2 passes on 128-entry tiles."""
    g = torch.Generator().manual_seed(6)
    args = [x.to("meta") for x in attention_inputs(g, t=t, h=64, d=512, n=8, w=8, k=128, wn=64)]
    args[1] = torch.empty(cache_entries, 256, dtype=torch.uint8, device="meta")  # FP4: d/2 bytes a row
    args[2] = torch.empty(cache_entries, 32, dtype=torch.uint8, device="meta")
    ran = {"heads": _Recorder(), "entries": _Recorder(), "two_pass": _Recorder()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(A, "_sparse_attn_kernel", ran["heads"])
        mp.setattr(A, "_sparse_attn_t_kernel", ran["entries"])
        mp.setattr(A, "_merge_kernel", merge := _Recorder())
        mp.setattr(AD, "_scores_bf16x2_kernel", ran["two_pass"])
        mp.setattr(AD, "_weighted_sum_bf16x2_kernel", summed := _Recorder())
        mp.setattr(AD, "_scores_kernel", float32_form := _Recorder())
        A.sparse_attn_triton(*args)
    assert len(merge.launches) == (split > 1) and float32_form.launches == []
    assert [len(r.launches) for r in ran.values()] == [int(name == layout) for name in ran]
    grid, _, kw = ran[layout].launches[0]
    assert (kw["BH"], kw["BN"]) == (bh, bn)
    if layout == "two_pass":
        tiles = 3 if bn == 64 else 2  # 128 selected + 64 window entries
        assert grid == (tiles, t, 1) and kw["TPP"] == 1
        assert (kw.get("maxnreg"), summed.launches[0][2]["DV"]) == (None, 128)
        assert summed.launches[0][0] == (512 // 128, t, 1)
    else:
        assert grid[1] == split and kw["SPLIT"] == (split > 1)


def test_given_two_pass_options_are_taken_as_they_are():
    """A two_pass dict without a layout (the attn_bf16x2 knob's) still gets the two passes where the default
    would take them, with its own options: the float32 form on 64-entry tiles, no register cap."""
    g = torch.Generator().manual_seed(6)
    args = [x.to("meta") for x in attention_inputs(g, t=64, h=64, d=512, n=8, w=8, k=128, wn=64)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AD, "_scores_kernel", scored := _Recorder())
        mp.setattr(AD, "_weighted_sum_kernel", _Recorder())
        A.sparse_attn_triton(*args, two_pass={"decode": "float32"})
    (grid, _, kw), = scored.launches
    assert kw["BN"] == 64 and "maxnreg" not in kw and grid == (64, 3, 1)


def test_two_pass_takes_a_float32_q_as_bf16(poisoned):
    """The two passes read q once per entry tile: a float32 q (the reference stream's, bf16 values) reaches
    them as bf16, the values they round it to, so the output is the bf16 q's bit for bit."""
    g = torch.Generator().manual_seed(4)
    args = attention_inputs(g, t=3, h=32, d=64, n=50, w=30, k=40, wn=20)
    q16 = args[0].bfloat16()
    seen = []
    with pytest.MonkeyPatch.context() as mp:
        two_pass = AD.sparse_attn_two_pass
        mp.setattr(AD, "sparse_attn_two_pass", lambda q, *a, **kw: (seen.append(q.dtype), two_pass(q, *a, **kw))[1])
        got = A.sparse_attn_triton(q16.float(), *args[1:], block_n=16, layout="two_pass")
        want = A.sparse_attn_triton(q16, *args[1:], block_n=16, layout="two_pass")
    assert seen == [torch.bfloat16, torch.bfloat16] and torch.equal(got, want)


def test_default_layout_keeps_one_pass_for_few_heads():
    """Fewer than 16 heads do not fill the two passes' MMA: a prefill without a layout stays "entries"."""
    g = torch.Generator().manual_seed(6)
    args = [x.to("meta") for x in attention_inputs(g, t=64, h=8, d=64, n=8, w=8, k=16, wn=16)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(A, "_sparse_attn_t_kernel", entries := _Recorder())
        mp.setattr(A, "_merge_kernel", _Recorder())
        A.sparse_attn_triton(*args)
    assert len(entries.launches) == 1


@pytest.mark.parametrize("block_h,block_n,tiles,block_v,decode", [
    (16, 16, 1, 32, "float32"), (32, 16, 2, 64, "float32"), (16, 32, 3, 16, "float32"), (16, 16, 5, 64, "float32"),
    (16, 16, 1, 32, "bf16x2"), (32, 16, 2, 64, "bf16x2"), (16, 32, 3, 16, "bf16x2")])
def test_two_pass_matches_reference(poisoned, block_h, block_n, tiles, block_v, decode):
    """Scores then weighted sum over column blocks: selected tiles 0..2 (or 0..1 at 32 entries) and window
    tiles 0..1 over 1-5 tiles a scoring program and one or two head blocks; token 0's first selected tile
    holds no entry (its max stays finite, its weight 0); the last token selects nothing -> zeros. Same
    products as the entries layout, so their outputs agree closely too. The bf16x2 form decodes the same
    values and sums in the same order as the float32 form: equal outputs."""
    g = torch.Generator().manual_seed(11 + tiles)
    args = attention_inputs(g, t=3, h=32, d=64, n=50, w=30, k=40, wn=20)
    args[3][-1], args[6][-1] = -1, -1
    args[3][0, :block_n] = -1
    want = A.sparse_attn_reference(*args)
    opts = dict(tiles_per_program=tiles, block_v=block_v, decode=decode)
    got = A.sparse_attn_triton(*args, block_h=block_h, block_n=block_n, layout="two_pass", two_pass=opts)
    assert _rel(want, got) < 1e-2
    assert (got[-1] == 0).all()
    one_pass = A.sparse_attn_triton(*args, block_n=16, num_warps=4, split=1, layout="entries")
    assert _rel(one_pass, got) < 2e-3
    fo = A.sparse_attn_triton(*args, block_h=block_h, block_n=block_n, layout="two_pass", two_pass=opts,
                              float_out=True)
    assert fo.dtype == torch.float32 and torch.equal(fo.bfloat16().float(), fo) and _rel(want, fo) < 1e-2
    if decode != "float32":
        f32 = A.sparse_attn_triton(*args, block_h=block_h, block_n=block_n, layout="two_pass", float_out=True,
                                   two_pass=dict(opts, decode="float32"))
        assert _rel(f32, fo) < 1e-4  # same values and sums; only the MMA orientation differs


def test_two_pass_at_the_release_widths(poisoned):
    """64 heads of 512 (one head block, query chunks of 128: the window decode's whole-scale-group branch,
    DV 128), 4 selected tiles and 2 window tiles with empty slots: both forms as close to the float64
    reference as the bf16 output allows, and to each other."""
    g = torch.Generator().manual_seed(1)
    args = attention_inputs(g, t=2, h=64, d=512, n=300, w=130, k=200, wn=128)
    want = A.sparse_attn_reference(*args)
    f32 = A.sparse_attn_triton(*args, layout="two_pass", float_out=True)
    bf = A.sparse_attn_triton(*args, layout="two_pass", float_out=True, two_pass=dict(decode="bf16x2"))
    assert _rel(want, f32) < 1e-2 and _rel(want, bf) < 1e-2 and _rel(f32, bf) < 1e-4


@pytest.mark.parametrize("decode", ["float32", "bf16x2"])
def test_two_pass_window_only_programs_and_dominant_sink(poisoned, decode):
    """One selected tile, three window tiles, one tile a scoring program: three programs score window tiles
    only. Head 0's sink is huge, so its output must vanish (the sink enters the denominator once)."""
    g = torch.Generator().manual_seed(3)
    args = attention_inputs(g, t=2, h=16, d=64, n=20, w=60, k=16, wn=48, q_scale=0.5)
    args[7][0] = 30.0
    want = A.sparse_attn_reference(*args)
    got = A.sparse_attn_triton(*args, block_n=16, layout="two_pass", two_pass=dict(tiles_per_program=1,
                                                                                     block_v=32, decode=decode))
    assert _rel(want, got) < 1e-2
    assert got[:, 0].abs().max() < 1e-6 < got[:, 1].abs().max()


@pytest.mark.parametrize("decode", ["float32", "bf16x2"])
def test_two_pass_keeps_everything_on_the_device_and_launches_two_kernels(decode):
    """Under CUDA-graph rules (inputs on 'meta'): no host tensor made, copied or handed to a kernel, nothing
    read back; one scoring launch over (tokens, tile groups, head blocks), one weighted-sum launch over
    (tokens, column blocks, head blocks), at the release's decode shapes."""
    g = torch.Generator().manual_seed(5)
    args = attention_inputs(g, t=2, h=64, d=512, n=40, w=30, k=500, wn=128)
    bad, kern, merge, scores, wsum = _host_use_of(
        lambda *a: A.sparse_attn_triton(*a, layout="two_pass", two_pass=dict(tiles_per_program=3, block_v=128,
                                                                              decode=decode)), args)
    assert bad == [] and kern == [] and merge == []
    # 8 + 2 tiles of 64, 3 a program; 512 / 128 column blocks; the bf16x2 form's grids put a token's programs
    # next to each other (tile groups / column blocks first)
    first = (lambda g: g) if decode == "float32" else (lambda g: (g[1], g[0], g[2]))
    assert [first(grid) for grid, _, _ in scores] == [(2, 4, 1)]
    assert [first(grid) for grid, _, _ in wsum] == [(2, 4, 1)]


@pytest.mark.parametrize("decode", ["float32", "bf16x2"])
def test_two_pass_runs_tokens_in_chunks_that_fit_the_weights_budget(poisoned, decode):
    """A weights budget of two tokens' tiles: 5 tokens in chunks of 2, 2, 1 through one buffer, the same
    outputs as one chunk; on 'meta', three launches of each pass with the chunks' token counts as grids."""
    g = torch.Generator().manual_seed(9)
    args = attention_inputs(g, t=5, h=16, d=64, n=40, w=30, k=40, wn=20)
    budget = 2 * 5 * 16 * 16 * 2  # 2 tokens x (3 selected + 2 window tiles of 16) x 16 heads, float16
    opts = dict(block_v=32, decode=decode)
    whole = A.sparse_attn_triton(*args, block_n=16, layout="two_pass", two_pass=opts)
    chunked = A.sparse_attn_triton(*args, block_n=16, layout="two_pass", two_pass=dict(opts, weight_bytes=budget))
    assert torch.equal(whole, chunked) and _rel(A.sparse_attn_reference(*args), chunked) < 1e-2
    # the budget given on its own (the kernel ops' attn_big_chunks) joins the form's options
    assert torch.equal(A.sparse_attn_triton(*args, block_n=16, layout="two_pass", two_pass=opts, weight_bytes=budget),
                       chunked)
    _, _, _, scores, _ = _host_use_of(lambda *a: A.sparse_attn_triton(
        *a, block_n=16, layout="two_pass", two_pass=opts, weight_bytes=budget), args)
    assert [grid[0 if decode == "float32" else 1] for grid, _, _ in scores] == [2, 2, 1]
    bad, _, _, scores, wsum = _host_use_of(lambda *a: A.sparse_attn_triton(
        *a, block_n=16, layout="two_pass", two_pass=dict(opts, weight_bytes=budget)), args)
    assert bad == []
    tokens = 0 if decode == "float32" else 1  # the grid's token axis
    assert [grid[tokens] for grid, _, _ in scores] == [2, 2, 1] == [grid[tokens] for grid, _, _ in wsum]


def test_two_pass_rejects_what_it_cannot_tile():
    g = torch.Generator().manual_seed(5)
    args = attention_inputs(g, t=1, h=16, d=64, n=8, w=8, k=4, wn=4)
    with pytest.raises(ValueError, match="block_v 48"):
        A.sparse_attn_triton(*args, layout="two_pass", two_pass=dict(block_v=48))
    with pytest.raises(ValueError, match="head block 32"):
        AD.sparse_attn_two_pass(*args, scale=0.125, block_h=32)
    with pytest.raises(ValueError, match="head block 8 .* at least 16"):
        A.sparse_attn_triton(*args, block_h=8, layout="two_pass")
    with pytest.raises(ValueError, match="decode must be 'float32' or 'bf16x2', got 'fp8'"):
        A.sparse_attn_triton(*args, layout="two_pass", two_pass=dict(decode="fp8"))


_GPU_PROBE = '''
import torch
import triton
import triton.language as tl
from kernels import sparse_attn_decode as AD


@triton.jit
def probe(kvb_ptr, kvs_ptr, ent_ptr, out_ptr, BN: tl.constexpr, D: tl.constexpr):
    ent = tl.load(ent_ptr + tl.arange(0, BN))
    b, s = AD._fp4_bytes(kvb_ptr, kvs_ptr, ent, D, 0, D)
    kv = AD._fp4_bytes_decoded(b, s, BN, D, tl.bfloat16)
    tl.store(out_ptr + tl.arange(0, BN)[:, None] * D + tl.arange(0, D)[None, :], kv.to(tl.float32))
'''

_GPU_CHECK = """
import sys
import torch
sys.path.insert(0, TMP)
from engine import quant as Q
from kernels import sparse_attn as A
from tests.sparse_attn_inputs import attention_inputs, every_fp4_code_and_scale
import gpu_probe
d, n = 64, 64
packed, sc = every_fp4_code_and_scale(d, n)
ent = torch.arange(n, dtype=torch.int32).flip(0)
want = Q.dequantize_fp4(packed, sc.view(torch.float8_e4m3fn), 16).float()[ent.long()]
out = torch.empty(n, d, device="cuda")
gpu_probe.probe[(1,)](packed.view(torch.uint8).cuda(), sc.cuda(), ent.cuda(), out, BN=n, D=d, num_warps=4)
assert torch.equal(out.cpu() * 256, want), (out.cpu() * 256 - want).abs().max()
g = torch.Generator().manual_seed(SEED)
args = [x.cuda() for x in attention_inputs(g, t=64, h=64, d=512, n=4096, w=256, k=500, wn=128)]
want = A.sparse_attn_reference(*args)
f32 = A.sparse_attn_triton(*args, layout="two_pass", float_out=True)
bf = A.sparse_attn_triton(*args, layout="two_pass", float_out=True, two_pass=dict(decode="bf16x2"))
rel = lambda a, b: ((a.double() - b.double()).norm() / a.double().norm()).item()
assert rel(want, bf) < 1e-2 and rel(f32, bf) < 4e-3, (rel(want, bf), rel(f32, bf))  # <= ~1 bf16 ulp apart
print("equal outputs:", torch.equal(f32, bf), "rel to float32 form:", rel(f32, bf))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16x2 decode's PTX needs a GPU")
def test_bf16x2_decode_on_the_gpu(tmp_path):
    """Compiled on the GPU (a fresh process: this module's kernels are the interpreter's): every FP4 byte
    against every E4M3 scale through the PTX bit assembly, exact (E2M1 code 1 is a bf16 subnormal before
    its multiply); the two-pass decode at the release's shapes within the float64 reference's tolerance
    and about one bf16 rounding from the float32 form (same operands; the MMAs' orientation, so the order
    of their sums, differs)."""
    import subprocess
    import sys
    (tmp_path / "gpu_probe.py").write_text(_GPU_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = _GPU_CHECK.replace("TMP", repr(str(tmp_path))).replace("SEED", "7")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stderr[-3000:]
