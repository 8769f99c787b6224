"""Compile every Triton kernel for the H200 (sm_90) on a machine without a GPU; registers, spills, shared memory.

    python benches/compile_sm90.py [--out DIR]   (prints a markdown table; writes compile-sm90.md into DIR)

A stand-in for a device call where none is lent: each kernel's public entry point is called at the
release's widths (fewer tokens, fewer experts: the same compile-time constants) on CPU tensors, with
Triton's driver replaced by one that names an sm_90 target and with every launch turned into a
compile (`warmup`): nothing runs, so outputs are garbage and host code reading them may stop a case
early (reported). The PTX of each distinct compile goes through the ptxas that Triton ships
(`-arch=sm_90a -v`). What it shows: that the kernel compiles for Hopper with this Triton, its
registers per thread, spill bytes, shared memory, whether it got warpgroup MMAs and its GPU-scope fences. What it cannot
show: time. Triton's version here may differ from the device image's (3.6).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before triton: kernels must be compiled, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver as triton_driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


class Sm90Driver:
    """Just enough of a Triton driver to compile for sm_90 with host tensors as arguments."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def is_active(self):
        return True


COMPILED: list[dict] = []
_SEEN: set = set()
CASE = {"name": ""}


def ptxas_stats(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(src), "-o", str(src.with_suffix(".o"))],
                             capture_output=True, text=True)
        census = sass_census(src.with_suffix(".o")) if SASS["on"] and run.returncode == 0 else {}
    text = run.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    # ptxas C7512 / C7515: the wgmma instructions were serialized (each waits for the last), for want of registers
    # to keep a register operand live while it is in flight (C7512), or because something else writes registers an
    # MMA in flight owns (C7515); the asynchronous MMAs a form was built for are gone
    return {"regs": int(regs.group(1)) if regs else None, "spill_bytes": sum(int(s) for s in spills),
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in text,
            "gpu_fences": gpu_fences(ptx), "ptxas_ok": run.returncode == 0,
            "ptxas_error": "" if run.returncode == 0 else text[-300:], **census}


def gpu_fences(ptx: str) -> int:
    """GPU-scope orderings in the PTX: fences, and atomics with acquire/release semantics (sm_90 puts a
    MEMBAR.ALL.GPU before each such atomic, which waits for every memory operation the thread has in flight).
    A sum nothing in the same launch reads needs none (`sem="relaxed"`)."""
    fences = re.findall(r"^\s*(?:@!?%p\d+\s+)?(?:fence\.(?:sc|acq_rel)\.gpu|membar\.gl)\b", ptx, re.M)
    ordered = re.findall(r"^\s*(?:@!?%p\d+\s+)?(?:atom|red)\.[\w.]*\.(?:acq_rel|release|acquire)\.", ptx, re.M)
    return len(fences) + len(ordered)


SASS = {"on": False}
CUOBJDUMP = PTXAS.parent / "cuobjdump"
# opcode classes the census counts in the hottest loop (the first name segment of a SASS opcode)
SASS_CLASSES = {"mma": ("HGMMA", "HMMA", "WARPGROUP"), "shared": ("LDS", "STS", "LDSM", "STSM"),
                "global": ("LDG", "STG", "LDGSTS", "UTMALDG"), "int": ("LOP3", "SHF", "IMAD", "IADD3", "LEA", "PRMT",
                                                                   "ISETP", "SEL"),
                "float": ("FMUL", "FFMA", "FADD", "FMNMX", "MUFU", "HMUL2", "HFMA2", "HADD2"),
                "convert": ("F2FP", "F2F", "I2F", "F2I", "I2FP")}


def sass_rows(listing: str) -> list[tuple[int, str, str]]:
    """cuobjdump -sass text -> [(address, opcode, operands)] in address order."""
    rows = []
    for line in listing.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?);", line)
        if m:
            rows.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return rows


def global_stores(rows) -> str:
    """The global stores by width, e.g. "2x128" or "16x16": how a store is issued, which the instruction count
    does not tell (run 34a: a permutation on a store's addresses made two 128-bit stores sixteen 16-bit ones, 5x
    the kernel's time)."""
    widths = {}
    for _, op, _ in rows:
        if op.split(".")[0] == "STG":
            mods = op.split(".")[1:]
            bits = next((int(m.lstrip("US")) for m in mods if m.lstrip("US") in ("8", "16", "64", "128")), 32)
            widths[bits] = widths.get(bits, 0) + 1
    return " ".join(f"{n}x{bits}" for bits, n in sorted(widths.items())) or "-"


