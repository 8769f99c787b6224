"""The kernel ops' prefill, where a host read stalls the GPU: TritonOps.index_topk settles the ties of all its
query blocks at once (one read of which rows tie, after every block's kernels are queued), and picks what the
block-by-block settling picks. On the tiny model, the kernels' references standing in for the kernels."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.checkpoint.reader import CheckpointReader  # noqa: E402
from engine.checkpoint.weights import CheckpointWeights  # noqa: E402
from engine.model.transformer import Model  # noqa: E402
from engine.run.probes import ProbeRequest  # noqa: E402
from engine_helpers import IdentityTokenizer, random_ids, tiny_config, write_tiny_checkpoint  # noqa: E402


def _tiny_prefill(tmp_path, monkeypatch, on_break_ties, tokens: int = 64):
    """A 64-token (or `tokens`) prefill of the tiny model on the kernel ops (the kernels' references standing in), every
    break_ties call shown to on_break_ties(args) first -> run(configure): each picking layer's (top-k, tied)
    for a fresh model that configure(model) set up."""
    import engine.ops.triton as kernel_ops
    from engine.ops.reference import ReferenceOps

    monkeypatch.setattr(kernel_ops, "interpreter_active", lambda: False)
    cfg = tiny_config()
    weights = CheckpointWeights(CheckpointReader(write_tiny_checkpoint(tmp_path, seed=5, n_shards=1), cfg))
    ids = random_ids(cfg, tokens, seed=4)
    real = ReferenceOps.break_ties
    monkeypatch.setattr(ReferenceOps, "break_ties", lambda self, *a: (on_break_ties(a), real(self, *a))[1])

    def run(configure):
        model = Model(cfg, weights, IdentityTokenizer(cfg.engram_compressed_vocab_size), numerics="reference",
                      kernels=True)
        configure(model)
        collect = {}
        model.forward(ids, probes=ProbeRequest(kinds={"topk"}), collect=collect)
        return {L: (c["topk"], c.get("topk_tied")) for L, c in collect.items() if "topk" in c}
    return run


def _assert_same_picks(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for layer, (picks, tied) in a.items():
        assert torch.equal(picks, b[layer][0]), layer
        assert (tied is None) == (b[layer][1] is None)
        if tied is not None:
            assert torch.equal(tied, b[layer][1]), layer


def test_ties_are_settled_once_for_every_query_block(tmp_path, monkeypatch):
    import engine.model.attention as A

    calls = []
    run = _tiny_prefill(tmp_path, monkeypatch, lambda args: calls.append(args[5].shape[0]))
    out, n_calls = {}, {}
    for block in (64, 16):  # one query block, then four
        monkeypatch.setattr(A, "QUERY_BLOCK", block)
        calls.clear()
        out[block] = run(lambda model: None)
        assert calls and all(rows == 64 for rows in calls), calls  # every call sees all 64 queries' rows
        n_calls[block] = len(calls)
    assert n_calls[16] == n_calls[64]  # one a picking layer, however many blocks
    _assert_same_picks(out[64], out[16])


def test_branch_free_ties_pick_the_same_without_a_host_read(tmp_path, monkeypatch):
    """ties_branch_free: break_ties runs in its branch-free form (no read of which rows tie) and every layer
    picks what the host-read form picks, ties marked alike."""
    from engine.capture import capturing

    forms = []
    run = _tiny_prefill(tmp_path, monkeypatch, lambda args: forms.append(capturing()))
    out = {}
    for knob in ("0", "1"):
        forms.clear()
        out[knob] = run(lambda model: model.ops.set_knobs(f"ties_branch_free={knob}"))
        assert forms and set(forms) == {knob == "1"}
    _assert_same_picks(out["0"], out["1"])


def test_linears_sharing_an_input_round_it_once(monkeypatch):
    """TritonOps._x_values: the bf16 form's rounded input is made once for two linears fed the same tensor
    (wq_a and wkv), again after an in-place write (the version), and after the in-place RoPE, which drops what
    it rewrites (inference tensors keep no version)."""
    import kernels.dispatch as dispatch
    import kernels.fp8_linear as fp8_linear
    from engine import quant
    from engine.ops import ops_for
    from engine.ops.stored import StoredWeights, TensorReader
    from engine.ops.triton import TritonOps

    g = torch.Generator().manual_seed(3)
    stored = {}
    for name in ("layers.0.attn.wq_a", "layers.0.attn.wkv"):
        q, s = quant.quantize_fp8_weight(torch.randn(64, 128, generator=g) / 10, 32)
        stored[name + ".weight"], stored[name + ".scale"] = q, s
    ops = TritonOps(ops_for("reference"), StoredWeights(reader=TensorReader(stored)), "cpu")
    made, seen = [], []
    monkeypatch.setattr(dispatch, "use_triton", lambda device: True)
    monkeypatch.setattr(fp8_linear, "x_values_bf16", lambda x: made.append(x) or x.bfloat16())
    from kernels.rope import rope_reference
    monkeypatch.setattr(ops, "_kernel", lambda name: rope_reference if name == "rope" else
                        lambda *a, **k: seen.append(k.get("x_values")) or fp8_linear.fp8_linear_reference(*a, **k))
    x = torch.randn(80, 128, generator=g)
    for base in ("layers.0.attn.wq_a", "layers.0.attn.wkv"):
        ops.linear(x, base, None, True, None)
    assert len(made) == 1 and seen[0] is seen[1] is not None
    x.mul_(2)  # written in place: a new version, new values
    ops.linear(x, "layers.0.attn.wq_a", None, True, None)
    assert len(made) == 2 and seen[2] is not seen[1]
    with torch.inference_mode():
        xi = torch.randn(80, 128)
        ops.linear(xi, "layers.0.attn.wq_a", None, True, None)
        ops.linear(xi, "layers.0.attn.wkv", None, True, None)
        assert len(made) == 3  # identity alone
        freqs = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
        assert ops.rotate(xi, torch.arange(80), freqs) is xi  # written in place
        ops.linear(xi, "layers.0.attn.wkv", None, True, None)
        assert len(made) == 4


def test_gpu_query_blocks_fill_the_score_budget(monkeypatch):
    """TritonOps._query_rows: on the GPU whole 512-query blocks up to SCORE_ELEMENTS scores (a 4K prefill over
    1,024 entries in one block; 256K entries: one 512-query block, the floor); where the references run, the
    given block."""
    import kernels.dispatch as dispatch
    from engine.ops.triton import TritonOps

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert TritonOps._query_rows(cpu, 1024, 512) == 512
    monkeypatch.setattr(dispatch, "use_triton", lambda device: device.type == "cuda")
    assert TritonOps._query_rows(gpu, 1024, 512) == (1 << 25) // 1024 >= 4096
    assert TritonOps._query_rows(gpu, 1 << 18, 512) == 512
    assert TritonOps._query_rows(gpu, 3000, 512) == 21 * 512  # 2^25 / (3000 x 512) = 21.8 -> whole blocks


def test_tile_knobs_reach_the_prefill_experts_only(tmp_path, monkeypatch):
    """moe_split_tiles, moe_narrow_down, moe_narrow_gate_up: a prefill's routed experts (more than four pairs an
    expert: the 64-token blocks' width) are launched with the knob's tiles; without it, or at a few pairs, with
    none. The picks do not move."""
    import kernels.dispatch as dispatch

    seen = []
    reference, triton_version = dispatch._PAIRS["moe_fp4"]

    def recorded(*args, **kwargs):
        seen.append((args[7].numel(), args[1].shape[0], {k: kwargs.get(k) for k in TILES}))
        return reference(*args, **kwargs)

    monkeypatch.setitem(dispatch._PAIRS, "moe_fp4", (recorded, triton_version))
    run = _tiny_prefill(tmp_path, monkeypatch, lambda args: None)
    out = {}
    for spec, launch in KNOB_TILES.items():
        seen.clear()
        out[spec] = run(lambda model: model.ops.set_knobs(spec))
        assert seen and all(tiles == {**dict.fromkeys(TILES), **(launch if pairs > 4 * experts else {})}
                            for pairs, experts, tiles in seen), (spec, seen)
        assert any(pairs > 4 * experts for pairs, experts, _ in seen)
    for spec in KNOB_TILES:
        _assert_same_picks(out[NO_TILES], out[spec])


TILES = ("split_m", "block_n", "maxnreg", "down_block_n", "down_maxnreg", "split_n", "split_maxnreg")
NO_TILES = "moe_split_tiles=0,moe_narrow_gate_up=0,moe_narrow_down=0"
NARROW = {"block_n": 64, "maxnreg": 168, "down_block_n": 64, "down_maxnreg": 0}
# each tile knob setting and the launch options it gives a prefill's grouped GEMMs (split tiles beside narrow ones
# in rows of their own, uncapped: the same area's spill under the cap); "moe_split_tiles=1" alone: the defaults
KNOB_TILES = {NO_TILES: {},
              "moe_split_tiles=1,moe_narrow_gate_up=0,moe_narrow_down=0": {"split_m": 128},
              "moe_split_tiles=1": {**NARROW, "split_m": 128, "split_n": 64, "split_maxnreg": 0},
              "moe_split_tiles=0,moe_narrow_gate_up=0,moe_narrow_down=1": {"down_block_n": 64},
              "moe_split_tiles=0,moe_narrow_gate_up=1,moe_narrow_down=0": {"block_n": 64, "maxnreg": 168,
                                                                           "down_block_n": 128, "down_maxnreg": 0},
              "moe_split_tiles=0,moe_narrow_gate_up=1,moe_narrow_down=1": NARROW}


def test_cublas_knob_takes_the_prefill_linears_only(tmp_path, monkeypatch):
    """linear_cublas: the FP8 linears that take the bf16 form at a prefill's rows (past 64) go to its cuBLAS form;
    without the knob none do. The picks do not move (the same products; the references stand in here)."""
    import kernels.dispatch as dispatch

    seen = []
    reference, triton_version = dispatch._PAIRS["fp8_linear"]

    def recorded(*args, **kwargs):
        seen.append((args[0].shape[0], kwargs.get("mma")))
        return reference(*args, **kwargs)

    monkeypatch.setitem(dispatch._PAIRS, "fp8_linear", (recorded, triton_version))
    run = _tiny_prefill(tmp_path, monkeypatch, lambda args: None, tokens=96)  # past a decode step's 64 rows
    out, calls = {}, {}
    for knob in ("0", "1"):
        seen.clear()
        out[knob] = run(lambda model: model.ops.set_knobs(f"linear_cublas={knob}"))
        calls[knob] = list(seen)
    assert any(rows > 64 and mma == "bf16" for rows, mma in calls["0"]), calls["0"]
    assert "cublas" not in {mma for _, mma in calls["0"]}
    # call by call: the bf16 form at a prefill's rows becomes the cuBLAS form, every other call stays as it was
    assert calls["1"] == [(rows, "cublas" if rows > 64 and mma == "bf16" else mma) for rows, mma in calls["0"]]
    _assert_same_picks(out["0"], out["1"])


def test_narrow_gemm_outputs_reach_their_consumers_as_bf16(tmp_path, monkeypatch):
    """`narrow`: under the `reference` numerics the kernel ops keep a GEMM's bf16 output where its consumer reads
    bf16 (the queries through the RoPE to the attention; wq_a and wkv into their RMSNorms; a block's input norms
    into the attention's and the FFN's GEMMs; the Engram's wkv into its mix; the grouped wo_a into wo_b's linear,
    wo_b into the mHC update; the shared expert's w1 and w3 into the SwiGLU, the SwiGLU into w2, w2 into the sum,
    the sum into the FFN's stream update; the FFN norm into the routed experts' kernel, which rounds it itself;
    the indexer's wq_b into its RoPE and FP4 quantizer): no widening copies, and none narrowing again. The same values as the float32 form, so every layer's attention
    output, wo_b output, mHC update, shared-expert sum, expert output, Engram mix, index queries and picks are bit
    for bit those of a model whose GEMMs and norms all widen."""
    from engine.ops.triton import TritonOps

    seen = []  # (op, its inputs' dtypes, its output) per call

    def watch(name):
        real = getattr(TritonOps, name)
        operands = {"sparse_attention": lambda a: a[1:2], "swiglu": lambda a: a[:2], "add": lambda a: a[1:2]}[name]

        def op(self, *args):
            out = real(self, *args)
            seen.append((name, tuple(t.dtype for t in operands(args)), out.float()))
            return out
        monkeypatch.setattr(TritonOps, name, op)
    for name in ("sparse_attention", "swiglu", "add"):
        watch(name)
    real_mhc_ffn, real_experts = TritonOps.mhc_ffn, TritonOps.routed_experts

    def mhc_ffn(self, layer, x, update, *args):
        out = real_mhc_ffn(self, layer, x, update, *args)
        seen.append(("mhc_ffn", (update[0].dtype,), torch.cat([out[0].flatten(), out[1].flatten()])))
        return out

    def routed_experts(self, cfg, layer, prefix, x, experts, weights, get, linear, owned=None):
        seen.append(("experts' input", (x.dtype,), x.float()))  # the block norm's, rounded by the kernel itself
        return real_experts(self, cfg, layer, prefix, x, experts, weights, get, linear, owned)
    monkeypatch.setattr(TritonOps, "mhc_ffn", mhc_ffn)
    monkeypatch.setattr(TritonOps, "routed_experts", routed_experts)
    real_linear = TritonOps.linear

    def linear(self, x, base, *args, **kw):
        out = real_linear(self, x, base, *args, **kw)
        if base.endswith("attn.wo_b"):
            seen.append(("wo_b", (x.dtype,), out.float()))
        elif base.endswith(("attn.wq_a", "attn.wkv")):  # into their RMSNorms, which read bf16 as it is
            seen.append(("norm input", (out.dtype,), out.float()))
        elif base.endswith("attn.indexer.wq_b"):  # into the in-place RoPE (hence the copy) and the FP4 quantizer
            seen.append(("index queries", (out.dtype,), out.float().clone()))
        elif base.endswith("shared_experts.w2"):  # the SwiGLU's output, which the linear takes as it is
            seen.append(("shared hidden", (x.dtype,), out.float()))
        return out
    monkeypatch.setattr(TritonOps, "linear", linear)
    real_norm, norms_narrow = TritonOps.rms_norm, [True]

    def rms_norm(self, x, weight, eps, narrow=False):
        out = real_norm(self, x, weight, eps, narrow and norms_narrow[0])
        if narrow:  # a block's input norm: its readers are the attention's and the FFN's GEMMs
            seen.append(("block norm", (out.dtype,), out.float()))
        return out
    monkeypatch.setattr(TritonOps, "rms_norm", rms_norm)
    real_engram_mix = TritonOps.engram_mix

    def engram_mix(self, x, kv, *args):  # kv: the Engram's wkv GEMM (gemm_of)
        out = real_engram_mix(self, x, kv, *args)
        seen.append(("engram kv", (kv.dtype,), out.float()))
        return out
    monkeypatch.setattr(TritonOps, "engram_mix", engram_mix)
    real_expand = TritonOps.expand

    def expand(self, y, residual, post, comb):  # y: the FFN's output, the shared-expert sum
        out = real_expand(self, y, residual, post, comb)
        seen.append(("FFN output", (y.dtype,), out.float()))
        return out
    monkeypatch.setattr(TritonOps, "expand", expand)
    run = _tiny_prefill(tmp_path, monkeypatch, lambda args: None)
    models = []

    def widen(model):
        linear, grouped_out, gemm_of = model.linear, model.ops.grouped_out, model.ops.gemm_of
        model.linear = lambda x, base, narrow=False: linear(x, base)  # the blocks below take it
        model.ops.grouped_out = lambda o, wo_a, name="", narrow=False: grouped_out(o, wo_a, name)
        model.ops.gemm_of = lambda x, fetch, name: gemm_of(x, fetch, name).float()
        swiglu, add = model.ops.swiglu, model.ops.add
        model.ops.swiglu = lambda *args: swiglu(*args).float()
        model.ops.add = lambda *args: add(*args).float()
        norms_narrow[0] = False
        model.reset()

    narrow_picks = run(models.append)
    narrow_seen, seen[:] = seen[:], []
    wide_picks = run(widen)
    assert {n for n, _, _ in narrow_seen} == {"sparse_attention", "swiglu", "add", "wo_b", "mhc_ffn",
                                               "experts' input", "norm input", "block norm", "engram kv",
                                               "index queries", "shared hidden", "FFN output"}
    assert {d for _, dtypes, _ in narrow_seen for d in dtypes} == {torch.bfloat16}
    assert {d for _, dtypes, _ in seen for d in dtypes} == {torch.float32}
    assert [n for n, _, _ in seen] == [n for n, _, _ in narrow_seen]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(narrow_seen, seen))
    _assert_same_picks(narrow_picks, wide_picks)

    model = models[0]
    x = torch.randn(40, model.cfg.q_lora_rank, generator=torch.Generator().manual_seed(5)).bfloat16().float()
    narrow, wide = (model.ops.linear(x, "layers.0.attn.wq_b", model.weights, True, model._rounded, narrow=n)
                    for n in (True, False))
    assert narrow.dtype == torch.bfloat16 and wide.dtype == torch.float32 and torch.equal(narrow.float(), wide)


def test_bf16_stream_knob_stores_the_stream_bf16_with_the_same_results(tmp_path, monkeypatch):
    """Knob stream_bf16: the residual stream stored bf16 between the kernels that write it (the mHC's update, the
    FFN's stream update, the Engram) and read as such by the mHC's bf16-stream form. Under `reference` every
    value of the stream is bf16 already, so a prefill and two decode steps give the float32 stream's logits,
    picks and residual norms bit for bit (the kernels' references standing in: their mixes sum in float64 from
    the same values either way), while the stream between blocks is bf16, and so are the collapses handed to the
    RMSNorms (which read bf16 as it is)."""
    import engine.ops.triton as kernel_ops
    from engine.ops.triton import TritonOps

    monkeypatch.setattr(kernel_ops, "interpreter_active", lambda: False)
    cfg = tiny_config()
    weights = CheckpointWeights(CheckpointReader(write_tiny_checkpoint(tmp_path, seed=5, n_shards=1), cfg))
    ids = random_ids(cfg, 48, seed=4)
    streams = []  # (op, the dtype it stored) for each stream update, mHC update and Engram

    def watch(name):
        real = getattr(TritonOps, name)

        def op(self, *args, **kwargs):
            out = real(self, *args, **kwargs)
            if name == "mhc_ffn":  # the updated stream, and the collapse handed to the FFN's RMSNorm
                streams.extend([(name, out[0].dtype), ("ffn input", out[1].dtype)])
            elif name == "mhc_attention":  # the collapse handed to the attention's RMSNorm
                streams.append(("attention input", out[0].dtype))
            else:
                streams.append((name, out.dtype))
            return out
        monkeypatch.setattr(TritonOps, name, op)
    for name in ("expand", "engram_mix", "mhc_ffn", "mhc_attention"):
        watch(name)

    def run(knob: int):
        model = Model(cfg, weights, IdentityTokenizer(cfg.engram_compressed_vocab_size), numerics="reference",
                      kernels=True)
        assert model.ops.set_knobs(f"stream_bf16={knob}") == {"stream_bf16": bool(knob)}
        steps = []
        for chunk in (ids[:40], ids[40:41], ids[41:42]):  # a prefill, then two decode steps
            collect = {}
            logits = model.forward(chunk, probes=ProbeRequest(kinds={"topk", "mhc"}), collect=collect)
            steps.append((logits, {L: (c.get("topk"), c["residual_norms"]) for L, c in collect.items()}))
        return steps

    wide = run(0)
    wide_streams, streams[:] = set(streams), []
    narrow = run(1)
    written = ("expand", "engram_mix", "mhc_ffn", "ffn input", "attention input")
    assert wide_streams == {(name, torch.float32) for name in written}
    assert set(streams) == {(name, torch.bfloat16) for name in written}
    for (lw, pw), (ln, pn) in zip(wide, narrow):
        assert torch.equal(lw, ln)
        assert pw.keys() == pn.keys() and pw
        for layer, (picks, norms) in pw.items():
            assert (picks is None) == (pn[layer][0] is None) and (picks is None or torch.equal(picks, pn[layer][0]))
            assert norms.dtype == pn[layer][1].dtype == torch.float32 and torch.equal(norms, pn[layer][1]), layer


def test_float32_gemms_of_bf16_operands_take_one_pass(tmp_path, monkeypatch):
    """f32_one_pass: under `reference` a prefill's float32 GEMMs (the router's gate, a Full m=2 layer's
    compressor) get operands that all hold bf16 values (the activations as `reference` stores them, the
    BF16-stored weights), so each takes the kernel's one bf16 pass, whose products are then tf32x3's, exact;
    the knob off keeps tf32x3."""
    import kernels.dispatch as dispatch

    seen = []  # (w's rows, x exact in bf16, w exact in bf16, precision) per kernel call
    reference, triton_version = dispatch._PAIRS["f32_gemm"]

    def recorded(x, w, **kwargs):
        exact = [torch.equal(t.bfloat16().float(), t.float()) for t in (x, w)]
        seen.append((w.shape[0], *exact, kwargs.get("precision", "tf32x3")))
        return reference(x, w, **kwargs)

    monkeypatch.setitem(dispatch._PAIRS, "f32_gemm", (recorded, triton_version))
    run = _tiny_prefill(tmp_path, monkeypatch, lambda args: None, tokens=300)  # past the decode widths' 256
    out, calls = {}, {}
    for knob in ("0", "1"):
        seen.clear()
        out[knob] = run(lambda model: model.ops.set_knobs(f"f32_one_pass={knob}"))
        calls[knob] = list(seen)
    cfg = tiny_config()
    widths = {rows for rows, *_ in calls["1"]}
    assert {cfg.n_routed_experts, cfg.head_dim} <= widths  # the gate's and the compressor's
    assert [rows for rows, *_ in calls["0"]] == [rows for rows, *_ in calls["1"]]
    assert all(c[1:] == (True, True, "bf16") for c in calls["1"]), calls["1"]
    assert {c[3] for c in calls["0"]} == {"tf32x3"}
    _assert_same_picks(out["0"], out["1"])


def test_gluon_form_knobs_reach_the_prefill_experts_only_where_they_run(tmp_path, monkeypatch):
    """moe_rs and moe_ws: a prefill's folded experts take the Gluon form the knob names (moe_rs first) where
    moe_ws.runs_on says the device has one, moe_tile_classes its 64 / 80 / 96 / 128-pair token blocks and
    moe_rs_round_trip its input's order made by the round trip (the register-operand form's alone); nowhere else,
    and no knob moves a pick."""
    import kernels.dispatch as dispatch
    import kernels.moe_ws as moe_ws

    seen = []
    reference, triton_version = dispatch._PAIRS["moe_fp4"]

    def recorded(*args, **kwargs):
        classes = {"split_m": kwargs["split_m"]} if isinstance(kwargs.get("split_m"), tuple) else {}
        seen.append((args[7].numel() > 4 * args[1].shape[0], kwargs.get("bf16_decode"),
                     {**{k: kwargs[k] for k in ("ws", "ws_decoders", "rs_round_trip")
                         if k in kwargs}, **classes}))
        return reference(*args, **{k: v for k, v in kwargs.items() if not k.startswith(("ws", "rs_"))})

    monkeypatch.setitem(dispatch._PAIRS, "moe_fp4", (recorded, triton_version))
    run = _tiny_prefill(tmp_path, monkeypatch, lambda args: None)
    out = {}
    widths = []
    for runs, fits, spec, want in ((True, True, "moe_fold=1,moe_rs=1,moe_ws=1", {"ws": "rs"}),
                                   (True, True, "moe_fold=1,moe_rs=0,moe_ws=1", {"ws": True, "ws_decoders": 2}),
                                   (True, True, "moe_fold=1,moe_rs=0,moe_ws=0", {}),
                                   (True, True, "moe_fold=1,moe_rs=1,moe_tile_classes=1",
                                    {"ws": "rs", "split_m": (80, 96, 128)}),
                                   (True, True, "moe_fold=1,moe_rs=0,moe_ws=1,moe_tile_classes=1",
                                    {"ws": True, "ws_decoders": 2}),  # token blocks of several sizes: rs alone
                                   (True, True, "moe_fold=1,moe_rs=1,moe_tile_classes=1,moe_rs_round_trip=1",
                                    {"ws": "rs", "split_m": (80, 96, 128), "rs_round_trip": True}),
                                   (True, True, "moe_fold=1,moe_rs=0,moe_ws=1,moe_tile_classes=1,moe_rs_round_trip=1",
                                    {"ws": True, "ws_decoders": 2}),  # the rs form's order: rs alone
                                   (False, True, "moe_fold=1,moe_rs=1,moe_ws=1", {}),
                                   (True, False, "moe_fold=1,moe_rs=1,moe_ws=1", {})):  # experts too narrow to tile
        monkeypatch.setattr(moe_ws, "runs_on", lambda device, _runs=runs: _runs)
        monkeypatch.setattr(moe_ws, "gluon_fits", lambda dim, inter, _fits=fits: widths.append((dim, inter)) or _fits)
        seen.clear()
        off = "".join(f",{knob}=0" for knob in ("moe_tile_classes", "moe_rs_round_trip") if knob not in spec)
        out[(runs, spec)] = run(lambda model: model.ops.set_knobs(spec + off))  # (both on by default)
        prefill = [form for wide, fold, form in seen if wide and fold == "fold"]
        assert prefill and all(form == want for form in prefill), (spec, seen)
        assert all(form == {} for wide, fold, form in seen if not wide or fold != "fold"), (spec, seen)
    cfg = tiny_config()
    assert widths and set(widths) == {(cfg.dim, cfg.moe_inter_dim)}, widths  # the experts' (dim, inter) asked
    first = next(iter(out.values()))
    for picks in out.values():
        _assert_same_picks(first, picks)
