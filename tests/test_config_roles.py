"""ModelConfig reading/validation and the CSA2 role plan derived from the config's lists."""

from __future__ import annotations

import json

import pytest

from engine.checkpoint.writer import config_json
from engine.config import ConfigError, ModelConfig, config_from_dict, load_config, release_config
from engine.roles import cache_graph, decoder_start, layers_by_tab, role_plan

RELEASE = "assets/configs/v41-flash.json"


def _flat() -> dict:
    return json.load(open(RELEASE))


def test_flat_and_hf_forms_give_the_same_config(tmp_path):
    flat = load_config(RELEASE)
    assert flat == ModelConfig()  # the dataclass defaults are the release
    root = tmp_path / "config.json"
    root.write_text(json.dumps(config_json(flat)))
    assert "text_config" in json.loads(root.read_text())
    assert load_config(tmp_path) == flat


@pytest.mark.parametrize("change, key, reason", [
    (lambda d: d.pop("dim"), "dim", "missing"),
    (lambda d: d.update(dim="5120"), "dim", "must be an integer"),
    (lambda d: d.update(kv_source_layers="2,8"), "kv_source_layers", "list of integers"),
    (lambda d: d.update(norm_eps="tiny"), "norm_eps", "must be a number"),
    (lambda d: d.update(kv_source_layers=[0, 8, 14, 20], index_source_layers=[0, 8, 14, 20]),
     "kv_source_layers", "compress ratio 0"),
    (lambda d: d.update(index_source_layers=[2, 8, 20, 24]), "index_source_layers", "not a superset"),
    (lambda d: d.update(o_groups=7), "n_heads", "not divisible by o_groups"),
    (lambda d: d.update(compress_ratios=d["compress_ratios"][:-1]), "compress_ratios", "entries"),
    (lambda d: d.update(kv_source_layers=[8, 14, 20], index_source_layers=[8, 14, 20]), "kv_source_layers",
     "layer 2 (ratio 2) has no KV source"),
    (lambda d: d.update(engram_num_embeddings=[1]), "engram_num_embeddings", "entries"),
    (lambda d: d.update(candidate_source_layer=24), "candidate_source_layer", "not a KV source"),
    (lambda d: d.update(image_token_id=200000), "image_token_id", "outside the vocabulary"),
])
def test_bad_configs_name_the_key_and_reason(tmp_path, change, key, reason):
    raw = _flat()
    change(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"'{key}'" in str(err.value) and reason in str(err.value) and str(path) in str(err.value)


def test_unreadable_and_malformed_config_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    with pytest.raises(ConfigError, match="top level"):
        config_from_dict([1, 2])


def test_release_role_plan_matches_the_spec_table():
    plan = role_plan(release_config())
    assert len(plan) == 43
    expect = {0: "swa", 1: "swa", 2: "full", 8: "full", 14: "full", 20: "full", 24: "reindex", 28: "reindex",
              32: "reindex", 36: "reindex"}
    for r in plan[:40]:
        assert r.role == expect.get(r.layer, "reuse"), r.layer
    by = {r.layer: r for r in plan}
    for layer, kv, top in [(3, 2, 2), (7, 2, 2), (9, 8, 8), (19, 14, 14), (21, 20, 20), (23, 20, 20),
                           (25, 20, 24), (27, 20, 24), (31, 20, 28), (35, 20, 32), (39, 20, 36), (24, 20, 24)]:
        assert (by[layer].kv_source, by[layer].index_source) == (kv, top), layer
    assert [r.layer for r in plan if r.in_candidate_pool] == [24, 28, 32, 36]
    assert [r.layer for r in plan if r.candidate_source] == [20]
    assert [r.layer for r in plan if r.engram] == [1, 14]
    assert [r.layer for r in plan if r.dspark_tap] == [37, 38, 39]
    assert {r.half for r in plan[:20]} == {"encoder"} and {r.half for r in plan[20:40]} == {"decoder"}
    assert all(r.is_dspark and r.role == "swa" for r in plan[40:])
    assert layers_by_tab(plan) == {"swa": [0, 1], "full_m2": [2, 8, 14], "full_m1": [20],
                                   "reindex": [24, 28, 32, 36],
                                   "reuse": [L for L in range(40) if L not in (0, 1, 2, 8, 14, 20, 24, 28, 32, 36)]}
    graph = cache_graph(release_config(), plan)
    assert graph.edges[25, 20]["reads"] == ["kv"] and graph.edges[25, 24]["reads"] == ["topk"]
    assert set(graph.edges[24, 20]["reads"]) == {"kv", "index_keys", "candidates"}
    assert graph.edges[41, 38]["reads"] == ["dspark_tap"]


def test_another_config_gives_another_correct_plan():
    rel = release_config()
    cfg = rel.replace(
        n_layers=12, n_mtp_layers=1, compress_ratios=(0, 4, 4, 4, 4, 4, 1, 1, 1, 1, 1, 1, 0),
        kv_source_layers=(1, 6), index_source_layers=(1, 3, 6, 9), candidate_source_layer=-1,
        engram_layer_ids=(2,), engram_num_embeddings=(1000,), dspark_target_layer_ids=(11,))
    plan = role_plan(cfg)
    roles = [r.role for r in plan[:12]]
    assert roles == ["swa", "full", "reuse", "reindex", "reuse", "reuse", "full", "reuse", "reuse", "reindex",
                     "reuse", "reuse"]
    assert plan[1].tab == "full_m2" and plan[1].compress_ratio == 4 and plan[6].tab == "full_m1"
    assert [(r.kv_source, r.index_source) for r in plan[2:6]] == [(1, 1), (1, 3), (1, 3), (1, 3)]
    assert [(r.kv_source, r.index_source) for r in plan[7:12]] == [(6, 6), (6, 6), (6, 9), (6, 9), (6, 9)]
    assert not any(r.in_candidate_pool for r in plan)  # no candidate source in this config
    assert decoder_start(cfg) == 6 and plan[5].half == "encoder" and plan[6].half == "decoder"
    assert plan[2].engram and not plan[1].engram and plan[11].dspark_tap