def sass_census(cubin: Path) -> dict:
    """Static SASS of one kernel: its instruction count, every loop's of 50+ (a backward branch's span, in
    address order), the largest one's by class and the global stores by width. A proxy for issue cost where no
    GPU is lent: a kernel's loop body runs once per tile."""
    run = subprocess.run([str(CUOBJDUMP), "-sass", str(cubin)], capture_output=True, text=True)
    rows = sass_rows(run.stdout)
    loops = []
    for i, (addr, op, args) in enumerate(rows):
        target = re.search(r"0x([0-9a-f]+)", args) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            start = int(target.group(1), 16)
            loops.append([r for r in rows[:i + 1] if r[0] >= start])
    body = max(loops, key=len) if loops else []
    classes = {name: sum(1 for _, op, _ in body if op.split(".")[0] in ops) for name, ops in SASS_CLASSES.items()}
    return {"sass": len(rows), "loops": " / ".join(str(len(b)) for b in loops if len(b) >= 50) or "-",
            "loop": len(body), **{f"loop_{k}": v for k, v in classes.items()}, "stores": global_stores(rows)}


def compile_only(self, *args, grid, warmup, **kwargs):
    """JITFunction.run with every launch made a compile; records each distinct kernel once."""
    compiled = _ORIGINAL_RUN(self, *args, grid=grid, warmup=True, **kwargs)
    consts = {k: v for k, v in kwargs.items() if k.isupper()}
    if kwargs.get("maxnreg"):  # a register cap compiles another kernel (the prefill's attention scoring)
        consts["maxnreg"] = kwargs["maxnreg"]
    key = (self.fn.__name__, tuple(sorted((k, str(v)) for k, v in consts.items())),
           kwargs.get("num_warps"), kwargs.get("num_stages"), tuple(str(getattr(a, "dtype", "")) for a in args))
    if key not in _SEEN:
        _SEEN.add(key)
        md = compiled.metadata
        ttgir = compiled.asm.get("ttgir", "")
        COMPILED.append({"case": CASE["name"], "kernel": self.fn.__name__, "consts": consts,
                         "num_warps": md.num_warps, "num_stages": md.num_stages, "shared": md.shared,
                         "wgmma": "warp_group_dot" in ttgir, **ptxas_stats(compiled.asm["ptx"])})
    return compiled


_ORIGINAL_RUN = JITFunction.run


def rand_fp4(shape, block, kind="e8m0"):
    """benches/kernels.py's random packed FP4 with scales, made on the host."""
    from benches import kernel_bench
    kernel_bench.DEV = "cpu"
    return kernel_bench.rand_fp4(shape, block, kind)


