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
    the caches are past the two passes' int32 offsets (then the wrapper keeps the heads layout); nothing
    where the kernels' references run."""
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
