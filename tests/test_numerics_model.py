"""The numerics choice through the model and the API: what `reference` stores is bf16, what
`fp32` stores is not; the run says which ran; logits on request."""

from __future__ import annotations

import json

import pytest
import torch

from engine.run.api import Engine, EngineError
from engine.model.transformer import Model
from engine.run.probes import ProbeRequest
from engine.ops.reference import to_bf16
from engine.checkpoint.weights import TensorWeights, random_weights
from tests.engine_helpers import IdentityTokenizer, random_ids, tiny_config


def _model(numerics: str) -> Model:
    cfg = tiny_config()
    return Model(cfg, TensorWeights(random_weights(cfg, 0)), IdentityTokenizer(cfg.engram_compressed_vocab_size),
                 numerics=numerics)


def _is_bf16(t: torch.Tensor) -> bool:
    return torch.equal(to_bf16(t), t)


def _run(model: Model, T: int = 40):
    collect = {}
    with torch.inference_mode():
        model.reset()
        logits = model.forward(random_ids(model.cfg, T), probes=ProbeRequest(), collect=collect)
    return logits, collect


def test_reference_stores_bf16_where_the_reference_does():
    model = _model("reference")
    assert model.numerics == "reference"
    logits, collect = _run(model)
    for attn in model.attn:
        assert _is_bf16(attn.window.values)            # FP8 (and FP4) values are bf16-exact in both numerics
    # index scores are bf16 tensors in the reference: the picks' scores are bf16 values
    scores = collect[2]["topk_scores"]
    assert _is_bf16(scores[torch.isfinite(scores)])
    fp_model = _model("fp32")
    fp_logits, fp_collect = _run(fp_model)
    fp_scores = fp_collect[2]["topk_scores"]
    assert not _is_bf16(fp_scores[torch.isfinite(fp_scores)])
    # the same model and mechanisms: bf16-level noise (a random tiny model amplifies it: a 4e-6
    # relative nudge of every activation moves its logits by ~6%), not a different computation
    rel = (logits - fp_logits).norm() / fp_logits.norm()
    assert 0 < rel < 0.5, rel
    agree = (collect[5]["routing"]["experts"].sort(-1).values == fp_collect[5]["routing"]["experts"].sort(-1).values)
    assert agree.float().mean() > 0.8


def test_reference_probes_mark_ties_at_the_kth_score():
    _, collect = _run(_model("reference"), T=60)
    for L in (2, 5, 7):
        top, scores, kth, tied = (collect[L][k] for k in ("topk", "topk_scores", "topk_kth", "topk_tied"))
        assert tied.shape == top.shape and kth.shape == top.shape[:1]
        full = (top >= 0).all(-1)
        # a row of k picks: the k-th score is its lowest pick; tied picks sit at that score
        assert torch.equal(kth[full], scores[full].min(-1).values)
        assert (scores[tied] == kth[:, None].expand_as(scores)[tied]).all()
        assert not tied[~full & torch.isfinite(kth)].any()


def test_engine_says_which_numerics_ran_and_returns_logits_on_request():
    cfg = tiny_config()
    weights = TensorWeights(random_weights(cfg, 1))
    tok = IdentityTokenizer(cfg.engram_compressed_vocab_size)
    engine = Engine(cfg, weights, tok, threads=1)
    assert engine.numerics == "reference"
    ids = random_ids(cfg, 20).tolist()
    result = engine.run(ids, logits=True)
    assert result.numerics == "reference" and json.loads(json.dumps(result.to_json()))["numerics"] == "reference"
    assert result.logits.shape == (20, cfg.vocab_size) and result.logits.dtype == torch.float32
    assert engine.run(ids).logits is None
    fp = Engine(cfg, weights, tok, threads=1, numerics="fp32").run(ids, logits=True)
    assert fp.numerics == "fp32" and not torch.equal(fp.logits, result.logits)
    with pytest.raises(EngineError, match="unknown numerics 'bf8'; choose one of reference, fp32"):
        Engine(cfg, weights, tok, numerics="bf8")