def cases():
    """(name, thunk) at the release's widths (benches/kernels.py's shapes, fewer rows)."""
    from kernels import (elementwise, engram, f32_gemm, fp8_linear, indexer, mhc, moe, quant, rmsnorm, rope, router,
                         sinkhorn, sparse_attn, sparse_attn_train, ties, topk)

    def quantizers():
        quant.quantize_fp4_triton(torch.randn(256, 512).bfloat16(), 16, "e4m3")
        quant.quantize_fp4_triton(torch.randn(256, 128).bfloat16(), 32, "e8m0")
        quant.quantize_fp8_triton(torch.randn(256, 512).bfloat16())
        quant.fp8_roundtrip_triton(torch.randn(256, 512).bfloat16(), 32, bf16_out=True, nib=True)  # experts' input
        quant.fp8_roundtrip_triton(torch.randn(256, 512).bfloat16(), 32, bf16_out=True, nib=True, rs=True)  # rs form's

    def linear(m, **form):
        w = (torch.randn(5120, 8192) * 30).to(torch.float8_e4m3fn)
        ws = torch.randint(118, 124, (160, 256), dtype=torch.uint8).view(torch.float8_e8m0fnu)
        return lambda: fp8_linear.fp8_linear_triton(torch.randn(m, 8192).bfloat16(), w, ws, **form)

    def index(tq, n, fused, **form):
        qp, qs = rand_fp4((tq, 32, 128), 32)
        kp, ks = rand_fp4((n, 128), 32)
        w = torch.randn(tq, 32) * 0.02
        nv = torch.full((tq,), n, dtype=torch.int32)
        fn = indexer.indexer_topk_triton if fused else indexer.indexer_scores_triton
        return lambda: fn(qp, qs, kp, ks, w, nv, **form)

    def top512(n=65536, causal=False, **form):
        lengths = torch.arange(1, 65, dtype=torch.int32) * (n // 64) if causal else None  # a prefill's visible counts
        return lambda: topk.topk_positions_triton(torch.randn(64, n), 512, lengths, **form)

    def attention(tq, q_dtype=torch.bfloat16, selected=512, **cfg):
        q = torch.randn(tq, 64, 512).bfloat16().to(q_dtype)
        kvp, kvs = rand_fp4((4096, 512), 16, "e4m3")
        w8 = (torch.randn(256, 512) * 50).to(torch.float8_e4m3fn)
        ws = torch.randint(118, 122, (256, 16), dtype=torch.uint8).view(torch.float8_e8m0fnu)
        idx = torch.randint(0, 4096, (tq, selected), dtype=torch.int32)
        widx = torch.randint(0, 256, (tq, 128), dtype=torch.int32)
        return lambda: sparse_attn.sparse_attn_triton(q, kvp, kvs, idx, w8, ws, widx, torch.randn(64), **cfg)

    def experts(tokens, **cfg):
        e, inter, dim, k = 8, 2304, 5120, 6
        w1, s1 = rand_fp4((e, inter, dim), 32)
        w3, s3 = rand_fp4((e, inter, dim), 32)
        w2, s2 = rand_fp4((e, dim, inter), 32)
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(tokens)]).int()
        tw = torch.softmax(torch.randn(tokens, k), -1)
        x = torch.randn(tokens, dim).bfloat16()
        return lambda: moe.moe_fp4_triton(x, w1, s1, w3, s3, w2, s2, ids, tw, **cfg)

    def picked(kind):  # the trainer's shapes: 4 heads of 128 over 64 picks (or 4 x 64: the indexer's KL)
        q, e = torch.randn(2, 64, 4, 128).bfloat16(), torch.randn(2, 2048, 128).bfloat16()
        idx = torch.randint(0, 2048, (2, 64, 64), dtype=torch.int32)
        order, starts = sparse_attn_train.pick_index(idx, 2048)
        do, lse = torch.randn(2, 64, 4, 128), torch.randn(2, 64, 4)
        run = {"forward": lambda: sparse_attn_train.run_forward(q, e, idx, softmax=True),
               "backward": lambda: sparse_attn_train.run_backward(q, e, idx, order, starts, do, lse, lse, lse),
               "scores backward": lambda: sparse_attn_train.run_backward(q[..., :64], e[..., :64], idx, order, starts,
                                                                         torch.randn(2, 64, 4, 64))}
        return run[kind]

    def mixing(tq, wide=False):
        dim = 5120
        stream = torch.float32 if wide else torch.bfloat16  # wide: the engine's float32 stream of bf16 values
        args = (torch.randn(tq, 4, dim).to(stream), torch.randn(24, 4 * dim) * 0.01, torch.rand(3) + 0.5,
                torch.randn(24) * 0.5, torch.rand(tq, 4), torch.randn(tq, dim).to(stream), torch.rand(tq, 4) * 2,
                torch.softmax(torch.randn(tq, 4, 4), -1))
        return lambda: mhc.mhc_triton(*args, **({"bf16_values": True} if wide else {}))

    return [("quantizers", quantizers), ("fp8 linear 128x5120x8192", linear(128)),
            ("fp8 linear 64x5120x8192", linear(64)),
            ("fp8 linear cuBLAS form's weight values 5120x8192", linear(128, mma="cublas")),
            ("fp8 linear bf16 form 128x5120x8192", linear(128, mma="bf16")),
            ("fp8 linear bf16 form 64x5120x8192", linear(64, mma="bf16")), ("indexer + top-512 decode", index(1, 1 << 16, True)),
            ("indexer + top-512 decode, keys decoded into the wgmma's registers, absolute key scales, the query by the "
             "same pairs (Gluon; the default)", index(1, 1 << 19, True, rs=True)),
            ("indexer + top-512 decode, keys decoded into the wgmma's registers, absolute key scales (Gluon)",
             index(1, 1 << 19, True, rs=True, query_pairs=False)),
            ("indexer + top-512 decode, keys decoded into the wgmma's registers, scales relative to a key's largest "
             "(Gluon; the default before run 48a)",
             index(1, 1 << 19, True, rs=True, abs_scale=False, query_pairs=False)),
            ("indexer scores prefill", index(64, 8192, False)), ("top-512 prefill", top512()),
            ("top-512 prefill, 8-bit digits", top512(hist_bits=8)),
            ("top-512 prefill, run 41's maxima pass (2,048 a step, 64 registers)", top512(max_block=2048, maxnreg=64)),
            ("top-512 prefill, 16 warps", top512(num_warps=16)),
            ("top-512 decode split path, 1M entries", lambda: topk.topk_positions_triton(torch.randn(1, 1 << 20), 512)),
            ("top-512 decode split path, 8,192-entry filter blocks read 4,096 at a time",
             lambda: topk.topk_positions_triton(torch.randn(1, 1 << 20), 512, block=8192)),
            ("top-512 layer rows, one tile (short rows on half of it)", top512(4096, True, whole_row=4096)),
            ("top-512 layer rows, one tile for all", top512(4096, True, whole_row=4096, whole_half=False)),
            ("sparse attention decode b64", attention(64)),
            ("sparse attention decode 1 token", attention(1)),
            ("sparse attention decode 1 token, float32 q", attention(1, torch.float32)),
            ("sparse attention decode b64, float32 q", attention(64, torch.float32)),
            ("sparse attention decode b64, bf16x2 decode", attention(64, layout="two_pass",
                                                                     two_pass=dict(decode="bf16x2"))),
            ("sparse attention decode b64, one pass", attention(64, layout="entries", block_h=64, block_n=32,
                                                                 split=2)), ("sparse attention prefill 4K", attention(4096)),
            ("sparse attention prefill 4K, float32 q", attention(4096, torch.float32)),
            ("sparse attention prefill 4K, window only", attention(4096, selected=0)),
            ("sparse attention prefill 4K, one pass on wgmma (Gluon)", attention(4096, layout="wgmma")),
            ("sparse attention prefill 4K, one pass on wgmma, sums late (Gluon)", attention(
                4096, layout="wgmma", wgmma=dict(late_sum=True))),
            ("sparse attention prefill 4K, one pass on wgmma, copies staged a tile ahead (Gluon)", attention(
                4096, layout="wgmma", wgmma=dict(staged=True))),
            ("sparse attention prefill 4K, staged copies, 16-byte output stores (Gluon)",
             attention(4096, layout="wgmma", wgmma=dict(staged=True, wide_store=True))),
            ("sparse attention prefill 4K, one pass on wgmma, S a tile ahead (Gluon)", attention(
                4096, layout="wgmma", block_n=32, wgmma=dict(ahead=True))),
            ("sparse attention decode b64, window only", attention(64, selected=0)),
            ("MoE decode 1 token", experts(1)), ("MoE decode 1 token, the engine's hidden state", experts(1, hidden="reference")),
            ("MoE decode 1 token, x in split order, 32-word steps", experts(1, gemv_x_split=True, gemv_block_kw=32,
                                                                          gemv_iters=4)),
            ("MoE decode 1 token, x in split order, 32-word steps, the engine's hidden state",
             experts(1, gemv_x_split=True, gemv_block_kw=32, gemv_iters=4, hidden="reference")),
            ("MoE decode 1 token, x in split order, two 32-word steps, the engine's hidden state",
             experts(1, gemv_x_split=True, gemv_block_kw=32, gemv_iters=2, hidden="reference")),
            ("MoE prefill", experts(256, block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)),
            ("MoE prefill, float32 decode", experts(256, block_m=64, block_n=128, block_k=64, num_warps=4,
                                                    num_stages=3, bf16_decode=False)),
            ("MoE prefill, the engine's hidden state", experts(256, block_m=64, block_n=128, block_k=64, num_warps=4,
                                                                num_stages=3, hidden="reference")),
            ("MoE prefill, folded scales", experts(256, block_m=64, block_n=128, block_k=64, num_warps=4,
                                                   num_stages=3, bf16_decode="fold", hidden="reference")),
            ("MoE prefill, folded scales, 64 x 64 tiles, gate/up capped at 168 registers", experts(
                256, block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, bf16_decode="fold",
                hidden="reference", maxnreg=168, down_block_n=64, down_maxnreg=0)),
            ("MoE prefill, 64 x 64 tiles and 128 x 64 split tiles uncapped", experts(
                256, block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, bf16_decode="fold",
                hidden="reference", maxnreg=168, down_block_n=64, down_maxnreg=0, split_m=128, split_n=64,
                split_maxnreg=0)),
            ("MoE prefill, warp-specialized grouped GEMMs (Gluon)", experts(
                256, block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, bf16_decode="fold",
                hidden="reference", maxnreg=168, down_block_n=64, down_maxnreg=0, split_m=128, split_n=64,
                split_maxnreg=0, ws=True)),
            ("MoE prefill, FP4 decoded into the wgmma's register operand (Gluon)", experts(
                256, block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, bf16_decode="fold",
                hidden="reference", maxnreg=168, down_block_n=64, down_maxnreg=0, split_m=128, split_n=64,
                split_maxnreg=0, ws="rs")),
            ("MoE prefill, FP4 decoded into the wgmma's register operand, 64 / 80 / 96 / 128-pair blocks (Gluon)",
             experts(256, block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, bf16_decode="fold",
                     hidden="reference", maxnreg=168, down_block_n=64, down_maxnreg=0, split_m=(80, 96, 128),
                     split_n=64, split_maxnreg=0, ws="rs")),
            ("MoE prefill, FP4 decoded into the wgmma's register operand, 128-wide stages (Gluon)", experts(
                256, block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, bf16_decode="fold",
                hidden="reference", maxnreg=168, down_block_n=64, down_maxnreg=0, split_m=128, split_n=64,
                split_maxnreg=0, ws="rs", ws_block_k=128, ws_stages=2)),
            # a positive control for the wgmma column: at 128 registers ptxas serializes this form's MMAs (C7512)
            ("MoE prefill, register operand capped at 128 registers (serialized)", experts(
                256, block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, bf16_decode="fold",
                hidden="reference", maxnreg=168, down_block_n=64, down_maxnreg=0, split_m=None, ws="rs",
                ws_maxnreg=128)),
            ("MoE decode step, folded scales", experts(64, block_m=16, block_n=64, bf16_decode="fold",
                                                       hidden="reference")),
            ("mHC 4K tokens", mixing(4096)), ("mHC 1 token", mixing(1)),
            ("mHC 4K tokens, float32 stream of bf16 values", mixing(4096, wide=True)),
            ("mHC 64 tokens, float32 stream of bf16 values", mixing(64, wide=True)),
            ("mHC stream update (expand), 64 tokens", lambda: mhc.mhc_expand_triton(
                torch.randn(64, 5120), torch.randn(64, 4, 5120), torch.rand(64, 4), torch.rand(64, 4, 4))),
            ("RMSNorm 4096 x 5120", lambda: rmsnorm.rms_norm_triton(torch.randn(4096, 5120), torch.randn(5120), 1e-6,
                                                                   round_bf16=True)),
            ("RMSNorm 4096 x 5120, bf16 rows", lambda: rmsnorm.rms_norm_triton(
                torch.randn(4096, 5120).bfloat16(), torch.randn(5120), 1e-6, out_dtype=torch.bfloat16)),
            ("RMSNorm 4096 x 5120, bf16 rows, row-walking programs", lambda: rmsnorm.rms_norm_triton(
                torch.randn(4096, 5120).bfloat16(), torch.randn(5120), 1e-6, out_dtype=torch.bfloat16,
                programs_per_sm=4)),
            ("Engram mix 4096 tokens x 4 x 5120", lambda: engram.engram_mix_triton(
                torch.randn(4096, 4, 5120), torch.randn(4096, 5 * 5120), torch.randn(4, 5120), torch.randn(4, 5120),
                1e-6, torch.ones(4096, dtype=torch.bool), round_bf16=True)),
            ("float32 GEMM (tf32x3), the router 4096 x 384 x 5120", lambda: f32_gemm.f32_gemm_triton(
                torch.randn(4096, 5120), torch.randn(384, 5120))),
            ("float32 GEMM, one bf16 pass, the router 4096 x 384 x 5120", lambda: f32_gemm.f32_gemm_triton(
                torch.randn(4096, 5120), torch.randn(384, 5120).bfloat16(), precision="bf16")),
            ("the router's top-6 of 384, 4096 tokens", lambda: router.route_topk_triton(torch.randn(4096, 384), 6)),
            ("shared expert SwiGLU 4096 x 2304", lambda: elementwise.swiglu_triton(
                torch.randn(4096, 2304), torch.randn(4096, 2304), 10.0, round_bf16=True)),
            ("shared expert sum 4096 x 5120", lambda: elementwise.add_triton(
                torch.randn(4096, 5120), torch.randn(4096, 5120), round_bf16=True)),
            ("RoPE 64 x 64 x 512 (a decode step's queries)", lambda: rope.rope_triton(
                torch.randn(64, 64, 512), torch.zeros(64, dtype=torch.long), torch.zeros(4096, 32, 2))),
            ("RoPE in place, 4096 x 64 x 512 (a prefill's queries)", lambda: rope.rope_triton(
                torch.randn(4096, 64, 512), torch.zeros(4096, dtype=torch.long), torch.zeros(4096, 32, 2),
                inplace=True)),
            ("RoPE in place, 4096 x 64 x 512 bf16 (a prefill's narrowed queries)", lambda: rope.rope_triton(
                torch.randn(4096, 64, 512, dtype=torch.bfloat16), torch.zeros(4096, dtype=torch.long),
                torch.zeros(4096, 32, 2), inplace=True)),
            ("tie marks, 64 rows x 4096 entries", lambda: ties.tie_marks_triton(
                torch.randn(64, 4096), torch.randint(0, 4096, (64, 512)), torch.randn(64, 512))),
            ("Sinkhorn forward (training)", lambda: sinkhorn.sinkhorn_forward(torch.randn(4096, 4, 4), 20, 1e-6)),
            ("Sinkhorn backward (training)", lambda: sinkhorn.sinkhorn_backward(torch.randn(4096, 4, 4),
                                                                               torch.randn(4096, 4, 4), 20, 1e-6)),
            ("picked attention forward (training)", picked("forward")),
            ("picked attention backward + reduce (training)", picked("backward")),
            ("picked scores backward + reduce (training)", picked("scores backward"))]


