"""prefill="ced" (engine/run/ced.py): the encoder and layer 5's compressor over the whole prompt, the
decoder (layers 5-7 of the tiny plan, window 8) over the last R prompt tokens only.

The reference for R < T is the receptive field: a decoder state at prompt position p depends on the
decoder's states at p-W+1..p one layer down (its window), and otherwise only on the encoder's output
and layer 5's global KV, which a CED prefill computes for every position. So the j-th decoder layer's
state at p is the full prefill's whenever p - (T - R) >= (j + 1)(W - 1), and earlier rows differ.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.run import api, pipeline
from engine.model import attention
from engine.run.api import Engine, EngineError
from engine.roles import decoder_start
from engine.checkpoint.weights import TensorWeights, random_weights
from tests.engine_helpers import IdentityTokenizer, random_ids, tiny_config, write_tiny_checkpoint

CFG = tiny_config()
SPLIT = decoder_start(CFG)            # 5
DEPTH = CFG.n_layers - SPLIT          # 3 decoder layers
W = CFG.window_size                   # 8
T = 40


def _engine(threads=1, numerics="fp32", cfg=CFG):
    """fp32 numerics: the receptive-field equalities below hold to float32 summation order."""
    return Engine(cfg, TensorWeights(random_weights(cfg, 0)), IdentityTokenizer(cfg.engram_compressed_vocab_size),
                  threads=threads, numerics=numerics)


@pytest.fixture(scope="module")
def engine():
    return _engine()


@pytest.fixture(scope="module")
def ids():
    return random_ids(CFG, T, seed=3).tolist()


def _logits(engine, ids, **kw):
    """The last prompt token's logits and the model after the prefill (teacher-forced, no decode)."""
    with torch.inference_mode():
        engine.model.reset()
        replay = kw.get("replay")
        start = None if replay is None or replay >= len(ids) else len(ids) - replay
        logits = engine.model.forward(torch.tensor(ids), decoder_from=start)
    return logits[-1]


@pytest.mark.parametrize("numerics", ["fp32", "reference"])
def test_ced_with_replay_covering_the_prompt_is_the_full_prefill(ids, numerics):
    engine = _engine(numerics=numerics)
    full = engine.run(ids, generate=4, generated_probes=True, logits=True)
    for replay in (T, T + 50):
        ced = engine.run(ids, generate=4, generated_probes=True, prefill="ced", replay=replay, logits=True)
        assert (ced.prefill, ced.replay, full.prefill, full.replay) == ("ced", replay, "full", None)
        torch.testing.assert_close(ced.logits, full.logits, rtol=0, atol=1e-6)
        assert ced.generated_ids == full.generated_ids
        for L in range(CFG.n_layers):
            a, b = full.layers[L], ced.layers[L]
            assert b.first_position == 0 and b.routing["experts"].shape[0] == T
            assert torch.equal(a.routing["experts"], b.routing["experts"])
            torch.testing.assert_close(a.routing["scores"], b.routing["scores"], rtol=0, atol=1e-6)
            if a.topk is not None:
                assert torch.equal(a.topk, b.topk)
            g, h = full.generated_layers[L], ced.generated_layers[L]
            assert torch.equal(g.routing["experts"], h.routing["experts"])


