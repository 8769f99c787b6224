"""The twenty-third session's prefill glue kernels compiled on the GPU (the interpreter tests run their Python,
not Triton's compiler, and the mHC's float32-stream form takes bf16 dots only there): each in a fresh process
(kernel modules other tests import under TRITON_INTERPRET=1 would stay interpreted), against its reference.
Skipped without a GPU; scripts/device_measure_call.sh's gputests step runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.triton_interp import env_without_interpreter

ROOT = Path(__file__).resolve().parent.parent
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: compiled kernels")


def _run(code: str, hang_s: int = 120) -> None:
    """`code` in a fresh process; past `hang_s` it prints every thread's stack and exits (a hung compile or
    kernel fails with where it hung: runs 29a and 30a's device steps timed out in this file with no output)."""
    head = f"import faulthandler, torch\nfaulthandler.dump_traceback_later({hang_s}, exit=True)\n"
    run = subprocess.run([sys.executable, "-c", head + "g = torch.Generator().manual_seed(23)\n" + code],
                         env=env_without_interpreter(), capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]


# what the GPU checks share: a bf16-rounded output within one bf16 step of the float64 reference's rounding, plus
# `slack` times the size of its terms (float32 sums in another order, where terms cancel near zero), and the share
# of values off by that step small (a wrong rounding mode, truncation for nearest, would put about half off);
# a failure names the measured share and worst excess
CHECKS = """
def step_check(name, got, want, scale, slack, share=0.05):
    got, want = got.double().cpu(), want.double().cpu()
    err = (got - want).abs()
    bound = want.abs() * 2.0**-7 + slack * scale.double().cpu()
    off = (got != want).double().mean().item()
    assert (err <= bound).all() and off < share, (name, f"share off {off:.2e}", f"worst err/bound {(err / bound).max().item():.3g}")
"""


@on_gpu
def test_mhc_float32_stream_and_bf16_stream_against_float64():
    """The fused mHC on the bf16 stream and on the float32 stream of bf16 values (its bf16 3-piece dots over 32-wide
    chunks of d, the bf16 stream's over wider ones), at one token, a decode step and a prefill, with and without
    the update: each against the float64 reference (the CPU's). The update within one bf16 step (plus float32
    rounding of its terms), the collapse so against the collapse of the stream the kernel stored; pre, post and
    comb, float32 from sums of 20,480 products in another order (H200 run 25: not bit for bit between the two forms
    at 64 tokens), within 1e-4 of float64's on that stream."""
    _run(CHECKS + """
from kernels import mhc
dim = 5120
for t in (1, 64, 4096):
    for post in (False, True):
        x = torch.randn(t, 4, dim, generator=g).bfloat16()
        args = [x, torch.randn(24, 4 * dim, generator=g) * 0.01, torch.rand(3, generator=g) + 0.5,
                torch.randn(24, generator=g) * 0.5, torch.rand(t, 4, generator=g)]
        if post:
            args += [torch.randn(t, dim, generator=g).bfloat16(), torch.rand(t, 4, generator=g) * 2,
                     torch.softmax(torch.randn(t, 4, 4, generator=g), -1)]
        wide = [a.float() if a.dtype == torch.bfloat16 else a for a in args]
        want = mhc.mhc_reference(*[a.double() for a in wide], bf16_values=True)
        # the update's terms' size: |post_old y| + sum |comb_old X|
        size = wide[6].double()[..., None] * wide[5].abs().double()[:, None] + torch.einsum(
            "tij,tid->tjd", wide[7].double(), wide[0].abs().double()) if post else None
        for form, out in (("bf16 stream", mhc.mhc_triton(*[a.cuda() for a in args])),
                          ("float32 stream", mhc.mhc_triton(*[a.cuda() for a in wide], bf16_values=True))):
            # the stream the kernel stored, and float64's mixes of it: a one-step difference in the update moves
            # the mixes (4K tokens of the bf16 stream with the update: pre 1.16e-4 off the reference's own update,
            # H100 run 27b), so they are checked against these
            own = (wide[0] if out[0] is None else out[0].cpu()).double()
            own_mixes = mhc.mhc_reference(own, *[v.double() for v in wide[1:5]], bf16_values=True)
            for i, name in enumerate(("update", "collapse", "pre", "post", "comb")):
                a, w = out[i], want[i]
                assert (a is None) == (w is None), (form, name)
                if a is None:
                    continue
                what = (form, name, t, post)
                if i == 0:
                    step_check(what, a, w, size, 2.0**-22)
                elif i == 1:  # against the collapse of the stream the kernel stored (a one-step difference in
                    # the update carries into the collapse, times pre_prev, past one step of a small collapse)
                    pre = wide[4].double()
                    w = torch.einsum("tc,tcd->td", pre, own).bfloat16().double()
                    step_check(what, a, w, torch.einsum("tc,tcd->td", pre, own.abs()), 2.0**-22)
                else:  # the mixes of the stream the kernel stored
                    err = (a.double().cpu() - own_mixes[i]).abs().max().item()
                    assert err < 1e-4, (what, err)
""")


