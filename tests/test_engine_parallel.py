"""Expert + tensor parallel engine (engine/serve/parallel.py): two gloo processes on a written checkpoint give
the single-process probes; each rank reads only its slice of the split weights."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from engine.checkpoint.reader import CheckpointReader
from engine.serve.parallel import Parallel, ParallelError, ShardedWeights, check_splittable, split_of
from engine.checkpoint.weights import CheckpointWeights, TensorWeights
from tests.engine_helpers import tiny_config, write_tiny_checkpoint
from tests.parallel_workers import reference

IDS = [0] + [int(v) for v in np.random.default_rng(3).integers(5, 300, 63)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_parallel"), 1, 3)


@pytest.fixture(scope="module")
def two_ranks(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks") / "rank0.pt"
    proc = subprocess.run([sys.executable, "-m", "tests.parallel_workers", str(checkpoint), str(out), "2",
                           ",".join(map(str, IDS))], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def single(checkpoint):
    return reference(str(checkpoint), IDS)


# The caches are stored in FP8/FP4 (and activations FP8-rounded in the release mode), so a last-bit
# difference from the all_reduce's summation order can flip one rounding and move later values by
# ~1e-4; a missing all_reduce or a wrong slice moves them by O(1).
TOL = dict(rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("quantized", [False, True], ids=["float-activations", "fp8-activations"])
def test_two_processes_give_the_single_process_probes(two_ranks, single, quantized):
    par, one = two_ranks[quantized]["json"], single[quantized]["json"]
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


def test_bench_smoke_runs_the_multi_gpu_script_on_two_cpu_processes(tmp_path):
    """benches/parallel.py --smoke: generated release-format shards, all layers timed, memory per rank,
    and click-to-view through the service, on 2 gloo processes."""
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "benches/parallel.py", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = __import__("json").loads(out.read_text())
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