def test_decoder_states_match_full_exactly_where_the_replay_holds_their_receptive_field(engine, ids):
    replay = DEPTH * (W - 1) + 1  # 22: the last prompt token's whole receptive field
    full = engine.run(ids)
    ced = engine.run(ids, prefill="ced", replay=replay)
    skip = T - replay
    for L in range(SPLIT):  # the encoder is untouched
        assert torch.equal(full.layers[L].routing["experts"], ced.layers[L].routing["experts"])
        assert ced.layers[L].first_position == 0
    differing = 0
    for j, L in enumerate(range(SPLIT, CFG.n_layers)):
        a, b = full.layers[L], ced.layers[L]
        assert b.first_position == skip and b.routing["experts"].shape[0] == replay
        exact_from = (j + 1) * (W - 1)
        scores_full, scores_ced = a.routing["scores"][skip:], b.routing["scores"]
        torch.testing.assert_close(scores_ced[exact_from:], scores_full[exact_from:], rtol=1e-4, atol=1e-5)
        assert torch.equal(b.topk[exact_from:], a.topk[skip:][exact_from:])
        differing += int(((scores_ced[:exact_from] - scores_full[:exact_from]).abs().amax(-1) > 1e-4).sum())
    assert differing > 0  # the rows without their receptive field do differ
    torch.testing.assert_close(_logits(engine, ids, replay=replay), _logits(engine, ids), rtol=1e-4, atol=1e-5)
    # one token short of the receptive field, or a window-sized replay: the last logits move
    assert (_logits(engine, ids, replay=W) - _logits(engine, ids)).abs().max() > 1e-3


def test_layer_5_publishes_global_kv_for_every_prompt_position(engine, ids):
    _logits(engine, ids)
    full_kv = engine.model.attn[SPLIT].source.kv_values.clone()
    full_ik = engine.model.attn[SPLIT].source.ik_values.clone()
    _logits(engine, ids, replay=W)
    src = engine.model.attn[SPLIT].source
    assert src.n_entries == T
    torch.testing.assert_close(src.kv_values, full_kv, rtol=0, atol=1e-5)
    torch.testing.assert_close(src.ik_values, full_ik, rtol=0, atol=1e-5)
    # the decoder's windows hold only replayed positions' latents: W of them here
    assert all(engine.model.attn[L].window.values.shape[0] == W for L in range(SPLIT, CFG.n_layers))


@pytest.mark.parametrize("wavefront", [False, True])
def test_ced_never_runs_decoder_layers_on_the_first_T_minus_R_positions(monkeypatch, ids, wavefront):
    eng = _engine(threads=2 if wavefront else 1)
    if wavefront:
        monkeypatch.setattr(pipeline, "MIN_TOKENS", 16)  # the two-thread prefill at this length
    attended: dict[int, list[int]] = {}
    published: list[int] = []
    forward, publish = attention.Attention.forward, attention.Attention.publish

    def counting_forward(self, x, positions, shared, probe, *pieces):
        attended.setdefault(self.role.layer, []).extend(positions.tolist())
        return forward(self, x, positions, shared, probe, *pieces)

    def counting_publish(self, x, positions):
        published.extend(positions.tolist())
        return publish(self, x, positions)

    monkeypatch.setattr(attention.Attention, "forward", counting_forward)
    monkeypatch.setattr(attention.Attention, "publish", counting_publish)
    replay = 12
    result = eng.run(ids, prefill="ced", replay=replay)
    for L in range(CFG.n_layers):
        expected = list(range(T)) if L < SPLIT else list(range(T - replay, T))
        assert sorted(attended[L]) == expected, L
        probe = result.layers[L]
        rows = probe.routing["experts"].shape[0]
        assert rows == len(expected) and probe.first_position == expected[0]
        assert probe.mhc["ffn"]["pre"].shape[0] == rows and probe.residual_norms.shape[0] == rows
    assert sorted(published) == list(range(T - replay))  # layer 5's compressor over the rest
    if wavefront:  # the same as the one-thread CED prefill
        one = _engine(threads=1)
        again = one.run(ids, prefill="ced", replay=replay)
        for L in range(CFG.n_layers):
            assert torch.equal(again.layers[L].routing["experts"], result.layers[L].routing["experts"])


