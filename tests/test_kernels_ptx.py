"""The inline PTX of the kernels' format decoders, run on the CPU by a small emulator written here.

TRITON_INTERPRET=1 runs no inline assembly (the interpreter tests take the kernels' plain-Triton
branches), so the PTX text itself is checked here: each string is executed opcode by opcode over
numpy uint32 lanes (prmt, shifts, and/or, mul.rn.bf16x2 with round-to-nearest-even and subnormals)
and every output value is compared bit for bit with engine.quant's decoders. The GPU tests run the
same strings for real; this checks their bit logic where no GPU is. Negative controls prove the
emulator exercises the logic: mutated copies of the strings must be caught.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import quant as Q

U32 = np.uint32


def kernel_ptx(name: str) -> str:
    """A kernel's PTX string, imported when a test runs, not at collection: triton imported before an
    interpreter test module sets TRITON_INTERPRET=1 would leave it compiled tl helpers (tl.zeros)."""
    from kernels import _formats, fp4_tiles, fp8_linear
    for module in (_formats, fp4_tiles, fp8_linear):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(name)


# -- the emulator -------------------------------------------------------------------------------

def _bf16_to_f64(h):
    """uint32 lanes holding bf16 bits (low 16) -> float64 values (exact; subnormals kept)."""
    assert np.all((h >> U32(7)) & U32(0xFF) != U32(0xFF)), "bf16 NaN/inf operand: not emulated"
    return (h << U32(16)).view(np.float32).astype(np.float64)


def _f64_to_bf16(x):
    """float64 -> bf16 bits (uint32 lanes), rounded to nearest even on bf16's grid (subnormals: 2^-133)."""
    _, e = np.frexp(x)  # |x| in [2^(e-1), 2^e): 8 significant bits leave a step 2^(e-8)
    step = np.maximum(e - 8, -133)
    r = np.ldexp(np.rint(np.ldexp(x, -step)), step)  # np.rint rounds halves to even
    assert np.all(np.abs(r) < 2.0**128), "bf16 overflow: not emulated"
    bits = r.astype(np.float32).view(U32)  # exact: r is on the bf16 grid
    assert np.all(bits & U32(0xFFFF) == 0)
    return bits >> U32(16)


def _prmt(a, b, sel):
    """prmt.b32 default mode: byte i of the result is byte sel_i of {b, a} (a: bytes 0-3, b: 4-7);
    bit 3 of sel_i replicates that byte's sign bit."""
    src = np.stack([(a >> U32(8 * i)) & U32(0xFF) for i in range(4)]
                   + [(b >> U32(8 * i)) & U32(0xFF) for i in range(4)])
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> U32(4 * i)) & U32(0xF)
        byte = np.take_along_axis(src, (nib & U32(7)).astype(np.int64)[None], 0)[0]
        byte = np.where(nib & U32(8) != 0, np.where(byte & U32(0x80) != 0, U32(0xFF), U32(0)), byte)
        out |= byte.astype(U32) << U32(8 * i)
    return out


def _shift(a, n, left):
    assert np.all(n < 32), "shift by 32 or more: not emulated"
    return (a << n) if left else (a >> n)


def _mul_bf16x2(a, b):
    halves = [_f64_to_bf16(_bf16_to_f64((a >> U32(s)) & U32(0xFFFF)) * _bf16_to_f64((b >> U32(s)) & U32(0xFFFF)))
              for s in (0, 16)]
    return halves[0] | (halves[1] << U32(16))


OPS = {
    "prmt.b32": _prmt,
    "shl.b32": lambda a, n: _shift(a, n, True),
    "shr.b32": lambda a, n: _shift(a, n, False),  # .b32: a logical shift
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "mul.rn.bf16x2": _mul_bf16x2,
}


