"""The tensor contract against the release's published facts (spec sections 3 and 6)."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.config import release_config
from engine.checkpoint.layout import classify, shard_plan, spec_from_header, tensor_specs
from _fixtures_checkpoint import bare_config, small_config

# Published shard file sizes of the release (header + data), from the hub listing.
RELEASE_SHARD_FILE_SIZES = {
    1: 970533624, 2: 1323858272, 3: 7389759032, 5: 7405953784, 11: 7405953784, 17: 7405956128,
    23: 7400713088, 27: 7395337384, 43: 1323837624, 44: 2652728736, 45: 2573998176, 46: 2706402896,
    47: 101535150936, 48: 101537926640}


@pytest.fixture(scope="module")
def release_specs():
    return tensor_specs(release_config())


def test_release_tensor_count_bytes_and_dtype_split(release_specs):
    assert len(release_specs) == 96_085
    assert len({s.name for s in release_specs}) == 96_085
    assert sum(s.nbytes for s in release_specs) == 510_286_023_000
    by_dtype = Counter()
    for s in release_specs:
        by_dtype[s.dtype] += s.nbytes
    assert dict(by_dtype) == {"BF16": 3_952_883_712, "F32": 169_229_128, "F8_E4M3": 204_015_223_296,
                              "F8_E8M0": 23_563_015_184, "I8": 278_585_671_680}
    # tensor counts per dtype, from the release's header inventory
    assert Counter(s.dtype for s in release_specs) == {"BF16": 520, "F32": 387, "F8_E4M3": 357,
                                                       "F8_E8M0": 47_589, "I8": 47_232}


def test_release_names_follow_the_role_lists(release_specs):
    names = {s.name: s for s in release_specs}
    assert names["layers.2.attn.compressor.wgate.weight"].shape == (512, 5120)
    assert "layers.20.attn.compressor.wgate.weight" not in names       # ratio 1: no gate
    assert "layers.20.attn.indexer.wk.weight" in names                 # KV source owns index keys
    assert "layers.24.attn.indexer.wk.weight" not in names             # Reindex: query side only
    assert names["layers.24.attn.indexer.wq_b.weight"].shape == (4096, 1280)
    assert "layers.25.attn.indexer.wq_b.weight" not in names           # Reuse: nothing extra
    assert names["layers.14.engram.embed.weight"].shape == (384016682, 256)
    assert names["layers.14.engram.embed.scale"].shape == (384016682, 8)
    assert names["layers.1.engram.wkv.weight"].shape == (25600, 6144)
    assert names["layers.1.engram.wkv.scale"].shape == (800, 192)
    assert names["layers.0.ffn.experts.383.w2.weight"].shape == (5120, 1152)
    assert names["layers.0.ffn.experts.383.w2.scale"].shape == (5120, 72)
    assert names["layers.0.attn.wo_a.weight"].shape == (8192, 4096)
    assert names["layers.0.attn.wo_a.scale"].shape == (256, 128)
    assert names["mtp.0.ffn.gate.weight"].shape == (128, 5120)
    assert names["mtp.0.main_proj.weight"].shape == (5120, 15360)
    assert names["mtp.2.confidence_head.proj.weight"].shape == (1, 5376)
    assert names["vision.blocks.31.mlp.w1.weight"].shape == (5632, 1024)
    assert names["aligner.w1.weight"].shape == (5120, 9216)
    assert "mtp.1.main_proj.weight" not in names and "mtp.0.norm.weight" not in names


def test_classify_agrees_with_the_builder(release_specs):
    for s in release_specs[::97] + release_specs[-300:]:
        assert spec_from_header(s.name, s.dtype, list(s.shape)) == s
    info = classify("layers.7.ffn.experts.12.w3.scale")
    assert (info.kind, info.group, info.part, info.layer, info.expert) == ("ffn.experts.w3", "moe", "scale", 7, 12)
    info = classify("mtp.1.hc_ffn_scale")  # an F32 parameter named *_scale, not a quantization scale
    assert (info.kind, info.group, info.part, info.stage) == ("dspark.mhc.ffn_scale", "dspark", "weight", 1)
    assert classify("layers.3.attn.indexer.wq_b.weight").group == "csa2"


def test_release_shard_plan_matches_the_published_files():
    plan = shard_plan(release_config())
    assert [s.filename for s in plan][:2] == ["model-00001-of-00048.safetensors", "model-00002-of-00048.safetensors"]
    assert len(plan) == 48
    assert {s.name for s in plan[46].specs} >= {"layers.1.engram.embed.weight", "layers.1.engram.embed.scale"}
    assert all(s.layer == 14 and s.group == "engram" for s in plan[47].specs)
    assert sum(len(s.specs) for s in plan) == 96_085
    for number, size in RELEASE_SHARD_FILE_SIZES.items():
        header = size - plan[number - 1].nbytes   # what the published file spends on its header
        assert 8 < header < 300_000, (number, header)


@pytest.mark.parametrize("make", [small_config, bare_config])
def test_small_configs_give_a_consistent_contract(make):
    cfg = make()
    specs = tensor_specs(cfg)
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    assert any(n.startswith("mtp.") for n in names) == (cfg.n_mtp_layers > 0)
    assert any(n.startswith("vision.") for n in names) == cfg.vision_enabled
    experts = [s for s in specs if s.layer is not None and s.expert is not None]
    assert len(experts) == cfg.n_layers * cfg.n_routed_experts * 6
    for s in specs:   # every quantized weight has its scale
        if s.dtype in ("I8", "F8_E4M3"):
            assert s.name[:-len("weight")] + "scale" in names
    for n in (2, 3, 5):
        plan = shard_plan(cfg, n)
        assert len(plan) == n
        assert sorted(x.name for sh in plan for x in sh.specs) == sorted(names)
        if cfg.engram_layer_ids:
            assert all(x.group == "engram" for x in plan[-1].specs)