@on_gpu
def test_engram_mix_rope_and_shared_expert_kernels_against_their_references():
    """The Engram's gated update against float64 (its gate from sums of 5,120 products: float32's error there,
    ~1e-5 of the gate, times the value, on top of the bf16 step), the RoPE in place and whole, the shared
    expert's SwiGLU against float64 and the bf16 add exactly."""
    _run(CHECKS + """
from engine.model.engram import engram_mix
from engine.model.moe import swiglu
from kernels import elementwise, engram, rope
t, hc, d = 64, 4, 5120
x = torch.randn(t, hc, d, generator=g).bfloat16().float()
kv = torch.randn(t, (hc + 1) * d, generator=g).bfloat16().float()
qw, kw = torch.rand(hc, d, generator=g) + 0.5, torch.randn(hc, d, generator=g)
mask = torch.rand(t, generator=g) > 0.2
got = engram.engram_mix_triton(x.cuda(), kv.cuda(), qw.cuda(), kw.cuda(), 1e-6, mask.cuda(), round_bf16=True)
want = engram_mix(x.double(), kv.double(), qw, kw, 1e-6, mask).bfloat16().double()
step_check("engram mix", got, want, x.abs() + kv[:, hc * d:].abs()[:, None], 2.0**-13)
assert torch.equal(got.cpu()[~mask], x[~mask])
table = torch.randn(4096, 32, 2, generator=g).cuda()
pos = torch.randint(0, 4096, (t,), generator=g).cuda()
for shape in ((t, 64, 512), (t, 128)):
    q = torch.randn(*shape, generator=g).bfloat16().float().cuda()
    whole = rope.rope_triton(q, pos, table)
    for y in (q.clone(), q.bfloat16()):
        assert rope.rope_triton(y, pos, table, inplace=True) is y and torch.equal(y.float(), whole), shape
a, b = torch.randn(t, 2304, generator=g) * 8, torch.randn(t, 2304, generator=g) * 8
got = elementwise.swiglu_triton(a.cuda(), b.cuda(), 10.0, round_bf16=True)
want = swiglu(a.double(), b.double(), 10.0).bfloat16().double()
step_check("swiglu", got, want, want.abs(), 2.0**-20)
narrow = elementwise.swiglu_triton(a.cuda(), b.cuda(), 10.0, round_bf16=True, bf16_out=True)
assert narrow.dtype == torch.bfloat16 and torch.equal(narrow.float(), got)
assert torch.equal(elementwise.add_triton(a.cuda(), b.cuda(), round_bf16=True).cpu(), (a + b).bfloat16().float())
assert torch.equal(elementwise.add_triton(a.cuda(), b.cuda(), bf16_out=True).cpu(), (a + b).bfloat16())
""")


@on_gpu
def test_quantizers_round_trip_and_x_values_bit_for_bit():
    """The compiled E4M3-per-32 quantizer, its round trip (natural and nibble order), the bf16 form's x values and
    the FP4 quantizer (both scale kinds, with the values) against engine.quant on the CPU, bit for bit, the sign of
    zero too, across 60 decades: where the scale is a power of two they take x times its reciprocal for x / scale,
    which is the quotient's own rounding, bit for bit, on a GPU that keeps every product's rounding."""
    _run("""
from engine import quant as Q
from kernels import fp8_linear, quant
from kernels.fp4_tiles import nib_order
from tests.layouts import mma_k_index
x = torch.randn(12, 5120, generator=g) * torch.logspace(-30, 30, 12)[:, None]
x[1, 32], x[1, 33:64] = 1.0, -1e-12
x[2, :32] = 0
x = x.bfloat16().float()
codes, scales = Q.quantize_fp8(x, 32)
qc, sc = quant.quantize_fp8_triton(x.cuda(), 32)
assert torch.equal(qc.cpu().view(torch.uint8), codes.view(torch.uint8))
assert torch.equal(sc.cpu().view(torch.uint8), scales.view(torch.uint8))
want = Q.dequantize_fp8(codes, scales, 32)
assert (want.view(torch.int32) == -2**31).sum() > 20   # negative zeros are among them
assert torch.equal(quant.fp8_roundtrip_triton(x.cuda(), 32).cpu().view(torch.int32), want.view(torch.int32))
narrow = quant.fp8_roundtrip_triton(x.cuda(), 32, bf16_out=True).cpu()
assert torch.equal(narrow.float().view(torch.int32), want.view(torch.int32))
nib = quant.fp8_roundtrip_triton(x.cuda(), 32, bf16_out=True, nib=True).cpu()
assert torch.equal(nib.view(torch.int16), nib_order(narrow).view(torch.int16))
idx = mma_k_index(5120)   # memory column c lands at idx[c] (kernels/_formats.py in_mma_k_order)
vals = fp8_linear.x_values_bf16(x.bfloat16().cuda()).cpu()
assert torch.equal(vals.float()[:, idx].view(torch.int32), want.view(torch.int32))
for block, kind in ((32, "e8m0"), (16, "e4m3")):   # the FP4 quantizer: the index queries, the compressor's entries
    packed, scales, values = Q.quantize_fp4_with_values(x, block, kind)
    for xx in (x, x.bfloat16()):
        q, s, v = (t.cpu() for t in quant.quantize_fp4_triton(xx.cuda(), block, kind, values=True))
        assert torch.equal(q, packed) and torch.equal(s.view(torch.uint8), scales.view(torch.uint8)), kind
        assert torch.equal(v.view(torch.int32), values.view(torch.int32)), kind
""")


