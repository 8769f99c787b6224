"""Shared fixtures for the checkpoint/tally/CLI tests: small configs and a session-wide sparse skeleton
of the full release layout (a few MB on disk)."""

from __future__ import annotations

import pytest

from engine.checkpoint.writer import write_skeleton
from engine.config import ModelConfig, release_config


def small_config(**changes) -> ModelConfig:
    """A tiny model with every structural feature: SWA, Full m=2 and m=1, Reindex, Reuse, Engram,
    a vision tower and one DSpark stage."""
    base = dict(
        vocab_size=512, dim=64, n_layers=5, n_mtp_layers=1, n_heads=4, q_lora_rank=32, head_dim=64,
        rope_head_dim=16, o_groups=2, o_lora_rank=32, window_size=8,
        compress_ratios=(0, 2, 1, 1, 1, 0), kv_source_layers=(1, 2), index_source_layers=(1, 2, 4),
        candidate_source_layer=2, candidate_topk_blocks=4, candidate_block_size=2,
        index_n_heads=2, index_head_dim=32, index_topk=8, moe_inter_dim=32, n_routed_experts=8,
        n_activated_experts=2, hc_mult=2, engram_layer_ids=(1, 3), engram_num_embeddings=(100, 77),
        engram_n_heads=2, engram_head_dim=32, engram_max_ngram_size=3, engram_vocab_size=1000,
        engram_compressed_vocab_size=400, dspark_target_layer_ids=(3, 4), dspark_markov_rank=16,
        dspark_n_routed_experts=4, dspark_n_activated_experts=2, vision_n_layers=1, vision_dim=32,
        vision_n_heads=2, vision_inter_dim=32, vision_patch_size=2, vision_downsample_ratio=2,
        image_token_id=500, dspark_noise_token_id=501, max_seq_len=256)
    base.update(changes)
    return ModelConfig(**base)


def bare_config() -> ModelConfig:
    """No vision tower, no DSpark, no Engram."""
    return small_config(n_mtp_layers=0, compress_ratios=(0, 2, 1, 1, 1), vision_n_layers=0,
                        engram_layer_ids=(), engram_num_embeddings=(), dspark_target_layer_ids=())


@pytest.fixture(scope="session")
def release_skeleton(tmp_path_factory):
    """The full release layout as sparse files: 510 GB apparent, a few MB on disk."""
    out = tmp_path_factory.mktemp("release_skeleton")
    write_skeleton(release_config(), out)
    return out
