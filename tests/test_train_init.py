"""Continuing training from an exported checkpoint: the trainee starts from exactly the weights the
engine serves (dequantized), experts stacked per layer, routing biases kept."""

from pathlib import Path

import torch

from engine.checkpoint.reader import CheckpointReader
from engine.config import load_config
from engine.train.params import Trainee

MODEL = Path(__file__).resolve().parent.parent / "assets" / "model"


def test_from_checkpoint_holds_the_served_weights():
    cfg = load_config(MODEL / "config.json")
    reader = CheckpointReader(MODEL, cfg)
    trainee = Trainee.from_checkpoint(cfg, MODEL)
    for name in ("embed.weight", "layers.3.attn.wq_a.weight", "layers.20.attn.indexer.wq_b.weight"):
        assert torch.equal(trainee.get(name).detach(), reader.dequantized(name).float()), name
    stacked = trainee.get("layers.7.ffn.experts.w2").detach()
    assert stacked.shape[0] == cfg.n_routed_experts
    for e in (0, cfg.n_routed_experts - 1):
        assert torch.equal(stacked[e], reader.dequantized(f"layers.7.ffn.experts.{e}.w2.weight").float())
    bias = reader.dequantized("layers.39.ffn.gate.bias").float()
    assert bias.abs().sum() > 0  # a trained model's balancing biases are not the zeros of a fresh one
    assert torch.equal(trainee.get("layers.39.ffn.gate.bias"), bias)


def test_phase_schedule():
    """Dense warm-up, sparse, quantization-aware by the budget's share; --dense-every mixes dense
    steps into the sparse phase only; --smoke splits the steps evenly."""
    from types import SimpleNamespace

    from engine.train.loop import phase_name

    a = SimpleNamespace(smoke=False, max_steps=0, dense_frac=0.2, quant_frac=0.25, dense_every=0)
    assert [phase_name(f, 7, a) for f in (0.0, 0.19, 0.2, 0.74, 0.75, 0.99)] == \
        ["dense", "dense", "sparse", "sparse", "quant", "quant"]
    a.dense_every = 4
    assert [phase_name(0.5, s, a) for s in range(8)] == ["sparse"] * 3 + ["dense"] + ["sparse"] * 3 + ["dense"]
    assert phase_name(0.9, 3, a) == "quant" and phase_name(0.1, 1, a) == "dense"
    a.smoke, a.max_steps = True, 6
    assert [phase_name(0.0, s, a) for s in range(6)] == ["dense"] * 2 + ["sparse"] * 2 + ["quant"] * 2


def test_cpu_smoke_run_logs_phase_throughput_and_exports(tmp_path):
    """The whole loop on the CPU (tiny widths, two steps per phase) with the sequence balance term:
    each phase's tokens/s comes from its non-compiling steps, the balance loss is logged, the
    checkpoint is written."""
    import json

    import numpy as np

    from engine.train.__main__ import main

    rng = np.random.default_rng(0)
    tokens = tmp_path / "train.npy"
    np.save(tokens, rng.integers(5, 4000, 20_000).astype(np.uint16))
    out = tmp_path / "out"
    main(["train", "--cpu", "--tiny", "--train", str(tokens), "--batch", "2", "--seq", "64", "--dense-batch", "2",
          "--dense-seq", "64", "--max-steps", "6", "--smoke", "--log-every", "1", "--seq-balance", "0.01",
          "--deadline-s", "600", "--profile-step", "3", "--profile-out", str(tmp_path), "--out", str(out),
          "--n-shards", "1"])
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 6 and log["tokens_seen"] == 6 * 2 * 64
    # two steps per phase, the first of each compiles (left out), and the profiled one (the sparse
    # phase's second) is left out too: one timed step for dense and quant, none for sparse
    assert set(log["phase_tok_s"]) == {"dense", "quant"}
    profile_text = (tmp_path / "profile.txt").read_text()
    assert "phase sparse" in profile_text
    # the forward's named parts reach the profiler
    for part in ("part.mhc.mixes_collapse", "part.attn.core", "part.moe.experts", "part.indexer.loss", "part.head"):
        assert part in profile_text, part
    assert all(v > 0 for v in log["phase_tok_s"].values())
    steps = [e for e in log["events"] if e["event"] == "step"]
    assert all(e["balance"] > 0 for e in steps)
    # each logged step carries every phase's latest batch loss so far (the last one: all three)
    assert set(steps[-1]["ce_by_phase"]) == {"dense", "sparse", "quant"}
    assert all(e["ce_by_phase"][e["phase"]] == e["ce"] for e in steps)
    assert (out / "model" / "model.safetensors.index.json").exists()


