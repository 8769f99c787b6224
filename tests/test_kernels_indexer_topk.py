"""The indexer's fused scoring + group maxima and the three-stage top-k (kernels/indexer.py, kernels/topk.py)
on the CPU interpreter, against float64 PyTorch references, including the paths the GPU's default shapes
do not take at these sizes (the radix fallback, tl.sort, groups wider than a tile)."""

from interpreted import interpreted  # first: the interpreter before triton

import pytest
import torch

from engine import quant as Q

_, topk_search, topk_split, topk, indexer = interpreted("_formats", "topk_search", "topk_split", "topk", "indexer")


def _ties(gen, rows, n):
    v = torch.randn(rows, n, generator=gen)
    v[0, ::3] = float("-inf")
    v[1, 10:400:3] = 1.5  # a run of exact ties around the top
    return v


@pytest.mark.parametrize("rows_path", [False, True])
@pytest.mark.parametrize("cap", [2048, 16])
def test_topk_paths_exact(gen, cap, rows_path):
    """Both paths (split: filter + resolve kernels; rows: one program per row); cap 16 forces the radix
    fallback (the run of 1.5 ties gives more candidates than slots)."""
    v = _ties(gen, 3, 500)
    lengths = torch.tensor([500, 450, 7], dtype=torch.int32)
    k = 32
    got = topk.topk_positions_triton(v, k, lengths, block=64, cap=cap, groups=64, rows_path=rows_path)
    assert torch.equal(got, topk.topk_positions_reference(v, k, lengths)), gen.initial_seed()
    assert (got[2, 7:] == -1).all()


@pytest.mark.parametrize("rows_path", [False, True])
def test_topk_tie_cut_without_fallback(gen, rows_path):
    """Exact ties at the k-th value, few enough to stay in the buffer: the earliest positions of the tied
    value win (the split path's counted cut, the rows path's running rank); a row of under k finite."""
    v = torch.randn(2, 900, generator=gen) * 0.1
    top = torch.randperm(900, generator=gen)
    v[0, top[:20]] = 2.0
    v[0, top[20:50]] = 1.5  # 20 + 12 of these 30 make the top 32
    v[1, :] = float("-inf")
    v[1, top[:9]] = torch.randn(9, generator=gen)
    got = topk.topk_positions_triton(v, 32, block=128, groups=128, rows_path=rows_path)
    assert torch.equal(got, topk.topk_positions_reference(v, 32)), gen.initial_seed()
    tied = torch.sort(top[20:50]).values[:12]
    assert set(got[0].tolist()) == set(top[:20].tolist()) | set(tied.tolist())
    assert (got[1, 9:] == -1).all()


@pytest.mark.parametrize("rows_path", [False, True])
def test_topk_wide_groups_and_all_ties(gen, rows_path):
    """Groups wider than the tile, and a row of equal values: the earliest positions win."""
    v = torch.randn(2, 3000, generator=gen)
    v[1] = 0.0
    got = topk.topk_positions_triton(v, 16, block=32, groups=32, rows_path=rows_path)
    assert torch.equal(got, topk.topk_positions_reference(v, 16)), gen.initial_seed()
    assert torch.equal(got[1], torch.arange(16, dtype=torch.int32))