@on_gpu
def test_fp8_linear_takes_the_rounded_input_it_is_given():
    _run("""
from kernels import fp8_linear
x = torch.randn(256, 1024, generator=g).cuda()
w = (torch.randn(512, 1024, generator=g) * 30).to(torch.float8_e4m3fn).cuda()
ws = torch.randint(118, 124, (16, 32), generator=g, dtype=torch.uint8).cuda().view(torch.float8_e8m0fnu)
own = fp8_linear.fp8_linear_triton(x, w, ws, mma="bf16", float_out=True)
given = fp8_linear.fp8_linear_triton(x, w, ws, mma="bf16", float_out=True, x_values=fp8_linear.x_values_bf16(x))
assert torch.equal(own, given)
""")


@on_gpu
def test_moe_in_the_engines_hidden_form_against_its_reference():
    """The bf16 form's gate/up epilogue in the engine's hidden-state form (E4M3 values rounded on the float's bits
    since the twenty-third session) on the GPU, prefill and decode-step tiles (and the prefill's defaults: since run
    26b 64 x 64 tiles under a register cap, since run 27b with the crowded experts' 128 x 64 split tiles beside them,
    uncapped: 150 pairs an expert here), against the CPU reference."""
    _run("""
from engine import quant as Q
from kernels import moe
e, inter, dim, k = 8, 256, 512, 6
w1, s1 = Q.quantize_fp4(torch.randn(e, inter, dim, generator=g) * 0.05, 32, "e8m0")
w3, s3 = Q.quantize_fp4(torch.randn(e, inter, dim, generator=g) * 0.05, 32, "e8m0")
w2, s2 = Q.quantize_fp4(torch.randn(e, dim, inter, generator=g) * 0.05, 32, "e8m0")
for t, cfg in ((200, dict(block_m=64, block_n=128)), (40, dict(block_m=16, block_n=64)),
               (200, dict(block_m=64, block_n=128, bf16_decode="fold")),
               (200, dict(block_m=64, block_n=64, maxnreg=168, down_block_n=64, down_maxnreg=0, bf16_decode="fold")),
               (200, dict(block_m=64, block_n=64, maxnreg=168, down_block_n=64, down_maxnreg=0, bf16_decode="fold",
                          split_m=128, split_n=64, split_maxnreg=0))):
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    tw = torch.softmax(torch.randn(t, k, generator=g), -1)
    x = torch.randn(t, dim, generator=g).bfloat16()
    args = (x, w1, s1, w3, s3, w2, s2, ids, tw)
    want = moe.moe_fp4_reference(*args, hidden="reference")
    got = moe.moe_fp4_triton(*[a.cuda() for a in args], hidden="reference", **cfg).cpu()
    rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert rel < 1e-3, (t, cfg, rel)
""")


@on_gpu
def test_float32_gemm_on_tensor_cores_at_float32_accuracy():
    _run("""
from kernels import f32_gemm
for m, n, k in ((4096, 384, 5120), (300, 1024, 5120), (5, 50, 96)):
    x, w = torch.randn(m, k, generator=g).cuda(), (torch.randn(n, k, generator=g) / k ** 0.5).cuda()
    got = f32_gemm.f32_gemm_triton(x, w).double()
    want = x.double() @ w.double().t()
    assert ((got - want).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().t())).all(), (m, n, k)
""")