def test_busy_time_is_the_union_of_kernel_intervals():
    from engine.profiling import busy_time

    assert busy_time([]) == 0.0
    # [0, 4) and [2, 5) overlap on [2, 4); [7, 8) apart; [7.5, 7.8) inside it: 5 + 1
    assert busy_time([(7.0, 8.0), (2.0, 5.0), (0.0, 4.0), (7.5, 7.8)]) == 6.0


def test_kernel_events_leave_out_the_gpu_copies_of_named_ranges():
    """A `part.*` range is recorded on the GPU too, spanning its kernels and the gaps between them:
    summed with the kernels it counted them twice (the first profile of stop 26 read 1.85 s for 1.22 s)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from engine.profiling import kernel_events

    ev = lambda name, dev, annotation: SimpleNamespace(name=name, device_type=dev, is_user_annotation=annotation)
    events = [ev("part.attn.core", DeviceType.CPU, True), ev("part.attn.core", DeviceType.CUDA, True),
              ev("gemm", DeviceType.CUDA, False), ev("aten::mm", DeviceType.CPU, False), ev("add", DeviceType.CUDA, False)]
    assert [e.name for e in kernel_events(events)] == ["gemm", "add"]


def test_compile_cache_round_trip_and_bad_files(tmp_path):
    """The portable compile cache: nothing compiled writes nothing; a missing file is 'none'; a corrupt
    one is reported and skipped (the run compiles as usual) instead of failing the run."""
    from engine.train.__main__ import load_compile_cache, save_compile_cache

    assert load_compile_cache(str(tmp_path / "absent.bin")) == "none"
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a cache")
    assert load_compile_cache(str(bad)).startswith("not loaded")
    assert save_compile_cache("") == 0


def test_routing_bias_step_moves_each_layer_toward_its_mean_load():
    """Auxiliary-loss-free balance: after a step, bias_e of layer L moved by gamma * sign(mean load -
    load_e) of that layer's own loads (hand computation per layer), the biases updated in place."""
    from types import SimpleNamespace

    from engine.train.loop import Run

    cfg = load_config(Path(__file__).resolve().parent.parent / "assets" / "configs" / "small.json")
    trainee = Trainee(cfg, "cpu", seed=0)
    args = SimpleNamespace(bf16=False, compile=False, checkpoint=False, fused_picks=False, lr=1e-3,
                           kl_weight=1.0, margin=0.1, focus=0.0, seq_balance=0.0, gamma=0.25,
                           batch=1, seq=64, dense_batch=1, dense_seq=64)
    run = Run(cfg, trainee, torch.arange(cfg.vocab_size), args, torch.device("cpu"))
    before = {k: v.clone() for k, v in trainee.biases.items()}
    held = {k: v for k, v in trainee.biases.items()}
    phase = run.phases()["sparse"]
    out, _ = run.step(phase, torch.randint(5, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0)), 1e-3)
    for L in range(cfg.n_layers):
        name = f"layers.{L}.ffn.gate.bias"
        load = out.loads[L]
        want = before[name] + 0.25 * torch.sign(load.mean() - load)
        assert torch.equal(trainee.biases[name], want), L
        assert trainee.biases[name] is held[name]
    assert any(not torch.equal(trainee.biases[k], before[k]) for k in before)


