"""The kernel ops' tuning knobs: engine/ops/triton.py TritonOps' choices among its kernels' forms, each a boolean
with its default and the measurement that set it (H200 runs: notes/kernels.md). Benches flip them by name
(`set_knobs`, `benches/release_layer.py --ops / --ab`); the model never does."""

from __future__ import annotations

TOPK_WHOLE_ROW = 4096  # the longest indexer row `topk_whole_row` takes as one tile (a 4K prompt's at m=1)


class KernelKnobs:
    # the routed experts on FP8 tensor cores (kernels/moe_f8.py) at the widths where that form pays
    # (kernels/moe.py fp8_form_pays): the same numerics, sums inside each 32-group at the FP8 MMA's precision
    moe_fp8_mma = False
    # the decode step's FP8 linears with K >= 4096 and N >= 2048 on the kernel's bf16 form too (H200 run 18d:
    # 64 x 5120 x 8192 31.7 us against 43.2 for the FP8 form's best, 64 x 2304 x 5120 15.3 against 16.6;
    # 64 x 1280 x 5120 and 64 x 32768 x 1280 slower); the release layer's graphed decode step (run 19a, against 18c)
    # 30-42 us faster a layer with it (Full m=1 3.518 -> 3.476 ms, 2.9x its HBM floor at 4.04 TB/s)
    linear_bf16_decode = True
    # sparse attention: force the two passes (kernels/sparse_attn_decode.py) on every call where its int32
    # offsets reach the caches, and their bf16x2 form wherever they run, with the kernels' other launch options
    # at their defaults. The wrapper's own defaults already take the two passes' bf16x2 form for the prefill
    # (with those defaults since run 35; attn_bf16x2 then differs only at a decode step: 64-entry tiles, not 128)
    # and decode batches of 16+ tokens; these knobs are for A/B runs, as is attn_one_pass: the one-pass kernel's
    # layouts (the default before run 24a)
    attn_two_pass = False
    attn_bf16x2 = False
    attn_one_pass = False
    # the two passes' weights buffer 128 MB instead of their default 64 (`weight_bytes`; 32 before run 35, 16 before
    # run 34e): ~1,600 tokens a launch pair in a 4K prefill instead of ~800. H100: 16 -> 32 MB took the layer's
    # prefill graph 0.993-0.994x in the four roles with selected entries (34e), 32 -> 64 MB 0.988-0.998x in the same
    # four, twice (35b, 35c; SWA roles within 0.5%); the kernel bench's 4K prefill 2,688 us at 16 MB, 2,460 at 32,
    # 2,334 at 64 (34e). 128 MB: untimed. For an A/B
    attn_big_chunks = False
    # the routed experts' grouped GEMMs with each scale folded into the decode's one bf16x2 multiply
    # (kernels/fp4_tiles.py fp4_decoded_folded), for a layer whose expert scales all fit it (checked once a
    # layer): H200 run 24a, 4K prefill in the engine's hidden-state form 10.13 ms against 10.37, the 64-token
    # decode step 2.62 against 2.66 ms
    moe_fold = True
    # the fused mHC on the float32 stream as it is (bf16 values read from float32, outputs stored so; not timed
    # yet, see _mhc); off: the measured form before it (a bf16 copy of the stream in, float32 copies out)
    mhc_f32_stream = True
    # the residual stream stored bf16 between the kernels that write and read it (the mHC's update, the stream
    # update, the Engram), as the reference keeps it (under `reference` every value in it is bf16 already): the
    # mHC in its bf16-stream form and the stream update move half the bytes. Its mixes' float32 sums run in
    # another order than the float32 stream's (within 1e-4 of float64, the glue test). H100 run 31a, the layer's
    # 4K prefill graph: -0.12 to -0.17 ms a layer (Reuse 14.04 -> 13.90; 0.35-0.4 had been predicted from the
    # mHC's older float32-stream form, 343.8 us, where mhc_f32_stream's 256 was the right baseline); the GPU
    # parity beside the defaults': routing 0.9679 / 0.9445 against 0.9681 / 0.9443, Jaccard 0.9324 / 0.9114
    # against 0.9334 / 0.9114, logits rel L2 4.66e-2 against 4.55e-2, top-1 0.925 against 0.917 (the spread of
    # a sum order). With the collapse kept bf16 too (run 31e): Reuse 13.90 -> 13.73 ms
    stream_bf16 = True
    # the prefill's float32 GEMMs (the router's gate, the compressor's projections) on tensor cores at float32
    # accuracy (kernels/f32_gemm.py, tf32x3) instead of cuBLAS's CUDA-core sgemm (0.33 ms for the gate at 4K
    # tokens, run 18c); float32 sums in another order than cuBLAS's, as accurate (run 24a: the gate 255 us
    # against cuBLAS's 337, the compressor's 559 against 852; 2.6e-7 from float64 against 3.9e-7 / 7.4e-7)
    f32_tf32x3 = True
    # those GEMMs in one bf16 MMA pass instead of tf32x3's three TF32 ones where both operands hold bf16 values
    # (under `reference` the activations do; the gate's and compressor's weights are stored BF16, checked once a
    # weight): tf32x3's lo pieces are zero for such operands, so the same products, exact; each K step's sum
    # added in float32 on the CUDA cores (kernels/f32_gemm.py `promote`: the MMA's own accumulation keeps fewer
    # bits). H100 run 31d: the gate 4096 x 384 x 5120 71.7 us against tf32x3's 249.4, 1.8e-7 from float64
    # against 2.4e-7; the compressor's 4096 x 1024 137.4 against 547.2; the layer's prefill graph -0.19 ms a layer
    # (Reuse 14.08 -> 13.90), -0.87 on Full m=2 (three such GEMMs); parity as before (31d: routing 0.9681 / 0.9445)
    f32_one_pass = True
    # the router's top-k of the biased scores in one kernel (kernels/router.py) instead of torch.topk, whose one
    # sbtopk launch took 81 us of a 4K prefill on [4096, 384] (H100 run 31f); the same picks (ties: the lower
    # expert first, which torch leaves unspecified). H100 run 34b: 15.7 us against torch.topk's 91.4 at 4,096
    # rows (8.4 against 17.2 at 64), picks equal; the layer's prefill graph 0.993-0.999x in all six roles (-0.02 to
    # -0.10 ms), the decode graph 0.993-1.008x
    router_topk = True
    # the indexer's ties broken in the branch-free form (every row re-picked on the full width, the untied
    # keeping theirs: the form a graph capture takes) instead of reading back which rows tie, the prefill's one
    # host read a Full layer. H200 run 25b against 25a: the Full layers' captured prefill the same GPU time
    # (20.47 / 20.28 / 20.49 ms against 20.49 / 20.29 / 20.55), the eager prefill 21.8 against 21.7-23.5 ms
    ties_branch_free = True
    # a prefill's experts with more than 64 pairs in 128-token x 64-row tiles (kernels/moe.py split_m): each weight
    # tile decoded once for up to 128 tokens; sm_90 SASS 393 instructions a K step against 621 for the same MMA
    # work. Beside the narrow tiles below, 128 x 64 split tiles without the register cap (the same area's 128 x 32
    # spill 360 B under it). Run 27b (H100, the layer's prefill as a graph, on top of the narrow tiles and cuBLAS
    # linears): 15.26 / 17.50 ms against 15.44 / 17.70 for Reuse / Full m=1 (-1.2% / -1.1%; decode steps +1.8% /
    # -0.2%, which no knob here reaches); the kernel bench's engine form 8.27 ms against 8.48 (narrow alone)
    moe_split_tiles = True
    # a prefill's grouped GEMMs in 64 x 64 tiles, for more programs an SM (sm_90: down 178 -> 101 registers, 2 -> 4
    # programs; gate/up capped at 168 registers without spills, 2 -> 3) at 27% / 11% more instructions a weight.
    # Run 26b (H100, the layer's prefill as a graph): both on 16.33 / 18.53 ms against 16.80 / 18.99 for Reuse /
    # Full m=1 (the down's alone: -0.7% / -0.4%); the kernel bench's engine form 8.47 ms against 8.81
    moe_narrow_down = True
    moe_narrow_gate_up = True
    # a prefill's grouped GEMMs in the warp-specialized Gluon form (kernels/moe_ws.py: the FP4 decode in warps of
    # its own, TMA loads, asynchronous wgmma) on a Hopper GPU with the folded decode; the same values. Costs a
    # transposed copy of the experts' scales (1/16 of their FP4 bytes) while the weights live. Off until timed.
    moe_ws = False
    # a prefill's grouped GEMMs in the register-operand Gluon form (kernels/moe_rs.py: each FP4 tile decoded
    # straight into the wgmma's A fragment, asynchronous wgmma under the next decode) on a Hopper GPU with the folded
    # decode; the same values (sums in another order inside each 64-wide K step). H100 run 38a: the kernel bench's
    # 4K experts 5,912 us against the default's 8,345 (rel 2.1e-4 to it; the GPU test's cases pass against float64);
    # the layer's prefill graph 0.838x (Reuse 12.95 -> 10.85 ms) and 0.843x (Full m=1 14.74 -> 12.42)
    moe_rs = True
    # a prefill's sparse attention in one pass on wgmma (kernels/sparse_attn_wgmma.py, Gluon: each tile decoded once
    # into shared memory, S and O by warpgroup MMAs) on a Hopper GPU, where its programs fill the SMs at least once
    # (a decode step keeps the two passes); P rounded to bf16 where the two passes store float16. H100 run 38a: the
    # kernel bench's 4K prefill 1,644 us against the two passes' 2,274 (2.19e-3 from the float64 reference against
    # 2.26e-3); the layer's prefill graph 0.962x (Reuse) and 0.970x (Full m=1)
    attn_wgmma = True
    # that form with each selected tile's raw bytes copied (cp.async) into shared memory a tile ahead, the gather's
    # latency under the tile before's MMAs and softmax; the same values. H100 run 40a: the kernel bench's 4K
    # prefill (500 selected of 2^18 entries: gathers from HBM) 1,424.7 us against 1,635.4 (-12.9%; the same rel
    # 2.19e-3 to float64, the GPU test passes); the layer's prefill graph 1.001x (Reuse) and 0.997x (Full m=1): at 4K
    # tokens its compressed cache (~1K entries) sits in L2 and the gathers wait little
    attn_staged = True
    # the register-operand experts in token blocks of 64, 80, 96 and 128 pairs (kernels/moe.py moe_align_classes:
    # an expert's last block the smallest that holds it) where 64 and 128 left a 4K prefill's 128-pair tiles ~56%
    # full; the same values. H100 run 40a: the kernel bench's 4K experts 5,646.5 us against the split tiles' 5,959.1
    # (-5.2%; rel 1.5e-4 to the default form, the GPU tests pass against float64); the layer's prefill graph 0.977x
    # (Reuse 10.03 -> 9.80 ms) and 0.971x (Full m=1 11.83 -> 11.50), decode graphs 1.010x / 0.991x (no knob here
    # reaches a decode step)
    moe_tile_classes = True
    # the register-operand experts' input stored in their MMA order by x's E4M3 round trip (quant.fp8_roundtrip_triton
    # rs=True: one register permute more, 480 sm_90 instructions against 456, 2 KB of shared memory, the same 128-bit
    # stores) instead of a permuting copy after it (64 us of H100 run 40b's Reuse prefill); the same values. H100 run
    # 40d: the GPU test's case within 1e-6 of the copy's output; the layer's prefill graph 0.997x (Reuse 9.914 ->
    # 9.881 ms) and 0.991x (Full m=1 11.498 -> 11.395)
    moe_rs_round_trip = True
    # a prefill's FP8 linears (where the bf16 form runs, past 64 rows) as cuBLAS bf16 GEMMs on the weight's bf16
    # values made for the call (kernels/fp8_linear.py mma="cublas"): the same products, float32 sums in cuBLAS's
    # order. Run 26b (H100): 4096 x 5120 x 8192 544 us against the bf16 form's 743 (wq_b 534 / 778, wq_a 124 /
    # 225, shared w1 181 / 311, wkv 87 / 136); the layer's prefill graph 15.99 / 18.19 ms against 16.80 / 18.99
    # (Reuse / Full m=1); every E4M3 byte exact on the GPU (run 26a)
    linear_cublas = True
    # a prefill's indexer rows of at most TOPK_WHOLE_ROW entries (a 4K prompt's, at m=1 or 2) selected as one
    # register tile each (kernels/topk.py whole_row: one k-th key search over the row, no group maxima, no scratch)
    # instead of through group maxima and a candidate buffer; the same picks. H100 run 41b, the kernel bench's 4K
    # causal rows (every row exact): over 4,096 entries 236.7 us against 303.9 (5-bit digits both; 386.3 at run 40's
    # 8-bit ones), over 2,048 110.2 against 213.4 (41e, short rows on half a tile: 193.2 / 95.3); the layer's prefill
    # graph 1.005x (Full m=1), 0.992x (Full m=2), 0.995x (Reindex): within the A/B's noise (~0.5%) of the 0.6% / 0.9%
    # the kernel predicts; in the layer's profile (41f) the row select 199 / 93 / 200 us against 407 / 396 / 405 (40b)
    topk_whole_row = True
    # the one-pass attention's output stored in 16-byte pieces through the query's buffer (kernels/sparse_attn_wgmma.py
    # wide_store, after per-line Nsight 42d): the kernel bench's 4K prefill 1,369.5 us against 1,457.9 (H100 run 44b;
    # 1,354.6 / 1,480.0 in 44a), the layer's prefill graph 0.978x (Reuse 9.773 ms against 9.984) and 0.982x (Full m=1
    # 11.088 against 11.287) in one process each (44b). attn_late_sum: its softmax sums kept per slot, added once at
    # the end (late_sum): with wide_store 1,283.2 us in the kernel bench (44b), untimed in the layer: off
    attn_wide_store = True
    attn_late_sum = False
    # booleans a bench may set by name (set_knobs)
    KNOBS = ("moe_fp8_mma", "linear_bf16_decode", "attn_two_pass", "attn_bf16x2", "attn_one_pass", "attn_big_chunks",
             "moe_fold", "mhc_f32_stream", "f32_tf32x3", "f32_one_pass", "router_topk",
             "ties_branch_free", "moe_split_tiles", "moe_narrow_down",
             "moe_narrow_gate_up", "linear_cublas", "stream_bf16", "moe_ws", "moe_rs", "attn_wgmma", "attn_staged",
             "moe_tile_classes", "moe_rs_round_trip", "topk_whole_row", "attn_wide_store",
             "attn_late_sum")

    def attn_wgmma_options(self) -> dict:
        """The one-pass wgmma attention's options (kernels/sparse_attn_wgmma.py) the knobs ask for."""
        chosen = {"staged": self.attn_staged, "wide_store": self.attn_wide_store, "late_sum": self.attn_late_sum}
        return {"wgmma": {name: True for name, on in chosen.items() if on}} if any(chosen.values()) else {}

    def moe_rs_options(self) -> dict:
        """The register-operand experts' options (kernels/moe.py, ws="rs") the knobs ask for, beside ws itself."""
        form = {"split_m": (80, 96, 128)} if self.moe_tile_classes else {}  # 64 / 80 / 96 / 128-pair token blocks
        if self.moe_rs_round_trip:  # x stored in the form's order by its round trip
            form["rs_round_trip"] = True
        return form

    def set_knobs(self, spec: str) -> dict:
        """Set the tuning knobs above from "name=value,..." (benches; values 0 or 1); returns them set."""
        knobs = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, _, text = item.partition("=")
            if name not in self.KNOBS:
                raise ValueError(f"unknown kernel-ops knob {name!r}; the knobs: {', '.join(self.KNOBS)}")
            if text not in ("0", "1"):
                raise ValueError(f"knob {name}: {text!r} is not 0 or 1")
            knobs[name] = text == "1"
        for name, value in knobs.items():  # all or nothing: a refused spec sets none
            setattr(self, name, value)
        return knobs