def run_ptx(ptx: str, args: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute the PTX body over uint32 lanes; args: $N -> lanes. Returns every register by name ('$0', 'w')."""
    n = len(next(iter(args.values())))
    regs = {f"${k}": np.asarray(v, dtype=U32) for k, v in args.items()}

    def value(tok):
        if tok[0].isdigit():
            return np.full(n, int(tok, 0), dtype=U32)
        return regs[tok]  # a register read before it is written fails here

    for line in ptx.splitlines():
        line = line.strip()
        if line in ("", "{", "}") or line.startswith(".reg"):
            continue
        assert line.endswith(";"), line
        op, rest = line[:-1].split(None, 1)
        if op not in OPS:
            raise NotImplementedError(f"opcode not emulated: {op!r} in {line!r}")
        dst, *srcs = [t.strip() for t in rest.split(",")]
        regs[dst] = OPS[op](*[value(t) for t in srcs]).astype(U32)
    return regs


# -- inputs and references ----------------------------------------------------------------------

def _words(byte_values, offsets=(0, 85, 170, 37)):
    """uint32 words whose byte p runs through all of byte_values (shifted by offsets[p])."""
    v = np.asarray(byte_values, dtype=np.int64)
    idx = np.arange(len(v))
    return sum((v[(idx + o) % len(v)] << (8 * p)) for p, o in enumerate(offsets)).astype(U32)


def _byte_pairs():
    """All 2^16 low halves, the high half an odd multiple of it (a permutation): each byte pair exhaustive."""
    i = np.arange(1 << 16, dtype=np.int64)
    return (i | (((i * 40503) & 0xFFFF) << 16)).astype(U32)


def _factor_bits(f):
    """float64 factors (bf16-exact) -> bf16 bits."""
    bits = np.asarray(f, dtype=np.float32).view(U32)
    assert np.all(bits & U32(0xFFFF) == 0) and np.all(np.asarray(f, np.float32) == f), "factor not a bf16"
    return bits >> U32(16)


def _sweep(words, factors):
    """Every word against every factor, the four bytes of a lane with rotated factors -> words, factor [lanes, 4]."""
    w = np.repeat(words, len(factors))
    t = np.tile(np.arange(len(factors)), len(words))
    return w, np.stack([factors[(t + 37 * p) % len(factors)] for p in range(4)], 1)


def _bytes_of(words):  # [lanes] -> uint8 [lanes, 4]
    return np.stack([(words >> U32(8 * p)) & U32(0xFF) for p in range(4)], 1).astype(np.uint8)


def _mismatches(got_bits, want):
    """bf16 bits [lanes, k] against float64 values: count of values or zero signs that differ."""
    got = _bf16_to_f64(got_bits.astype(U32).ravel())
    want = want.ravel()
    return int(np.sum((got != want) | (np.signbit(got) != np.signbit(want))))


def _e2m1_bf16_scaled_mismatches(ptx, words, f):
    """E2M1_BF16_SCALED: out $0 $1 = low nibbles of bytes (0, 1), (2, 3); $2 $3 the high nibbles';
    each E2M1 * 2^-126 * the byte's factor."""
    fb = _factor_bits(f)
    regs = run_ptx(ptx, {4: words, 5: fb[:, 0] | fb[:, 1] << U32(16), 6: fb[:, 2] | fb[:, 3] << U32(16)})
    e2m1 = Q.unpack_fp4(torch.from_numpy(_bytes_of(words))).double().numpy().reshape(-1, 4, 2)  # [lane, byte, nib]
    bad = 0
    for r in range(4):
        for half in range(2):
            byte, nib = 2 * (r % 2) + half, r // 2
            got = (regs[f"${r}"] >> U32(16 * half)) & U32(0xFFFF)
            bad += _mismatches(got, e2m1[:, byte, nib] * 2.0**-126 * f[:, byte])
    return bad


def _e2m1_nib_bf16_mismatches(ptx, words, f):
    """E2M1_NIB_BF16 (the MoE's folded decode, one word = 8 nibbles n0..n7 a call): $A = (nibble A, nibble A + 4)
    for A = 0..3 (the NIB order's positions 2A, 2A + 1), times factors $5 = (f0, f1) for $0 $2 and
    $6 = (f2, f3) for $1 $3 (elementwise over the word's bytes: element e of each output takes f_e); each
    E2M1 * 2^-126 * its factor."""
    fb = _factor_bits(f)
    regs = run_ptx(ptx, {4: words, 5: fb[:, 0] | fb[:, 1] << U32(16), 6: fb[:, 2] | fb[:, 3] << U32(16)})
    nib = Q.unpack_fp4(torch.from_numpy(_bytes_of(words))).double().numpy().reshape(-1, 8)  # nibble n of the word
    bad = 0
    for a in range(4):
        for half in range(2):
            got = (regs[f"${a}"] >> U32(16 * half)) & U32(0xFFFF)
            bad += _mismatches(got, nib[:, a + 4 * half] * 2.0**-126 * f[:, 2 * (a % 2) + half])
    return bad


def _e2m1_as_e4m3_mismatches(ptx, words):
    """E2M1_AS_E4M3: $0 byte p = byte p's low nibble as E4M3, $1 its high nibble's; each E2M1 * 2^-6."""
    regs = run_ptx(ptx, {2: words})
    e2m1 = Q.unpack_fp4(torch.from_numpy(_bytes_of(words))).double().numpy().reshape(-1, 4, 2)
    one = torch.ones(1).to(torch.float8_e8m0fnu)
    bad = 0
    for nib in range(2):
        out = torch.from_numpy(_bytes_of(regs[f"${nib}"]).ravel()).view(torch.float8_e4m3fn)
        got = Q.dequantize_fp8(out[:, None], one, 1).double().numpy().reshape(-1, 4)
        want = e2m1[:, :, nib] * 2.0**-6
        bad += int(np.sum((got != want) | (np.signbit(got) != np.signbit(want))))
    return bad


def _e4m3_bf16_scaled_mismatches(ptx, words, f):
    """E4M3_BF16_SCALED: $0 = bytes (0, 1), $1 = bytes (2, 3); each E4M3 * 2^-120 * the byte's factor."""
    fb = _factor_bits(f)
    regs = run_ptx(ptx, {2: words, 3: fb[:, 0] | fb[:, 1] << U32(16), 4: fb[:, 2] | fb[:, 3] << U32(16)})
    q = torch.from_numpy(_bytes_of(words).ravel()).view(torch.float8_e4m3fn)
    e4m3 = Q.dequantize_fp8(q[:, None], torch.ones(1).to(torch.float8_e8m0fnu), 1).double().numpy().reshape(-1, 4)
    bad = 0
    for r in range(2):
        for half in range(2):
            byte = 2 * r + half
            got = (regs[f"${r}"] >> U32(16 * half)) & U32(0xFFFF)
            bad += _mismatches(got, e4m3[:, byte] * 2.0**-120 * f[:, byte])
    return bad


# factors where every product is a bf16 (lower ones underflow the bf16 grid, 2^-133): 2^-6 puts E2M1 0.5 on
# 2^-133, 2^1 and up make it normal; 1.5 / 1.75 / 1.875 (an E4M3 scale's 4 significant bits) from 2^-3. The
# kernel's factors (E4M3 scale * 2^118) lie in 2^109 .. 1.75 * 2^126
E2M1_FACTORS = np.array([m * 2.0**k for m in (1.0, 1.5, 1.75, 1.875) for k in range(-6 if m == 1 else -3, 128)])
E4M3_CODES = [c for c in range(256) if c & 0x7F != 0x7F]
# the kernel's factors 2^(s - 7), s <= 134; below 2^-4 E4M3's least subnormal would leave the bf16 grid
E4M3_FACTORS = np.array([2.0**k for k in range(-4, 128)], dtype=np.float64)


def _e2m1_scaled_inputs():
    w, f = _sweep(_words(range(256)), E2M1_FACTORS)
    pairs = _byte_pairs()
    fp = E2M1_FACTORS[(np.arange(len(pairs))[:, None] * 7 + np.arange(4) * 101) % len(E2M1_FACTORS)]
    return np.concatenate([w, pairs]), np.concatenate([f, fp])


def test_e2m1_bf16_scaled_every_byte_every_factor():
    """Every byte in every position against every factor, and every byte pair: E2M1 * 2^-126 * f exactly."""
    words, f = _e2m1_scaled_inputs()
    assert _e2m1_bf16_scaled_mismatches(kernel_ptx("E2M1_BF16_SCALED_PTX"), words, f) == 0


def test_e2m1_nib_bf16_every_byte_every_factor():
    """The MoE's folded decode: every byte in every position against every factor, and every byte pair."""
    words, f = _e2m1_scaled_inputs()
    assert _e2m1_nib_bf16_mismatches(kernel_ptx("E2M1_NIB_BF16_PTX"), words, f) == 0


def test_e2m1_as_e4m3_every_byte_pair():
    """Every byte pair in both halves (so every byte in every position): E4M3 bytes worth E2M1 * 2^-6."""
    assert _e2m1_as_e4m3_mismatches(kernel_ptx("E2M1_AS_E4M3_PTX"), _byte_pairs()) == 0


def test_e4m3_bf16_scaled_every_byte_every_factor():
    """Every non-NaN E4M3 byte in every position against factors 2^-4 .. 2^127: E4M3 * 2^-120 * f exactly."""
    words, f = _sweep(_words(E4M3_CODES, (0, 63, 127, 191)), E4M3_FACTORS)
    assert _e4m3_bf16_scaled_mismatches(kernel_ptx("E4M3_BF16_SCALED_PTX"), words, f) == 0


def test_bf16_rounding_of_the_emulator():
    """mul.rn.bf16x2 rounds to nearest even (ties both ways) and keeps subnormals."""
    a = np.array([0x3F81 | 0x3F81 << 16, 0x0001 | 0x0001 << 16], dtype=U32)  # 1 + 2^-7; 2^-133
    b = np.array([0x3F00 | 0x3FC0 << 16, 0x3F00 | 0x3FC0 << 16], dtype=U32)  # halves: 0.5, 1.5
    out = run_ptx("mul.rn.bf16x2 $0, $1, $2;", {1: a, 2: b})["$0"]
    # (1 + 2^-7) * 1.5: a tie, up to the even 1.5 + 2^-6; 2^-134 ties down to 0, 1.5 * 2^-133 up to 2^-132
    assert [int(x) for x in out] == [0x3F01 | 0x3FC2 << 16, 0x0000 | 0x0002 << 16]
    with pytest.raises(NotImplementedError):
        run_ptx("add.u32 $0, $1, $1;", {1: a})


MUTANTS = [
    ("e2m1_bf16", "E2M1_BF16_SCALED_PTX", "0x01C001C0", "0x03C003C0"),  # a sign bit into the exponent ($0)
    ("e2m1_bf16", "E2M1_BF16_SCALED_PTX", "0x3120", "0x3210"),          # bytes 1 and 2 swapped
    ("e2m1_bf16", "E2M1_BF16_SCALED_PTX", "shr.b32 m, w, 6", "shr.b32 m, w, 5"),
    ("e2m1_nib", "E2M1_NIB_BF16_PTX", "shr.b32 m, $4, 2", "shr.b32 m, $4, 3"),   # pair 2's magnitudes
    ("e2m1_nib", "E2M1_NIB_BF16_PTX", "mul.rn.bf16x2 $1, m, $6", "mul.rn.bf16x2 $1, m, $5"),  # a byte's factor
    ("e2m1_e4m3", "E2M1_AS_E4M3_PTX", "shl.b32 a1, a1, 2", "shl.b32 a1, a1, 3"),
    ("e4m3_bf16", "E4M3_BF16_SCALED_PTX", "0x07F007F0", "0x07E007E0"),  # the mantissa's last bit lost
]


@pytest.mark.parametrize("kind,name,old,new", MUTANTS, ids=[f"{m[0]}:{m[2]}->{m[3]}" for m in MUTANTS])
def test_mutated_ptx_is_caught(kind, name, old, new):
    """A deliberately broken copy of each string must show mismatches (the emulator runs the logic)."""
    assert old in kernel_ptx(name)
    bad = kernel_ptx(name).replace(old, new, 1)
    if kind == "e2m1_bf16":
        mismatches = _e2m1_bf16_scaled_mismatches(bad, *_e2m1_scaled_inputs())
    elif kind == "e2m1_nib":
        mismatches = _e2m1_nib_bf16_mismatches(bad, *_e2m1_scaled_inputs())
    elif kind == "e2m1_e4m3":
        mismatches = _e2m1_as_e4m3_mismatches(bad, _byte_pairs())
    else:
        mismatches = _e4m3_bf16_scaled_mismatches(bad, *_sweep(_words(E4M3_CODES, (0, 63, 127, 191)), E4M3_FACTORS))
    assert mismatches > 0