def test_idle_gaps_name_the_kernels_around_them_and_the_host_ops_inside():
    """Gaps between kernels, longest first, from the union of kernel intervals (a kernel inside another's span
    opens no gap); the host's innermost ops (runtime calls, aten ops with no aten op inside) that overlap a
    gap, by overlap; gaps under min_us left out."""
    from types import SimpleNamespace

    from engine.profiling import idle_gaps

    ev = lambda name, lo, hi, children=(): SimpleNamespace(name=name, time_range=SimpleNamespace(start=lo, end=hi),
                                                           cpu_children=list(children))
    kernels = [ev("b", 150, 160), ev("a", 0, 100), ev("inner", 10, 20), ev("c", 400, 410), ev("d", 415, 420)]
    sync = ev("cudaStreamSynchronize", 90, 390)
    host = [ev("aten::nonzero", 80, 395, [sync]), sync, ev("cudaLaunchKernel", 395, 399)]
    gaps = idle_gaps(kernels, host, min_us=20)
    assert [(g["us"], g["before"], g["after"]) for g in gaps] == [(240, "b", "c"), (50, "a", "b")]
    assert gaps[0]["host"] == [("aten::nonzero", 235), ("cudaStreamSynchronize", 230), ("cudaLaunchKernel", 4)]
    assert gaps[1]["host"] == [("aten::nonzero", 50), ("cudaStreamSynchronize", 50)]


def _copies(x):
    """Three copies for the profile below: f32 -> bf16, bf16 -> f32 (64 x 32), a transpose made contiguous."""
    y = x.bfloat16().float()
    return y.t().contiguous()


def test_copy_rows_name_each_copy_by_dtypes_shape_and_caller():
    """The release-layer profile's copy table: one row per (source -> destination dtype and shape, caller's
    frame), counted once however the copy was asked for (`.to`, `.contiguous`), its time summed."""
    from torch.profiler import ProfilerActivity, profile

    from engine.profiling import copy_rows, kineto_dtypes

    x = torch.randn(64, 32)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        for _ in range(3):
            _copies(x)
    rows = copy_rows(prof.events(), cuda=False, roots=("tests/", "test_"))  # the frame's path from sys.path
    callers = {r["copy"]: [f.rsplit(":", 1)[1] for f in r["where"].split(" < ")] for r in rows}
    mine = "test_copy_rows_name_each_copy_by_dtypes_shape_and_caller"
    assert callers == {"f32 -> bf16 64x32": ["_copies", mine], "bf16 -> f32 64x32": ["_copies", mine],
                       "f32 -> f32 32x64": ["_copies", mine]}
    assert all(f.split(":")[0].endswith("test_train_init.py") for r in rows for f in r["where"].split(" < "))
    assert all(r["calls"] == 3 and r["us"] > 0 for r in rows)
    assert [r["us"] for r in rows] == sorted((r["us"] for r in rows), reverse=True)
    assert {r["where"] for r in copy_rows(prof.events(), cuda=False)} == {"-"}  # no engine/kernels/benches frame

    # torch before 2.13 records no dtypes on the events: the raw events' stand in, giving the same rows
    copies = [e for e in prof.events() if e.name == "aten::copy_"]
    for e in copies:
        e.input_dtypes = []
    assert copy_rows(prof.events(), cuda=False, roots=("tests/", "test_")) != rows
    assert copy_rows(prof.events(), cuda=False, roots=("tests/", "test_"), dtypes_by_id=kineto_dtypes(prof)) == rows


def test_copy_rows_read_absolute_frame_paths_and_an_ops_own_stack():
    """A frame outside every sys.path entry is named by its absolute path; where the frames are the op's own
    stack rather than its ancestors, they name the caller the same way."""
    from types import SimpleNamespace as Event

    from engine.profiling import copy_rows

    caller = Event(name="/srv/repo/engine/model/attention.py(88): forward", cpu_parent=None, device_type=None)
    op = dict(name="aten::copy_", input_shapes=[[4, 8], [4, 8], []], input_dtypes=["c10::BFloat16", "float", "Scalar"],
              device_type=None)
    by_parent = Event(**op, cpu_parent=caller, id=1, cpu_time_total=5.0, stack=[])
    by_stack = Event(**op, cpu_parent=None, id=2, cpu_time_total=3.0,
                     stack=["/srv/repo/engine/model/attention.py(88): forward", "x.py(1): g"])
    rows = copy_rows([by_parent, by_stack], cuda=False)
    assert rows == [{"copy": "f32 -> bf16 4x8", "where": "engine/model/attention.py:forward", "calls": 2, "us": 8.0}]