def test_decode_after_ced_continues_from_the_replay(engine, ids):
    steps = 4
    full = engine.run(ids, generate=steps, generated_probes=True)
    # a replay holding the receptive field of the first `steps` decoded tokens: they are full's
    covering = (DEPTH + steps) * (W - 1) + 1
    ced = engine.run(ids[:T] + ids[:20], generate=steps, generated_probes=True, prefill="ced", replay=covering)
    ref = engine.run(ids[:T] + ids[:20], generate=steps, generated_probes=True)
    assert ced.generated_ids == ref.generated_ids
    for L in range(CFG.n_layers):
        assert ced.generated_layers[L].first_position == T + 20
        torch.testing.assert_close(ced.generated_layers[L].routing["scores"], ref.generated_layers[L].routing["scores"],
                                   rtol=1e-4, atol=1e-5)
    assert engine.model.pos == T + 20 + steps
    assert engine.model.attn[SPLIT].source.n_entries == T + 20 + steps
    # a short replay: the decode runs on, teacher-forced on full's tokens, with its windows full
    short = engine.run(ids, prefill="ced", replay=3, continuation=full.generated_ids, generated_probes=True)
    assert len(short.generated_ids) == steps
    assert short.generated_layers[SPLIT].routing["experts"].shape[0] == steps
    assert all(engine.model.attn[L].window.values.shape[0] == 3 + steps for L in range(SPLIT, CFG.n_layers))
    json.dumps(short.to_json())


def test_a_replay_shorter_than_the_window_attends_only_to_replayed_keys(engine, ids, monkeypatch):
    """R=3 < W: the i-th replayed token's window holds i+1 latents (the replay's), the first decode
    step's 4; checked against a float64 softmax over exactly those keys, the picks and the sink."""
    calls = []
    ops = type(engine.model.ops)  # engine/ops: the attention's numerics (fp32 here)
    attend = ops.attend
    layer_attends = []

    def capture(self, q, rows, windows, sink, idx, global_kv, window, scale):
        out = attend(self, q, rows, windows, sink, idx, global_kv, window, scale)
        if layer_attends[-1] == SPLIT + 1:
            calls.append((q * scale, windows, sink, idx, global_kv, out[0]))
        return out

    forward = attention.Attention.forward

    def tracking_forward(self, *args):
        layer_attends.append(self.role.layer)
        return forward(self, *args)

    monkeypatch.setattr(attention.Attention, "forward", tracking_forward)
    monkeypatch.setattr(ops, "attend", capture)
    engine.run(ids, prefill="ced", replay=3, generate=1, continuation=[7])
    (q, windows, sink, (rows, padding), kv, out), (q1, windows1, sink1, (rows1, pad1), kv1, out1) = calls
    for q, windows, sink, rows, padding, kv, out, n_keys in ((q, windows, sink, rows, padding, kv, out, [1, 2, 3]),
                                                               (q1, windows1, sink1, rows1, pad1, kv1, out1, [4])):
        for b, n in enumerate(n_keys):
            keys = windows[b, :, W - n:].double()                    # [D, n]: the replayed latents only
            picks = kv[rows[b][~padding[b]]].double()                # [k', D]
            logits = torch.cat([q[b].double() @ keys, q[b].double() @ picks.t(), sink.double()[:, None]], -1)
            p = torch.softmax(logits, -1)
            ref = p[:, :n] @ keys.t() + p[:, n:n + picks.shape[0]] @ picks
            torch.testing.assert_close(out[b].double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw, message", [
    (dict(prefill="half"), "prefill must be one of"),
    (dict(prefill="ced", replay=0), "replay must be a whole number"),
    (dict(prefill="ced", replay=2.5), "replay must be a whole number"),
    (dict(replay=8), "replay applies only to prefill='ced'"),
    (dict(generate=3, continuation=[5, 6]), "continuation has 2 tokens"),
])
def test_bad_prefill_requests_are_clear_errors(engine, ids, kw, message):
    with pytest.raises(EngineError, match=message):
        engine.run(ids, **kw)


def test_a_model_without_a_decoder_half_refuses_ced():
    cfg = tiny_config(compress_ratios=(0, 0, 2, 2, 2, 2, 2, 2, 0), kv_source_layers=(2, 5),
                      index_source_layers=(2, 5, 7), candidate_source_layer=5)
    eng = _engine(cfg=cfg)
    with pytest.raises(EngineError, match="no decoder half"):
        eng.run([0, 5, 6, 7], prefill="ced")