def _wgmma(r: dict) -> str:
    """The wgmma column: no; yes; serialized (ptxas made each warpgroup MMA wait for the one before)."""
    return "no" if not r["wgmma"] else "serialized" if r.get("wgmma_serialized") else "yes"


def table(rows: list[dict], errors: dict) -> str:
    lines = [f"# Triton kernels compiled for sm_90 (no GPU), triton {triton.__version__}, torch {torch.__version__}",
             "", "| case | kernel | constants | warps | stages | regs | spill B | smem B | wgmma | gpu fences | ptxas |",
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        consts = ", ".join(f"{k}={v}" for k, v in r["consts"].items())
        lines.append(f"| {r['case']} | {r['kernel']} | {consts} | {r['num_warps']} | {r['num_stages']} | "
                     f"{r['regs']} | {r['spill_bytes']} | {r['shared']} | {_wgmma(r)} | {r['gpu_fences']} | "
                     f"{'ok' if r['ptxas_ok'] else 'FAILED ' + r['ptxas_error']} |")
    if SASS["on"]:
        names = ["sass", "loops", "loop"] + [f"loop_{k}" for k in SASS_CLASSES] + ["stores"]
        lines += ["", "SASS census (static, one thread's instruction stream; loops: each backward-branch span of 50+ "
                      "instructions; loop: the largest, counted by class; stores: the global stores, count x bits):", "",
                  "| case | kernel | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
        lines += [f"| {r['case']} | {r['kernel']} | " + " | ".join(str(r.get(n, "")) for n in names) + " |"
                  for r in rows]
    if errors:
        lines += ["", "Cases stopped (after the kernels listed for them compiled, or before any):"]
        lines += [f"- {name}: {err}" for name, err in errors.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--sass", action="store_true", help="also count each kernel's SASS (cuobjdump)")
    args = ap.parse_args(argv)
    SASS["on"] = args.sass
    if not PTXAS.exists():
        raise SystemExit(f"error: Triton's ptxas is not at {PTXAS}")
    triton_driver.set_active(Sm90Driver())
    JITFunction.run = compile_only
    errors = {}
    for name, thunk in cases():
        if args.only and args.only not in name:
            continue
        CASE["name"] = name
        try:
            thunk()
        except Exception as err:  # a compile error is the finding; report it and go on
            errors[name] = f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300] if str(err).strip() else ''}"
        print(f"{name}: {len([r for r in COMPILED if r['case'] == name])} kernels"
              f"{' / ' + errors[name] if name in errors else ''}", flush=True)
    out = table(COMPILED, errors)
    print(out)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "compile-sm90.md").write_text(out + "\n")
    return 1 if errors or any(not r["ptxas_ok"] for r in COMPILED) else 0


if __name__ == "__main__":
    raise SystemExit(main())
