"""The decode step's CUDA graphs (engine/model/graphs.py): the seam they use (Block.forward's `pieces`) on the
CPU; recording, replay, refusal and the engine's decode against its eager loop on a GPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from engine.model.graphs import DecodeGraphs
from engine.roles import FULL, REINDEX, role_plan
from tests.engine_helpers import random_ids, tiny_config, tiny_model

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


class Recorder:
    """A `pieces` that calls each piece as it is and lists (layer, name, the rows of its tensors)."""

    recorded, refused = 0, {}

    def __init__(self):
        self.calls = []

    def __call__(self, layer, name, method, *args):
        self.calls.append((layer, name, [a.shape[0] for a in args if isinstance(a, torch.Tensor)]))
        return method(*args)


def test_blocks_hand_their_cache_free_parts_to_pieces_on_decode_steps_only():
    """Model.run_chunk passes its graphs as Block.forward's `pieces` for one-token chunks without a pipeline
    gate; each layer hands it its parts without caches (mHC and norm before the attention, the query side, the
    window entries, the index queries where the layer picks, the output projection, everything after the
    attention); the outputs are the plain call's, bit for bit, and a prompt chunk never reaches the pieces."""
    cfg = tiny_config()
    ids = random_ids(cfg, 12, seed=3)
    plain, seamed = tiny_model(cfg, seed=1), tiny_model(cfg, seed=1)
    seamed.graphs = rec = Recorder()
    want = torch.cat([plain.forward(ids[:9])] + [plain.forward(ids[i:i + 1]) for i in range(9, 12)])
    got = torch.cat([seamed.forward(ids[:9])] + [seamed.forward(ids[i:i + 1]) for i in range(9, 12)])
    assert torch.equal(got, want)
    per_step = []
    for role in role_plan(cfg)[: cfg.n_layers]:  # every layer's parts in order; the indexer's where it picks
        picks = ["index_queries"] if role.role in (FULL, REINDEX) else []
        per_step += [(role.layer, name) for name in ["mix_in", "queries", "window_entries_0", *picks, "output",
                                                     "ffn_half"]]
    assert [(L, name) for L, name, _ in rec.calls] == per_step * 3  # the three decode steps, not the prompt
    assert all(set(rows) == {1} for _, _, rows in rec.calls)


def test_the_release_bench_decode_loop_steps_the_layers_as_the_engine_does():
    """benches/release_graph.py decode_loop (release_layer.py --decode-loop): after a prefill, one-token steps
    through the chain, each with its pieces; the piecewise run's outputs are the eager run's."""
    from benches.release_graph import decode_loop
    model = tiny_model()
    rec = Recorder()
    got = decode_loop(model, model.cfg, [5], tokens=9, steps=4, device=torch.device("cpu"), graphs=rec)
    assert got["loop_rel_diff"] == 0 and got["loop_steps"] == 4 and got["loop_graphs_s"] > 0
    names = ["mix_in", "queries", "window_entries_0", "index_queries", "output", "ffn_half"]  # layer 5 picks
    assert [(L, name) for L, name, _ in rec.calls] == [(5, name) for name in names] * 4
    assert decode_loop(model, model.cfg, [5], 9, 4, torch.device("cpu")) == {"loop_error": "CUDA graphs need a GPU"}


def test_graphs_only_where_one_process_computes_on_a_gpu_and_no_layer_is_recorded_for_parity():
    """A CPU model has none; a CUDA one (built here without touching CUDA) has them unless turned off, and
    drops them while its ops record a layer's kernel calls (engine/run/parity.py: a replay calls no Python)."""
    from engine.run.api import EngineError, load
    assert tiny_model().graphs is None  # a CPU model: no graphs, Block.forward calls its parts
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs("cpu")
    assert load(device="cuda", kernels=False, decode_graphs=False).model.graphs is None
    with pytest.raises(EngineError, match="decode_graphs must be True or False"):
        load(decode_graphs="yes")
    model = load(device="cuda", kernels=False).model
    first = model.graphs
    assert isinstance(first, DecodeGraphs)
    model.reset()
    assert model.graphs is first  # a reset keeps what was recorded (the pieces hold no cache)
    before = model.ops

    class Recording:  # the parity capture's ops: the same numerics, one layer's calls recorded
        capture_layer = 3

        def __getattr__(self, name):
            return getattr(before, name)

    model.use_ops(Recording())
    assert model.graphs is None
    model.use_ops(before)
    assert isinstance(model.graphs, DecodeGraphs) and model.graphs is not first  # the old ops' recordings dropped