def test_cli_run_prefill_ced_says_so_in_the_json(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "tiny", 0, 1, engram_layer_ids=(), engram_num_embeddings=())
    out = tmp_path / "run.json"
    ids = ",".join(str(i) for i in [0] + list(range(10, 40)))
    proc = subprocess.run([sys.executable, "-m", "engine", "run", "--checkpoint", str(ckpt), "--ids", ids,
                           "--prefill", "ced", "--replay", "9", "--layer", "2", "--layer", "6", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "prefill: ced, the decoder over the last 9 prompt tokens" in proc.stdout
    data = json.loads(out.read_text())
    assert (data["prefill"], data["replay"]) == ("ced", 9)
    assert data["layers"]["6"]["first_position"] == 22 and len(data["layers"]["6"]["routing"]["experts"]) == 9
    assert len(data["layers"]["2"]["routing"]["experts"]) == 31
    bad = subprocess.run([sys.executable, "-m", "engine", "run", "--checkpoint", str(ckpt), "--ids", ids,
                          "--prefill", "ced", "--replay", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "replay must be" in bad.stderr and "Traceback" not in bad.stderr



def test_the_kernel_paths_window_rows_mask_the_replays_missing_keys(tmp_path, monkeypatch):
    """The H200 runs sparse attention as a kernel fed the window's FP8 bytes and per-query key rows.
    Captured at a decoder layer during a CED prefill (R=10 of 16, and the decode step after it), the
    kernel's PyTorch reference on those operands gives the engine's attention output to bf16 (its
    query precision): the rows before the replay are empty slots there too."""
    from engine.ops.triton import TritonOps
    from engine.checkpoint.reader import CheckpointReader
    from engine.checkpoint.writer import write_checkpoint
    from engine.model.transformer import Model
    from engine.checkpoint.weights import CheckpointWeights
    from kernels import dispatch

    write_checkpoint(CFG, tmp_path / "ckpt", random_weights(CFG, 0))
    weights = CheckpointWeights(CheckpointReader(tmp_path / "ckpt", CFG))
    model = Model(CFG, weights, IdentityTokenizer(CFG.engram_compressed_vocab_size), kernels=False, numerics="fp32")
    layer = SPLIT + 1
    capture = TritonOps(model.ops, weights, "cpu", compute=False, capture_layer=layer)
    model.use_ops(capture)
    outputs, attend, current = [], type(model.ops.base).attend, []
    forward = attention.Attention.forward

    def tracking_forward(self, *args):
        current.append(self.role.layer)
        return forward(self, *args)

    def capture_attend(self, *args):
        out = attend(self, *args)
        if current[-1] == layer:
            outputs.append(out[0])
        return out

    monkeypatch.setattr(attention.Attention, "forward", tracking_forward)
    monkeypatch.setattr(type(model.ops.base), "attend", capture_attend)
    ids = random_ids(CFG, 16, seed=3)
    with torch.inference_mode():
        model.forward(ids, decoder_from=6)
        model.forward(ids[:1])
    calls = [args for kernel, _, args, _ in capture.captured if kernel == "sparse_attn"]
    assert len(calls) == 2 == len(outputs) and outputs[0].shape[0] == 10 and outputs[1].shape[0] == 1
    first_rows = calls[0][6]  # [10, W] key rows of the replay's queries: query i sees i + 1 keys
    assert [int((row >= 0).sum()) for row in first_rows] == [min(i + 1, W) for i in range(10)]
    assert bool((calls[1][6] >= 0).all())  # the decode step after it: a whole window of replayed keys
    for args, engine_out in zip(calls, outputs):
        kernel_out = dispatch._PAIRS["sparse_attn"][0](*args)[:, :CFG.n_heads].float()
        rel = (kernel_out - engine_out).norm() / engine_out.norm()
        assert rel < 1e-2, rel