@on_gpu
def test_topk_rows_path_forms_on_the_gpu():
    """The top-k's rows path compiled, in each form a prefill takes: a 4K prompt's causal indexer rows as whole-row
    tiles (short rows on half a tile) and through group maxima, 5- and 8-bit digit searches, the bound from its top
    digits, the half-buffer search, the group maxima's pass at 4,096 and 8,192 entries a step; rows with runs of
    exact ties (bf16-rounded scores). Every row against a stable sort's picks (the earliest positions win a tie)."""
    _run("""
from kernels import topk
for n, ratio in ((4096, 1), (2048, 2), (65536, 0)):
    rows = 4096 if ratio else 512
    v = torch.randn(rows, n, generator=g).bfloat16().float().cuda()  # bf16 values: many exact ties
    nv = ((torch.arange(rows, dtype=torch.int32) + 1) // ratio if ratio else torch.full((rows,), n)).int().cuda()
    want = topk.topk_positions_reference(v, 512, nv)  # a stable sort's picks, in position order
    for form in ({}, dict(whole_row=4096), dict(whole_row=4096, whole_half=False), dict(hist_bits=8),
                 dict(bound_steps=0, half_tile=False, groups=2048), dict(max_block=4096), dict(max_block=8192)):
        got = topk.topk_positions_triton(v, 512, nv, **form)
        assert torch.equal(got, want), (n, form, (got != want).any(1).sum().item())
""")


@on_gpu
def test_indexer_decode_register_operand_form_on_the_gpu():
    """The indexer's decode scoring with the keys decoded into the wgmma's registers (kernels/indexer_rs.py, Gluon),
    against the float64 reference: 1M keys and a row count off the tile, one query and three, fewer keys visible than
    stored, key and query scale bytes spread past the MoE fold's limit (128) and across 40 binades within a key (the
    second case: key bytes over all of abs_scale's exact range, 66..192). Each form: the keys scaled relative to
    their largest byte, absolutely (abs_scale), with the query decoded by the keys' pairs (query_pairs) and both (the
    default since run 48a). Scores
    within float32 rounding of the reference's terms, -inf exactly where not visible, the group maxima those of the
    scores, and the top-512 the reference's picks (the Triton form's FP8 query operand is exact only while a query's
    scale bytes span at most 14: not compared here)."""
    _run("""
from engine import quant as Q
from kernels import indexer, topk
forms = (dict(abs_scale=False, query_pairs=False), dict(query_pairs=False), dict(abs_scale=False), {})  # {}: both
for t, n, vis, k_lo, k_hi in ((1, 1 << 20, 1 << 20, 100, 140), (3, (1 << 19) + 333, 400_001, 66, 193)):
    qp = torch.randint(-128, 128, (t, 32, 64), dtype=torch.int8, generator=g)
    qs = torch.randint(110, 150, (t, 32, 4), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    kp = torch.randint(-128, 128, (n, 64), dtype=torch.int8, generator=g)
    ks = torch.randint(k_lo, k_hi, (n, 4), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    w = torch.randn(t, 32, generator=g) * 0.02
    nv = torch.full((t,), vis, dtype=torch.int32)
    nv[-1] = n  # the last query sees every key
    args = [a.cuda() for a in (qp, qs, kp, ks, w, nv)]
    ref = indexer.indexer_scores_reference(*[a.cpu() for a in args]).double()
    # the size of the terms a score sums: float32 rounding of each term and of the sum
    qd = Q.dequantize_fp4(qp, qs, 32).double()
    kd = Q.dequantize_fp4(kp, ks, 32).double()
    terms = torch.einsum("thd,nd->thn", qd.abs(), kd.abs())
    scale = torch.einsum("thn,th->tn", terms, w.double().abs())
    fin = torch.isfinite(ref)
    want = topk.topk_positions_reference(ref.float(), 512)
    for form in forms:
        got, mx, cnt = indexer._launch(*args, None, 8, topk=512, rs=True, **form)
        got = got.double().cpu()
        assert torch.equal(fin, torch.isfinite(got)) and (got[~fin] == float("-inf")).all(), form
        err = (got - ref)[fin].abs() / scale[fin].clamp_min(1e-30)
        assert err.max().item() < 2e-6, (err.max().item(), form)
        gm = -(-n // mx.shape[1])
        pad = torch.full((t, mx.shape[1] * gm - n), float("-inf"), dtype=torch.float64)
        assert torch.equal(mx.double().cpu(), torch.cat([got, pad], 1).view(t, -1, gm).amax(2)), form
        assert (cnt.cpu() == 0).all(), form
        # the scores alone (the engine's call: no maxima written) are the same numbers
        assert torch.equal(indexer.indexer_scores_triton(*args, **form).double().cpu(), got), form
        assert torch.equal(indexer.indexer_topk_triton(*args, topk=512, rs=True, **form).cpu(), want), form
""", hang_s=300)
