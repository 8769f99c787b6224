"""TritonOps' tuning knobs (engine/ops/triton.py) as decisions, without running a kernel: which launch options
each knob asks of the sparse attention kernel, and the routed experts' folded decode checked once a layer."""

import torch


def test_moe_fold_knob_checks_each_layers_scales_once(monkeypatch):
    """TritonOps._fold_ok: a layer's experts take the folded decode only where all three scale stacks fit it,
    read once a layer (the decode graphs record later steps: no host read then); forget drops the verdict."""
    import kernels.fp4_tiles as F
    from engine.ops.triton import TritonOps

    ops = TritonOps.__new__(TritonOps)
    ops._fold_fits, ops._raw, ops._experts, ops._bf16, ops._bf16_fits = {}, {}, {}, {}, {}
    fits = torch.full((2, 4, 2), F.FOLD_MAX_SCALE_BYTE, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    high = fits.view(torch.uint8).clone()
    high[1, 3, 0] += 1
    w = torch.zeros(2, 4, 32, dtype=torch.int8)
    reads = []
    monkeypatch.setattr(F, "fold_fits", lambda *s, _real=F.fold_fits: (reads.append(len(s)), _real(*s))[1])
    assert ops._fold_ok("layers.3.ffn.", (w, fits, w, fits, w, fits))
    assert not ops._fold_ok("layers.4.ffn.", (w, fits, w, fits, w, high.view(torch.float8_e8m0fnu)))
    assert ops._fold_ok("layers.3.ffn.", (w, high, w, high, w, high)) and reads == [3, 3]  # cached
    ops.forget("layers.3.")
    assert not ops._fold_ok("layers.3.ffn.", (w, high.view(torch.float8_e8m0fnu), w, fits, w, fits))
    assert ops.set_knobs("moe_fold=1") == {"moe_fold": True}


def test_attention_knobs_ask_the_kernel_for_two_passes_where_offsets_reach(monkeypatch):
    """TritonOps._attn_launch: attn_bf16x2 names the two passes' form, attn_two_pass the layout, except where
    the caches are past the two passes' int32 offsets (then the wrapper keeps the heads layout); attn_one_pass
    the one-pass kernel's layout for the caches; nothing where the kernels' references run."""
    import engine.ops.triton as T

    ops = T.TritonOps.__new__(T.TritonOps)
    ops.device = torch.device("cpu")
    ops.set_knobs("attn_two_pass=1,attn_bf16x2=1")
    q = torch.empty(4, 16, 512, device="meta")
    small, huge = torch.empty(100, 256, device="meta"), torch.empty(2 ** 24, 256, device="meta")
    args = lambda kv: (q, kv, None, None, small)
    monkeypatch.setattr(T, "interpreter_active", lambda: False)
    assert ops._attn_launch(args(small)) == {}  # a CPU device, no interpreter: the reference runs
    monkeypatch.setattr(T, "interpreter_active", lambda: True)
    assert ops._attn_launch(args(small)) == {"two_pass": {"decode": "bf16x2"}, "layout": "two_pass"}
    assert ops._attn_launch(args(huge)) == {"two_pass": {"decode": "bf16x2"}}
    ops.set_knobs("attn_bf16x2=0")
    assert ops._attn_launch(args(small)) == {"layout": "two_pass"}
    ops.set_knobs("attn_two_pass=0,attn_one_pass=1")  # the one-pass kernel's layouts, for an A/B
    assert ops._attn_launch(args(small)) == {"layout": "entries"}
    assert ops._attn_launch(args(huge)) == {"layout": "heads"}
    ops.set_knobs("attn_one_pass=0,attn_big_chunks=1")  # the two passes' weights buffer doubled, nothing else
    assert ops._attn_launch(args(small)) == {"weight_bytes": 1 << 27}


def test_attn_wgmma_knob_takes_the_one_pass_gluon_form_only_where_it_runs_and_fills_the_sms(monkeypatch):
    """attn_wgmma: layout "wgmma" for a call whose 64-head programs fill the SMs at least once, on a device where the
    Gluon form runs, with heads and head dim it tiles; otherwise the other knobs' options (here none)."""
    import engine.ops.triton as T
    from kernels import sparse_attn_wgmma

    ops = T.TritonOps.__new__(T.TritonOps)
    ops.device = torch.device("cpu")
    ops.set_knobs("attn_wgmma=1,attn_staged=0,attn_wide_store=0")  # its options (on by default) come in below
    monkeypatch.setattr(T, "interpreter_active", lambda: True)
    small = torch.empty(100, 256, device="meta")
    args = lambda t, h=64, d=512: (torch.empty(t, h, d, device="meta"), small, None, None, small)
    for runs, t, h, d, want in ((True, 132, 64, 512, {"layout": "wgmma"}), (True, 66, 128, 512, {"layout": "wgmma"}),
                                (True, 131, 64, 512, {}), (True, 4096, 16, 512, {}), (True, 4096, 64, 1024, {}),
                                (False, 4096, 64, 512, {})):
        monkeypatch.setattr(sparse_attn_wgmma, "runs_on", lambda device, _runs=runs: _runs)
        assert ops._attn_launch(args(t, h, d)) == want, (runs, t, h, d)
    ops.set_knobs("attn_staged=1")  # the staged copies: an option of that form, where it runs
    assert ops._attn_launch(args(132)) == {}  # (the last runs_on: False)
    monkeypatch.setattr(sparse_attn_wgmma, "runs_on", lambda device: True)
    assert ops._attn_launch(args(132)) == {"layout": "wgmma", "wgmma": {"staged": True}}
    assert ops._attn_launch(args(131)) == {}
    ops.set_knobs("attn_wide_store=1")  # the 16-byte output stores (after Nsight 42d), beside the staged copies
    assert ops._attn_launch(args(132)) == {"layout": "wgmma", "wgmma": {"staged": True, "wide_store": True}}
    ops.set_knobs("attn_staged=0,attn_late_sum=1")
    assert ops._attn_launch(args(132)) == {"layout": "wgmma", "wgmma": {"wide_store": True, "late_sum": True}}
    assert ops._attn_launch(args(131)) == {}
    assert T.KernelKnobs.attn_wide_store and not T.KernelKnobs.attn_late_sum  # the defaults (run 44b's layer A/B)


def test_mhc_f32_stream_knob_hands_the_stream_over_as_it_is(monkeypatch):
    """TritonOps._mhc over `reference` numerics: with mhc_f32_stream (the default) the kernel gets the float32
    stream and y as they are, with bf16_values, and its outputs come back as they are; off, bf16 copies go in
    and float32 copies come out. The same values either way (the mHC kernel's tests: bit for bit)."""
    import engine.ops.triton as T
    from engine.ops import ops_for

    monkeypatch.setattr(T, "checkpoint_backed", lambda weights: True)
    ops = T.TritonOps(ops_for("reference"), type("W", (), {"reader": None})(), "cpu")
    ops.set_knobs("stream_bf16=0")  # the float32 stream this knob is about
    g = torch.Generator().manual_seed(2)
    t, dim = 5, 32
    x, y = torch.randn(t, 4, dim, generator=g).bfloat16().float(), torch.randn(t, dim, generator=g).bfloat16().float()
    fn, scale, base = torch.randn(24, 4 * dim, generator=g) * 0.05, torch.rand(3, generator=g) + 0.5, torch.zeros(24)
    pre, post, comb = torch.rand(t, 4, generator=g), torch.rand(t, 4, generator=g), torch.rand(t, 4, 4, generator=g)
    seen, kernel = [], ops._kernel
    monkeypatch.setattr(ops, "_kernel", lambda name: lambda *a, **k: (seen.append((a, k)), kernel(name)(*a, **k))[1])
    out = {}
    for wide in (True, False):
        ops.set_knobs(f"mhc_f32_stream={int(wide)}")
        out[wide] = ops._mhc(0, "test", x, fn, scale, base, pre, (y, post, comb), 1e-6, 1e-20, 20)
        args, kwargs = seen.pop()
        assert (args[0] is x and args[5] is y) == wide and args[0].dtype == (torch.float32 if wide else torch.bfloat16)
        assert kwargs.get("bf16_values", False) == wide
        assert all(o.dtype == torch.float32 for o in out[wide])
    assert all(torch.equal(a, b) for a, b in zip(out[True], out[False]))