@GPU
def test_a_piece_is_called_then_checked_and_recorded_then_replayed():
    graphs = DecodeGraphs("cuda")
    calls = []

    def piece(x, y, nothing):
        calls.append(x.shape)
        return x * 2 + y.sum(), (x - 1).abs()

    for step in range(5):
        x, y = torch.randn(3, 4, device="cuda"), torch.randn(2, device="cuda")
        got = graphs(0, "p", piece, x, y, None)
        assert all(torch.equal(g, w) for g, w in zip(got, (x * 2 + y.sum(), (x - 1).abs())))
    assert len(calls) == 3  # step 0 called as it is; step 1 checked and recorded (two calls); then replays
    assert graphs.recorded == 1 and graphs.replays == 3 and not graphs.refused
    other = torch.randn(5, 4, device="cuda")  # another shape: a piece of its own, called as it is first
    graphs(0, "p", piece, other, y, None)
    assert len(calls) == 4 and graphs.recorded == 1


@GPU
def test_a_piece_that_reads_the_host_stays_eager_with_its_reason():
    graphs = DecodeGraphs("cuda")

    def piece(x):
        return (x * float(x.max()),)  # a host read of a device value

    for _ in range(4):
        x = torch.rand(8, device="cuda")
        assert torch.equal(graphs(0, "host", piece, x)[0], x * float(x.max()))
    assert graphs.recorded == 0 and graphs.replays == 0
    assert "reads the host" in graphs.refused[(0, "host", (((8,), torch.float32),))]


@GPU
def test_engine_decode_with_graphs_equals_its_eager_loop():
    """The shipped small model on the GPU (its kernel path): a teacher-forced decode of 10 tokens after a
    prompt, with and without graphs: the same logits at every step (the same kernels, replayed), and every
    layer's parts recorded and replayed (none refused)."""
    from engine.run.api import load
    eager, graphed = load(device="cuda", decode_graphs=False), load(device="cuda")
    cfg = eager.cfg
    ids = random_ids(cfg, 40, seed=5).to("cuda")
    steps = []
    for engine in (eager, graphed):
        model, logits = engine.model, []
        with torch.inference_mode():
            model.reset()
            logits.append(model.forward(ids[:30])[-1])
            for i in range(30, 40):
                logits.append(model.forward(ids[i:i + 1])[-1])
        steps.append(torch.stack(logits))
    assert eager.model.graphs is None
    g = graphed.model.graphs
    assert not g.refused, g.refused
    parts = sum(5 + (role.role in (FULL, REINDEX)) for role in role_plan(cfg)[: cfg.n_layers])
    assert g.recorded == parts and g.replays == parts * (10 - 2)
    torch.testing.assert_close(steps[1], steps[0], rtol=0, atol=1e-5)
    assert torch.equal(steps[1].argmax(-1), steps[0].argmax(-1))


def test_the_decode_graphs_bench_runs_its_eager_row_on_the_cpu(capsys, tmp_path):
    """benches/decode_graphs.py on the CPU: the eager row only (graphs need a GPU), the same picks, a table."""
    import json
    from benches import decode_graphs
    assert decode_graphs.main(["--device", "cpu", "--tokens", "6", "--generate", "2", "--repeat", "1",
                               "--out", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    assert "| eager |" in out and "| graphs |" not in out and "graphs need a CUDA device" in out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["mode"] for r in rows] == ["eager"] and len(rows[0]["picks"]) == 2 and rows[0]["tokens_per_s"] > 0