def test_cli_says_which_numerics_ran(tmp_path):
    import subprocess
    import sys

    from tests.engine_helpers import write_tiny_checkpoint
    ckpt = write_tiny_checkpoint(tmp_path / "tiny", 0, 1, engram_layer_ids=(), engram_num_embeddings=())
    # the three commands started together (each is mostly torch's import; this process only waits)
    commands = {numerics: ["run", "--checkpoint", str(ckpt), "--ids", "5,6,7,8", "--json",
                           str(tmp_path / f"run-{numerics}.json"), *(["--numerics", numerics] if numerics else [])]
                for numerics in ("fp32", None)}
    commands["bf7"] = ["run", "--checkpoint", str(ckpt), "--ids", "5", "--numerics", "bf7"]
    procs = {key: subprocess.Popen([sys.executable, "-m", "engine", *args], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for key, args in commands.items()}
    done = {}
    try:
        for key, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            done[key] = (proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for numerics in ("fp32", None):
        code, stdout, stderr = done[numerics]
        assert code == 0, stderr
        said = numerics or "reference"
        assert f"{said} numerics" in stdout
        assert json.loads((tmp_path / f"run-{numerics}.json").read_text())["numerics"] == said
    code, _, stderr = done["bf7"]
    assert code != 0 and "invalid choice: 'bf7'" in stderr and "Traceback" not in stderr


def test_reference_wavefront_differs_from_one_chunk_only_in_tied_picks():
    """Under reference numerics a tie is torch's topk's choice over the row (the first chunk's rows
    are shorter), so the first picking layer may take other tied entries; everything it did not
    take by chance agrees. (Later layers then see other inputs: bf16 flows are chaotic.)"""
    from engine.run import pipeline
    cfg = tiny_config()
    weights = TensorWeights(random_weights(cfg, 0))
    ids = random_ids(cfg, pipeline.MIN_TOKENS).tolist()
    two = Engine(cfg, weights, IdentityTokenizer(300), threads=2).run(ids, layers=[2])
    one = Engine(cfg, weights, IdentityTokenizer(300), threads=1).run(ids, layers=[2])
    assert not torch.equal(two.layers[2].topk, one.layers[2].topk)  # this prompt does meet ties
    for L in (2,):
        a, b = two.layers[L], one.layers[L]
        assert torch.equal(a.topk_kth, b.topk_kth)
        same = (a.topk == b.topk).all(-1)
        # a row that differs had ties at its k-th score in both runs; its untied picks agree
        assert (a.topk_tied.any(-1) | same).all() and (b.topk_tied.any(-1) | same).all()
        for t in (~same).nonzero().flatten().tolist():
            sure_a = set(a.topk[t][~a.topk_tied[t]].tolist())
            assert sure_a == set(b.topk[t][~b.topk_tied[t]].tolist()), (L, t)


def test_reindex_pool_case_per_numerics():
    """A Reindex layer whose candidate pool holds fewer than index_topk visible entries: fp32 pads
    with -1 (picks inside the pool only); reference lets torch's topk take any entries tied at -inf
    (visible ones outside the pool are attended, not yet visible ones read -1), as the reference
    does, and marks those picks tied."""
    cfg = tiny_config(index_topk=8)  # pool: 2 blocks of 4 <= k, so a pool short of 8 is common
    weights = TensorWeights(random_weights(cfg, 0))
    tok = IdentityTokenizer(cfg.engram_compressed_vocab_size)
    ids = random_ids(cfg, 40)
    seen_top_up = False
    for numerics in ("fp32", "reference"):
        model = Model(cfg, weights, tok, numerics=numerics)
        collect = {}
        with torch.inference_mode():
            model.forward(ids, probes=ProbeRequest(layers={7}), collect=collect)
        pool, top, scores = (collect[7][k] for k in ("candidate_pool", "topk", "topk_scores"))
        for t in range(40):
            sel = top[t][top[t] >= 0]
            inside = pool[t, sel]
            n_pool = int(pool[t].sum())
            assert int(inside.sum()) == min(n_pool, cfg.index_topk)
            if numerics == "fp32":
                assert inside.all()
            else:  # which -inf entries fill the rest is topk's choice (not yet visible ones read -1)
                outside = (top[t] >= 0).clone()
                outside[top[t] >= 0] = ~inside
                assert torch.isneginf(scores[t][outside]).all()
                assert collect[7]["topk_tied"][t][outside].all()
                seen_top_up |= bool(outside.any())
    assert seen_top_up