def test_kth_largest_key_by_counting():
    """The counting search against torch's sort, with duplicates and a validity mask."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(x_ptr, m_ptr, need_ptr, o_ptr):
        i = tl.arange(0, 256)
        key = topk_search._ordered_key(tl.load(x_ptr + i))
        o = topk_search._kth_largest_key(key, tl.load(m_ptr + i) != 0, tl.load(need_ptr))
        tl.store(o_ptr, o.to(tl.int32, bitcast=True))

    g = torch.Generator().manual_seed(3)
    x = torch.randint(-5, 6, (256,), generator=g).float() * torch.rand(256, generator=g).round(decimals=1)
    valid = torch.rand(256, generator=g) > 0.3
    for need in (1, 7, 64, int(valid.sum())):
        o = torch.zeros(1, dtype=torch.int32)
        k[(1,)](x, valid.to(torch.int8), torch.tensor([need], dtype=torch.int32), o)
        want = torch.sort(x[valid], descending=True).values[need - 1]
        bits = want.view(torch.int32).item()
        key = (bits & 0xFFFFFFFF) ^ (0xFFFFFFFF if bits < 0 else 0x80000000)  # the order-preserving map
        assert (o.item() & 0xFFFFFFFF) == key, need


class _Launches:
    """Stands in for a @triton.jit kernel: records the tensors of each launch instead of running it."""

    def __init__(self, name, seen):
        self.name, self.seen = name, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen += [(self.name, a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        return launch


def test_entry_points_capturable_in_a_cuda_graph(monkeypatch):
    """No host tensor and no host sync per call (either breaks CUDA-graph capture): with every input on
    the meta device and the kernels stubbed, no op may touch a non-meta tensor, read a value back
    (.item() on meta raises), and every launched tensor must be on the inputs' device."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bad = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat = [*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list)) else [out])]
            if any(isinstance(a, torch.Tensor) and a.device.type != "meta" for a in flat):
                self.bad.append(str(func))
            return out

    seen = []
    for mod, name in [(topk_split, "_group_max_kernel"), (topk_split, "_filter_kernel"),
                      (topk_split, "_resolve_kernel"), (topk, "_row_select_kernel"), (indexer, "_indexer_kernel")]:
        monkeypatch.setattr(mod, name, _Launches(name, seen))
    meta = torch.device("meta")
    h, d = 32, 128
    with HostOps() as mode:
        for rows, n in ((1, 1 << 20), (2, 5000), (128, 65536)):
            v = torch.empty(rows, n, device=meta)
            topk.topk_positions_triton(v, 512, torch.empty(rows, dtype=torch.int32, device=meta))
            topk.topk_positions_triton(v, 512)
            args = (torch.empty(rows, h, d // 2, dtype=torch.int8, device=meta),
                    torch.empty(rows, h, d // 32, dtype=torch.float8_e8m0fnu, device=meta),
                    torch.empty(n, d // 2, dtype=torch.int8, device=meta),
                    torch.empty(n, d // 32, dtype=torch.float8_e8m0fnu, device=meta),
                    torch.empty(rows, h, device=meta), torch.empty(rows, dtype=torch.int32, device=meta))
            indexer.indexer_topk_triton(*args, topk=512)
            indexer.indexer_scores_triton(*args)
    assert mode.bad == [], mode.bad
    names = {name for name, _ in seen}
    assert names == {"_group_max_kernel", "_filter_kernel", "_resolve_kernel", "_row_select_kernel",
                     "_indexer_kernel"}, names
    assert all(t.device.type == "meta" for _, t in seen), [(n_, t.device) for n_, t in seen if t.device.type != "meta"]


def test_fp4_to_e4m3_bytes_bit_assembly():
    """Every packed byte: the two E4M3 bytes are the E2M1 values times 2^-6 (via torch's float8 view)."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(b_ptr, o_ptr):
        r = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
        b = tl.load(b_ptr + r)
        e = indexer._fp4_bytes_to_e4m3(b, False)
        tl.store(o_ptr + tl.arange(0, 16)[:, None] * 32 + tl.arange(0, 32)[None, :], e)

    b = torch.arange(256, dtype=torch.uint8)
    o = torch.zeros(512, dtype=torch.uint8)
    k[(1,)](b, o)
    want = Q.FP4_TABLE[torch.stack([b.long() & 15, b.long() >> 4], -1).flatten()] * 2.0 ** -6
    assert torch.equal(o.view(torch.float8_e4m3fn).float(), want.float())


def _inputs(gen, t, h, d, n, pool, spread=4):
    """FP4 queries and keys whose 32-groups differ in scale by up to 2^(2 * spread)."""
    def draw(*shape):
        e = torch.randint(-spread, spread + 1, (*shape[:-1], shape[-1] // 32, 1), generator=gen)
        x = torch.randn(*shape, generator=gen) * (2.0 ** e.float()).expand(*shape[:-1], shape[-1] // 32, 32).flatten(-2)
        return Q.quantize_fp4(x, 32)
    q, k = draw(t, h, d), draw(n, d)
    w = torch.randn(t, h, generator=gen)
    nv = torch.randint(0, n + 1, (t,), generator=gen, dtype=torch.int32)
    nv[0] = n
    pm = (torch.rand(t, -(-n // 8), generator=gen) > 0.3) if pool else None
    return (*q, *k, w, nv, pm)


@pytest.mark.parametrize("t,h,d,n,pool,tune", [
    (1, 4, 64, 300, True, {}),
    (2, 8, 128, 700, False, {"block_n": 16, "groups": 8}),  # maxima over groups of several tiles
    (18, 2, 32, 250, True, {"block_t": 8, "chunk": 64}),
    (18, 2, 32, 250, True, {"block_t": 8, "block_n": 32, "groups": 64, "rows_path": True}),  # groups of 4 in a tile
    (3, 4, 64, 600, False, {"block_n": 64, "groups": 128, "rows_path": False}),  # split path, groups of 8
    (1, 4, 128, 1000, True, {"block_n": 32}),  # decode loop with prefetched key bytes (the default at D=128)
    (2, 4, 128, 700, False, {"block_n": 32, "groups": 64, "chunk": 96, "prefetch_keys": True}),
])
def test_indexer_fused_scores_and_topk(gen, t, h, d, n, pool, tune):
    args = _inputs(gen, t, h, d, n, pool)
    want = indexer.indexer_scores_reference(*args)
    got = indexer.indexer_scores_triton(*args, **{a: b for a, b in tune.items() if a not in ("groups", "rows_path")})
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)), gen.initial_seed()
    assert ((want[fin] - got[fin]).norm() / want[fin].norm()) < 1e-6, gen.initial_seed()
    sel = indexer.indexer_topk_triton(*args, topk=16, **tune)
    # the kernel's own fp32 scores ranked by the reference rule: the same positions, order and -1 padding
    assert torch.equal(sel, topk.topk_positions_reference(got, 16)), gen.initial_seed()
    ref = indexer.indexer_topk_reference(*args, topk=16)
    assert torch.equal((sel >= 0).sum(1), (ref >= 0).sum(1)), gen.initial_seed()


@pytest.mark.parametrize("rows_path", [False, True])
@pytest.mark.parametrize("num_warps", [4, 16])
def test_topk_hist_select_exact(gen, rows_path, num_warps):
    """select="hist" (the k-th keys by 8-bit histograms, run 4's candidate) on the cases of the
    counting tests: -inf entries, row lengths, a run of exact ties at the k-th value, a row of
    under k finite, a row of equal values, and the fewer-warps launch the bench sweeps."""
    v = _ties(gen, 3, 500)
    lengths = torch.tensor([500, 450, 7], dtype=torch.int32)
    got = topk.topk_positions_triton(v, 32, lengths, block=64, groups=64, rows_path=rows_path, select="hist",
                                     num_warps=num_warps)
    assert torch.equal(got, topk.topk_positions_reference(v, 32, lengths)), gen.initial_seed()
    w = torch.randn(3, 900, generator=gen) * 0.1
    top = torch.randperm(900, generator=gen)
    w[0, top[:20]] = 2.0
    w[0, top[20:50]] = 1.5
    w[1, :] = float("-inf")
    w[1, top[:9]] = torch.randn(9, generator=gen)
    w[2] = -0.0  # equal keys: the earliest positions
    got = topk.topk_positions_triton(w, 32, block=128, groups=128, rows_path=rows_path, select="hist",
                                     num_warps=num_warps)
    assert torch.equal(got, topk.topk_positions_reference(w, 32)), gen.initial_seed()
    assert torch.equal(got[2], torch.arange(32, dtype=torch.int32))


@pytest.mark.parametrize("hist_bits, bound_steps", [(5, 5), (8, 2), (5, 1), (8, 0)])
def test_split_path_hist_forms_exact(gen, hist_bits, bound_steps):
    """The split path's histogram forms (kernels/topk_split.py: digits of hist_bits, the filter's bound from its
    first bound_steps digits, a lower bound that lets more candidates in) pick the reference's positions: ties at
    the k-th value, row lengths, -inf entries, a row of equal keys, and a bound so coarse (one 2- or 8-bit digit)
    that the candidates overflow a small buffer into the radix fallback; each with the filter's slots reserved a
    tile at a time and a candidate at a time (atomic_slots), and the resolve over the buffer's first half where the
    candidates fit there (half_cap: a 1,024-slot buffer holds more than 512 of them with the bound at 0)."""
    v = _ties(gen, 3, 700)
    v[2] = -0.0
    lengths = torch.tensor([700, 650, 300], dtype=torch.int32)
    want = topk.topk_positions_reference(v, 32, lengths)
    form = dict(rows_path=False, select="hist", hist_bits=hist_bits, bound_steps=bound_steps)
    for atomic_slots, half_cap in ((False, False), (True, False), (True, True)):
        for cap in (2048, 1024, 64):
            got = topk.topk_positions_triton(v, 32, lengths, block=64, groups=64, cap=cap, atomic_slots=atomic_slots,
                                             half_cap=half_cap, **form)
            assert torch.equal(got, want), (gen.initial_seed(), cap, atomic_slots, half_cap)
        # a filter program's groups read a few at a time (filter_tile under its block: 16 groups of 16, 4 at a time),
        # the filter launched under a register cap
        got = topk.topk_positions_triton(v, 32, lengths, block=256, groups=64, filter_tile=64,
                                         atomic_slots=atomic_slots, filter_maxnreg=128, **form)
        assert torch.equal(got, want), (gen.initial_seed(), atomic_slots)


@pytest.mark.parametrize("bits", [8, 5, 6])
def test_kth_largest_key_by_histograms(bits):
    """The histogram search gives the counting search's key (duplicates, a validity mask, negatives), at
    digit widths that divide 32 (4 steps of 8) and that do not (a 2-bit first step, then 5s or 6s)."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(x_ptr, m_ptr, need_ptr, o_ptr, BITS: tl.constexpr):
        i = tl.arange(0, 256)
        key = topk_search._ordered_key(tl.load(x_ptr + i))
        ok = tl.load(m_ptr + i) != 0
        need = tl.load(need_ptr)
        tl.store(o_ptr, topk_search._kth_largest_key_hist(key, ok, need, BITS).to(tl.int32, bitcast=True))
        tl.store(o_ptr + 1, topk_search._kth_largest_key(key, ok, need).to(tl.int32, bitcast=True))
        tl.store(o_ptr + 2, topk_search._kth_largest_key_hist(key, ok, need, BITS, 3).to(tl.int32, bitcast=True))

    g = torch.Generator().manual_seed(5)
    x = torch.randint(-5, 6, (256,), generator=g).float() * torch.rand(256, generator=g).round(decimals=1)
    x[:40] = torch.randn(40, generator=g) * 1e-30
    valid = torch.rand(256, generator=g) > 0.3
    for need in (1, 7, 64, int(valid.sum())):
        o = torch.zeros(3, dtype=torch.int32)
        k[(1,)](x, valid.to(torch.int8), torch.tensor([need], dtype=torch.int32), o, BITS=bits)
        assert o[0].item() == o[1].item(), need
        # three steps only: the key's top digits, the rest zero (a lower bound for the candidates)
        low = 32 - (32 - 32 // bits * bits or bits) - 2 * bits
        assert (o[2].item() & 0xFFFFFFFF) == (o[1].item() & 0xFFFFFFFF) >> low << low, (need, bits)


@pytest.mark.parametrize("form", [dict(whole_row=4096), dict(whole_row=4096, hist_bits=5),
                                  dict(whole_row=4096, select="count"), dict(hist_bits=5), dict(hist_bits=6),
                                  dict(hist_bits=5, bound_steps=2), dict(bound_steps=1), dict(half_tile=True),
                                  dict(half_tile=True, cap=64),
                                  dict(whole_row=4096, whole_half=True),
                                  dict(max_block=64), dict(max_block=8), dict(max_block=4096)])
def test_topk_rows_path_forms_exact(gen, form):
    """The rows path's whole-row tile (the layer's causal rows: lengths 1..n, rows of at most k taken whole
    without a search), the narrower histogram digits and the group maxima's pass at any width (4 groups a step,
    under one group: one, past the row: one masked step), against the reference: -inf entries, a run of exact
    ties at the k-th value, a row of equal values, a row of under k finite, rows of any length."""
    n, k = 700, 32
    v = _ties(gen, 8, n)
    v[2] = 0.0
    v[3] = float("-inf")
    v[3, 5:14] = torch.randn(9, generator=gen)
    top = torch.randperm(n, generator=gen)
    v[4, top[:20]] = 2.0
    v[4, top[20:50]] = 1.5
    lengths = torch.tensor([n, 450, n, n, n, 33, 32, 1], dtype=torch.int32)
    got = topk.topk_positions_triton(v, k, lengths, rows_path=True, block=128, groups=64, **form)
    assert torch.equal(got, topk.topk_positions_reference(v, k, lengths)), gen.initial_seed()
    assert torch.equal(got[2], torch.arange(k, dtype=torch.int32))
    assert torch.equal(got[7], torch.tensor([0] + [-1] * (k - 1), dtype=torch.int32))
    assert torch.equal(topk.topk_positions_triton(v, k, rows_path=True, **form), topk.topk_positions_reference(v, k))
    for n in (1, 3, 40):  # rows narrower than k, one entry, a tile of 64 (its half: 32)
        w = v[:, :n].contiguous()
        got = topk.topk_positions_triton(w, k, rows_path=True, **form)
        assert torch.equal(got, topk.topk_positions_reference(w, k)), n


def test_topk_select_option_is_checked():
    with pytest.raises(ValueError, match="select must be"):
        topk.topk_positions_triton(torch.zeros(2, 64), 16, select="sort")


def test_topk_default_knobs_per_path(gen):
    """No knobs given: each path takes its measured defaults (rows path: ROWS_PATH_DEFAULTS, the H200
    sweep's winner; split path below ROWS_MIN rows) and both agree with the reference, ties included."""
    rows = topk.ROWS_MIN
    v = _ties(gen, rows, 3000)
    lengths = torch.randint(1, 3001, (rows,), generator=gen, dtype=torch.int32)
    lengths[1] = 3000
    assert torch.equal(topk.topk_positions_triton(v, 64, lengths), topk.topk_positions_reference(v, 64, lengths)), \
        gen.initial_seed()
    few = v[:3].contiguous()
    assert torch.equal(topk.topk_positions_triton(few, 64), topk.topk_positions_reference(few, 64)), gen.initial_seed()


def test_whole_row_topk_knob_picks_what_the_group_maxima_pick(tmp_path, monkeypatch):
    """topk_whole_row: a 64-token prefill's indexer rows (the top-k kernel's rows path) reach the kernel as
    whole-row tiles, and every picking layer picks what the group-maxima path picks (the kernel interpreted)."""
    import kernels.dispatch as dispatch
    from engine.ops.knobs import TOPK_WHOLE_ROW
    from test_kernel_ops_prefill import _assert_same_picks, _tiny_prefill

    asked = []

    def kernel(values, k, lengths=None, **form):
        asked.append((values.shape[0], form.get("whole_row")))
        return topk.topk_positions_triton(values, k, lengths, **form)

    monkeypatch.setitem(dispatch._PAIRS, "topk_positions", (kernel, kernel))
    run = _tiny_prefill(tmp_path, monkeypatch, lambda args: None, tokens=64)
    out = {}
    for knob in (0, 1):
        asked.clear()
        out[knob] = run(lambda model: model.ops.set_knobs(f"topk_whole_row={knob}"))
        assert asked and {w for _, w in asked} == {TOPK_WHOLE_ROW * knob}, asked
        assert all(rows >= topk.ROWS_MIN for rows, _ in asked), asked  # the rows path, where the tile applies
    _assert_same_picks(out[0], out[1])
