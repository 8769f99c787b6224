"""Expert + tensor parallel engine (engine/serve/parallel.py): two gloo processes on a written checkpoint give
the single-process probes; each rank reads only its slice of the split weights."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from engine import quant
from engine.checkpoint.reader import CheckpointReader
from engine.serve.parallel import Parallel, ParallelError, ShardedWeights, check_splittable, split_of
from engine.checkpoint.weights import CheckpointWeights, TensorWeights
from tests.engine_helpers import tiny_config, write_tiny_checkpoint
from tests.parallel_workers import reference
from tests.triton_interp import env_without_interpreter

IDS = [0] + [int(v) for v in np.random.default_rng(3).integers(5, 300, 63)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_parallel"), 1, 3)


def workers(checkpoint, out, world: str, *extra: str) -> dict:
    """tests/parallel_workers.py in a fresh process. Without TRITON_INTERPRET (other test modules set it
    in this process): on the CPU the kernel ops then run the kernels' own references, not the
    interpreter (their Triton versions have the interpreter tests of their own)."""
    proc = subprocess.run([sys.executable, "-m", "tests.parallel_workers", str(checkpoint), str(out), world,
                           ",".join(map(str, IDS)), *extra], capture_output=True, text=True, timeout=240,
                          env=env_without_interpreter())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def two_ranks(checkpoint, tmp_path_factory):
    return workers(checkpoint, tmp_path_factory.mktemp("ranks") / "rank0.pt", "2")


@pytest.fixture(scope="module")
def single(checkpoint):
    return reference(str(checkpoint), IDS)


@pytest.fixture(scope="module")
def two_ranks_kernels(checkpoint, tmp_path_factory):
    return workers(checkpoint, tmp_path_factory.mktemp("ranks_kernels") / "rank0.pt", "2", "kernels")


# The caches are stored in FP8/FP4 (and activations FP8-rounded in the release mode), so a last-bit
# difference from the all_reduce's summation order can flip one rounding and move later values by
# ~1e-4; a missing all_reduce or a wrong slice moves them by O(1).
TOL = dict(rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("quantized", [False, True], ids=["float-activations", "fp8-activations"])
def test_two_processes_give_the_single_process_probes(two_ranks, single, quantized):
    assert_same_probes(two_ranks[quantized]["json"], single[quantized]["json"])


def test_two_processes_on_the_kernel_ops(two_ranks_kernels, checkpoint, tmp_path):
    """Each rank runs the kernel ops (on the CPU the kernels' references) on its stored slices: the FP8
    linears on its rows or columns, the MoE kernel on its experts, the index scores of its heads
    all_reduced before the top-k. Not bit-equal to one process: like the official reference's
    row-parallel linear, each rank's wo_b output is bf16 before the all_reduce, and in this random tiny
    model FP8 activation rounding turns that into other picks downstream. So: the same caches, the first
    layers' routing nearly identical, the first selection layer's picks mostly shared (0.89 measured;
    without the index scores' all_reduce 0.68)."""
    assert two_ranks_kernels["ops"] == "TritonOps"
    par = two_ranks_kernels[True]["json"]
    one = workers(checkpoint, tmp_path / "single.pt", "single", "kernels")[True]["json"]
    assert par["token_ids"] == one["token_ids"] and par["cache_bytes"] == one["cache_bytes"]
    overlap = lambda a, b: np.mean([len(set(r) & set(s)) / max(1, len(set(r) | set(s))) for r, s in zip(a, b)])
    for L in ("0", "1"):
        assert overlap(par["layers"][L]["routing"]["experts"], one["layers"][L]["routing"]["experts"]) >= 0.98
    assert overlap(par["layers"]["2"]["topk"], one["layers"]["2"]["topk"]) >= 0.85
    assert torch.isfinite(two_ranks_kernels[True]["logits"]).all()


def test_kernel_ops_on_rank_slices_add_up_to_the_whole(checkpoint):
    """The kernel ops on each rank's stored slices against the same ops on the whole weights, in one
    process: wq_b split by rows (the ranks' outputs concatenate to the whole, bit for bit), wo_b by
    columns (the ranks' bf16 partial outputs add up to the whole within the bf16 rounding of each),
    the routed experts by owned ranges (the ranks' fp32 shares add up to the whole)."""
    from engine.ops import ops_for
    from engine.ops.triton import TritonOps
    cfg = tiny_config()
    g = torch.Generator().manual_seed(5)
    whole = TritonOps(ops_for("fp32"), CheckpointWeights(CheckpointReader(checkpoint, cfg)), "cpu")
    ranks = [TritonOps(ops_for("fp32"), ShardedWeights(CheckpointWeights(CheckpointReader(checkpoint, cfg)),
                                                       Parallel(r, 2), cfg, stored_formats=True), "cpu")
             for r in range(2)]
    run = lambda ops, x, base: ops.linear(x, base, ops.weights, True, lambda v: v).double()
    base = "layers.2.attn.wq_b"
    x = torch.randn(7, CheckpointReader(checkpoint, cfg).entry(base + ".weight").shape[1], generator=g)
    assert torch.equal(torch.cat([run(ops, x, base) for ops in ranks], -1), run(whole, x, base))
    base = "layers.2.attn.wo_b"
    x = torch.randn(7, CheckpointReader(checkpoint, cfg).entry(base + ".weight").shape[1], generator=g)
    parts = [run(ops, x.chunk(2, -1)[r].contiguous(), base) for r, ops in enumerate(ranks)]
    want = run(whole, x, base)
    bound = 2.0 ** -8 * (parts[0].abs() + parts[1].abs() + want.abs()) + 1e-12
    assert ((parts[0] + parts[1] - want).abs() <= bound).all()
    assert ((parts[0] + parts[1] - want).abs() > 0).any()  # the partial rounding is real, and bounded
    layer, n = 3, cfg.experts_of(3)[0]
    x = torch.randn(9, cfg.dim, generator=g)
    experts = torch.stack([torch.randperm(n, generator=g)[: cfg.experts_of(3)[1]] for _ in range(9)])
    weights = torch.rand(experts.shape, generator=g)
    moe = lambda ops, owned: ops.routed_experts(cfg, layer, f"layers.{layer}.ffn.", x, experts, weights, None,
                                                lambda v, _, narrow=False: v.float(), owned).double()
    shares = [moe(ops, ops.weights.parallel.split(n, "routed experts")) for ops in ranks]
    assert sum(ops.calls["moe_fp4"] for ops in ranks) == 2  # the kernel ran on each rank's experts
    torch.testing.assert_close(shares[0] + shares[1], moe(whole, None), rtol=1e-5, atol=1e-6)


def assert_same_probes(par: dict, one: dict) -> None:
    assert par["token_ids"] == one["token_ids"] and par["image_mask"] == one["image_mask"]
    assert set(par["layers"]) == set(one["layers"]) == {str(L) for L in range(8)}
    for L, a in par["layers"].items():
        b = one["layers"][L]
        assert a["topk"] == b["topk"], f"layer {L}: top-k differs"
        assert a["candidate_pool"] == b["candidate_pool"], f"layer {L}: candidate pool differs"
        assert a["n_entries"] == b["n_entries"]
        if a["topk_scores"] is not None:
            sa = torch.tensor([[float("-inf") if v is None else v for v in r] for r in a["topk_scores"]])
            sb = torch.tensor([[float("-inf") if v is None else v for v in r] for r in b["topk_scores"]])
            torch.testing.assert_close(sa, sb, **TOL)
        assert a["routing"]["experts"] == b["routing"]["experts"], f"layer {L}: routing differs"
        for key in ("weights", "scores"):
            torch.testing.assert_close(torch.tensor(a["routing"][key]), torch.tensor(b["routing"][key]), **TOL)
        for part in ("attn", "ffn"):
            for key in ("pre", "post", "comb"):
                torch.testing.assert_close(torch.tensor(a["mhc"][part][key]), torch.tensor(b["mhc"][part][key]),
                                           **TOL)
        torch.testing.assert_close(torch.tensor(a["residual_norms"]), torch.tensor(b["residual_norms"]), rtol=1e-3,
                                   atol=0)
    assert par["cache_bytes"] == one["cache_bytes"]
    # decode steps after the prefill (greedy) agree too
    assert par["generated_ids"] == one["generated_ids"] and len(par["generated_ids"]) == 3


@pytest.mark.parametrize("quantized", [False, True], ids=["float-activations", "fp8-activations"])
def test_two_processes_give_the_single_process_logits(two_ranks, single, quantized):
    a, b = two_ranks[quantized]["logits"], single[quantized]["logits"]
    assert a.shape == b.shape == (len(IDS), 300)  # the gathered head covers the whole vocabulary
    torch.testing.assert_close(a, b, rtol=0, atol=5e-3)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_each_rank_reads_half_of_the_split_weights(two_ranks, checkpoint):
    """dim-0 splits read only their rows; wo_b (split by columns) and the sinks are read whole."""
    reader = CheckpointReader(checkpoint)
    rows_split = column_split = 0
    for name in reader.names():
        split = split_of(name)
        if split is None or name.startswith("mtp."):
            continue
        e = reader.entry(name)
        if split.dim == 0 and len(e.shape) == 2:
            rows_split += e.nbytes // 2
        else:
            column_split += e.nbytes
    assert two_ranks["bytes_read"] == [rows_split + column_split] * 2


def test_sharded_slices_match_the_full_weights(checkpoint):
    cfg = tiny_config()
    full = CheckpointWeights(CheckpointReader(checkpoint, cfg))
    names = ["embed.weight", "head.weight", "layers.2.attn.wq_b.weight", "layers.2.attn.attn_sink",
             "layers.2.attn.wo_a.weight", "layers.2.attn.wo_b.weight", "layers.2.attn.indexer.wq_b.weight",
             "layers.7.attn.indexer.weights_proj.weight"]
    for rank in range(2):
        mine = ShardedWeights(CheckpointWeights(CheckpointReader(checkpoint, cfg)), Parallel(rank, 2), cfg)
        in_memory = ShardedWeights(TensorWeights({n: full.get(n) for n in names}), Parallel(rank, 2), cfg)
        for name in names:
            whole = full.get(name)
            dim = split_of(name).dim
            part = whole.shape[dim] // 2
            expected = whole.narrow(dim, rank * part, part)
            assert torch.equal(mine.get(name), expected), name
            assert torch.equal(in_memory.get(name), expected), name
        assert torch.equal(mine.get("layers.2.attn.wq_a.weight"), full.get("layers.2.attn.wq_a.weight"))
        theirs = 4 if rank == 0 else 0
        with pytest.raises(KeyError, match=f"rank {rank} holds routed experts"):
            mine.get(f"layers.3.ffn.experts.{theirs}.w1.weight")
        mine.get(f"layers.3.ffn.experts.{4 - theirs}.w2.weight")  # its own: fine


def test_a_model_that_does_not_split_says_which_count():
    with pytest.raises(ParallelError, match="n_heads=4, o_groups=2, index_n_heads=2, n_routed_experts=8 not divisible by 3"):
        check_splittable(tiny_config(), 3)
    check_splittable(tiny_config(), 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without a GPU")
def test_ranks_sharing_gpus_without_one_say_so(monkeypatch):
    """--share-gpus (several ranks on one GPU, gloo collectives) on a machine without a GPU fails with a
    sentence before joining any group; NCCL is refused for it by name."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ParallelError, match="needs a GPU; none is visible"):
        Parallel.from_env(share_gpus=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ParallelError, match="through gloo, not nccl"):
        Parallel.from_env("nccl", share_gpus=True)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("kernels", ["auto", "on"])
def test_bench_smoke_runs_the_multi_gpu_script_on_two_cpu_processes(tmp_path, kernels):
    """benches/parallel.py --smoke: generated release-format shards, all layers timed, memory per rank,
    and click-to-view through the service, on 2 gloo processes; `--kernels on`: each rank's kernel ops
    on its stored shard (the kernels' references on the CPU)."""
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "benches/parallel.py", "--smoke", "--kernels", kernels, "--out", str(out)],
                          capture_output=True, text=True, timeout=240, env=env_without_interpreter())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = __import__("json").loads(out.read_text())
    assert report["ops"] == ("TritonOps" if kernels == "on" else "ReferenceOps")
    assert report["world"] == 2 and report["tokens"] == 96 and report["json_layers"] == 8
    assert [row["layer"] for row in report["layers"]] == list(range(8))
    assert all(row["time_s"] > 0 and row["roofline_fp8_s"] > 0 for row in report["layers"])
    assert [m["rank"] for m in report["memory"]] == [0, 1]
    # each rank holds half the routed experts and split weights, all replicated ones
    assert 0 < report["memory"][0]["resident_weights_bytes"] == report["memory"][1]["resident_weights_bytes"]
    views = report["click_to_view"]
    assert views["run_all_layers_s"] >= views["engine_run_s"] > 0
    clicks = views["clicks"]
    assert [v["layer"] for v in clicks] == [7, 6] and clicks[1]["layers_fetched"] == [5, 6]
    assert all(v["view_s"] >= v["answer_s"] > 0 and v["json_mb"] > 0 for v in clicks)


def test_sharded_stored_slices_are_the_stored_bytes_cut_on_scale_blocks(checkpoint):
    """The kernel path's view of a rank's shard: FP8 rows (wq_b) or columns (wo_b) with their 32 x 32
    scale blocks, cut from the stored bytes; a split that would cut a scale block (the tiny indexer's
    one weights_proj row per rank) has none, and its float value comes from the float path; with
    stored_formats the float value of an FP8 weight is made from the slice per call, not kept."""
    from engine.ops.triton import KernelPathError, decide
    cfg = tiny_config()
    reader = CheckpointReader(checkpoint, cfg)
    for rank in range(2):
        mine = ShardedWeights(CheckpointWeights(CheckpointReader(checkpoint, cfg)), Parallel(rank, 2), cfg,
                              stored_formats=True)
        float_path = ShardedWeights(CheckpointWeights(CheckpointReader(checkpoint, cfg)), Parallel(rank, 2), cfg)
        for base, dim in (("layers.2.attn.wq_b", 0), ("layers.2.attn.wo_b", 1), ("layers.2.attn.wo_a", 0)):
            w, s = reader.tensor(base + ".weight"), reader.tensor(base + ".scale")
            assert w.dtype == torch.float8_e4m3fn
            part = w.shape[dim] // 2
            want_w = w.narrow(dim, rank * part, part)
            want_s = s.narrow(dim, rank * part // 32, part // 32)
            got_w, got_s = mine.stored(base + ".weight"), mine.stored(base + ".scale")
            assert torch.equal(got_w.view(torch.uint8), want_w.contiguous().view(torch.uint8)), base
            assert torch.equal(got_s.view(torch.uint8), want_s.contiguous().view(torch.uint8)), base
            value = mine.get(base + ".weight")
            assert torch.equal(value, float_path.get(base + ".weight")), base
            assert mine.get(base + ".weight") is not value  # made per call, not kept
            assert float_path.get(base + ".weight") is float_path.get(base + ".weight")  # kept
        proj = "layers.7.attn.indexer.weights_proj.weight"  # BF16, split by index heads: a plain row cut
        assert torch.equal(mine.stored(proj), reader.tensor(proj)[rank:rank + 1])
        assert torch.equal(mine.get(proj), float_path.get(proj))
        # an FP8 weight whose split cuts its scale blocks (16 of 32 rows each) has no stored slice
        from types import SimpleNamespace
        from engine.ops.stored import TensorReader
        wq, ws = quant.quantize_fp8_weight(torch.randn(32, 64), 32)
        odd = TensorReader({"layers.0.attn.wq_b.weight": wq, "layers.0.attn.wq_b.scale": ws})
        cut = ShardedWeights(SimpleNamespace(reader=odd), Parallel(rank, 2), cfg, stored_formats=True)
        assert cut.stored("layers.0.attn.wq_b.weight") is None and cut.stored("layers.0.attn.wq_b.scale") is None
        theirs = 4 if rank == 0 else 0
        with pytest.raises(KeyError, match=f"rank {rank} holds routed experts"):
            mine.stored(f"layers.3.ffn.experts.{theirs}.w1.weight")
        assert mine.stored(f"layers.3.ffn.experts.{4 - theirs}.w1.weight").dtype == torch.int8
        assert decide(True, mine, "cpu", mine.parallel)
    with pytest.raises(KernelPathError, match="must be a ShardedWeights"):
        decide(True, CheckpointWeights(reader), "cpu", Parallel(0, 2))
    assert not decide(None, CheckpointWeights(reader), "cuda", Parallel(0, 2))


def test_load_gives_a_rank_the_stored_formats_when_the_kernels_run(checkpoint):
    """engine.run.api.load(parallel=...) resolves the kernel ops by the model's own rule and serves the
    rank's ShardedWeights in the stored formats for them; without the kernels, the cached float path."""
    from engine.run.api import load
    on = load(checkpoint, parallel=Parallel(1, 2), kernels=True)
    assert type(on.model.ops).__name__ == "TritonOps" and on.model.weights.stored_formats
    off = load(checkpoint, parallel=Parallel(1, 2))
    assert type(off.model.ops).__name__ != "TritonOps" and not off.model.weights.stored_formats
