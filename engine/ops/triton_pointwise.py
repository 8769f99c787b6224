"""TritonOps' one-launch replacements of the wrapped numerics' short elementwise and row-wise ops: RMSNorm,
RoPE (in place), the shared expert's SwiGLU and sum, the Engram's gated update, the FP8/FP4 stores and the tie
marks. A mixin of engine/ops/triton.py TritonOps, whose `_kernel`, `compute`, `base`, `_bf16_stream` and
`_x_memo` they use; each falls back to the wrapped op where its kernel cannot take the call."""

from __future__ import annotations

import torch


def wide(x: torch.Tensor) -> torch.Tensor:
    """x as the wrapped numerics take it: a bf16 tensor the kernel ops handed on (a narrowed GEMM output, the
    stream under knob stream_bf16) widened to float32, anything else as it is."""
    return x.float() if x.dtype == torch.bfloat16 else x


class PointwiseKernels:
    @property
    def _narrow_stream(self) -> bool:
        """Knob stream_bf16 under the `reference` numerics: the residual stream stored bf16 by its kernels."""
        return self.compute and self._bf16_stream and self.stream_bf16

    def collapse(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The wrapped numerics' collapse (the head's, a CED replay's) on the stream as float32."""
        return self.base.collapse(wide(x), pre)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, narrow: bool = False):
        """One kernel (kernels/rmsnorm.py) where the wrapped numerics take seven launches: float32, its
        output bf16-rounded in the kernel for `reference` numerics (what their `act` stores); narrow (a caller
        whose readers take bf16): those values stored bf16 (H100 run 31e: the five FP8 linears' input pass,
        the experts' round trip and the gate read a block's normalized input at the copy rate)."""
        from kernels.rmsnorm import MAX_WIDTH
        if not self.compute or x.shape[-1] > MAX_WIDTH:
            return self.base.rms_norm(x, weight, eps)
        if narrow and self._bf16_stream:
            return self._kernel("rms_norm")(x, weight, eps, True, out_dtype=torch.bfloat16)
        return self._kernel("rms_norm")(x, weight, eps, self._bf16_stream)

    def route_topk(self, biased: torch.Tensor, k: int) -> torch.Tensor:
        """The router's choice in one launch (kernels/router.py, knob router_topk) where a row fits one program;
        else the wrapped numerics' torch.topk."""
        if not (self.compute and self.router_topk) or biased.dim() != 2 or not 0 < k <= min(biased.shape[1], 32) \
                or biased.shape[1] > 4096:
            return self.base.route_topk(biased, k)
        return self._kernel("route_topk")(biased, k)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False):
        """RoPE in one kernel (kernels/rope.py) on the wrapped `reference` numerics' own table, where their
        form takes ~8 launches (a decode step rotates 3-6 tensors); other numerics: theirs. In place: the
        model rotates fresh activations it does not read again unrotated (q, the window and compressed keys,
        the output), holding bf16 values, so only the rotated dims are read and written (64 of 512 for q)."""
        rd = freqs.numel() * 2
        if not (self.compute and self._bf16_stream) or rd > x.shape[-1] or (x.shape[-1] - rd) % 2:
            return self.base.rotate(x, positions, freqs, inverse)
        table = torch.view_as_real(self.base._rope_table(freqs, x.device))
        self._x_memo = [kept for kept in self._x_memo if kept[0] is not x]  # x is written below
        return self._kernel("rope")(x, positions, table, inverse, inplace=True)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        """The shared expert's gated product in one launch (kernels/elementwise.py; the wrapped numerics: ~6);
        stored bf16 under `reference` (its one reader, w2's linear, takes bf16 as it is)."""
        if not self.compute or gate.shape != up.shape:
            return self.base.swiglu(gate, up, limit)
        return self._kernel("swiglu")(gate, up, limit, round_bf16=self._bf16_stream, bf16_out=self._bf16_stream)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a + b in one launch, stored as `act` stores it (the wrapped numerics: a sum and two rounding copies);
        stored bf16 with the bf16 stream (its one reader, the FFN's stream update, widens what it loads)."""
        if not self.compute or a.shape != b.shape:
            return self.base.add(a, b)
        return self._kernel("add")(a, b, round_bf16=self._bf16_stream, bf16_out=self._narrow_stream)

    def engram_mix(self, x, kv, q_weight, k_weight, eps: float, token_mask=None) -> torch.Tensor:
        """The Engram's gated update in one launch (kernels/engram.py), stored as `act` stores it; the wrapped
        numerics take ~20 launches over float32 temporaries (~3 ms of a 4,096-token prefill, run 18c)."""
        from kernels.engram import MAX_WIDTH
        if not self.compute or x.dim() != 3 or x.shape[-1] > MAX_WIDTH:
            return self.base.engram_mix(wide(x), wide(kv), q_weight, k_weight, eps, token_mask)
        return self._kernel("engram_mix")(x, kv, q_weight, k_weight, eps, token_mask, round_bf16=self._bf16_stream,
                                          bf16_out=self._narrow_stream)

    def fp8_roundtrip(self, x: torch.Tensor, block: int = 32) -> torch.Tensor:
        """The E4M3 round trip in one launch (kernels/quant.py), bit for bit the wrapped op's (~20 launches:
        the window keys and the Engram table, each decode step; the routed experts' kernel rounds its input
        itself, in the decoders' nibble order)."""
        if not self.compute or x.shape[-1] % block:
            return self.base.fp8_roundtrip(x, block)
        return self._kernel("fp8_roundtrip")(x, block)

    def tie_marks(self, scores: torch.Tensor, idx: torch.Tensor, picked: torch.Tensor):
        """The tie marks in one launch per block of rows (kernels/ties.py), the same values as the wrapped op's
        ~13 launches (a Full layer's decode step marks twice under graph capture)."""
        if not self.compute or scores.dim() != 2:
            return self.base.tie_marks(scores, idx, picked)
        return self._kernel("tie_marks")(scores, idx, picked)

    def quantize_fp4_with_values(self, x: torch.Tensor, block: int, scale_kind: str = "e8m0"):
        """The compressor's new entries (KV, index keys) in one launch each (kernels/quant.py), byte and bit
        for bit the wrapped op's (~15 launches each)."""
        if not self.compute or x.shape[-1] % block:
            return self.base.quantize_fp4_with_values(x, block, scale_kind)
        return self._kernel("quantize_fp4")(x, block, scale_kind, values=True)

    def quantize_fp8(self, x: torch.Tensor, block: int = 32):
        """The window cache's E4M3 bytes in one launch (kernels/quant.py), byte for byte the wrapped op's."""
        if not self.compute or x.shape[-1] % block:
            return self.base.quantize_fp8(x, block)
        return self._kernel("quantize_fp8")(x, block)
