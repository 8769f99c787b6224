"""Small configs and models for engine tests (in-memory random weights, no checkpoint)."""

from __future__ import annotations

import torch

from engine.config import ModelConfig, release_config
from engine.model.transformer import Model
from engine.checkpoint.weights import TensorWeights, random_weights


def tiny_config(**changes) -> ModelConfig:
    """8 layers with every role: SWA 0-1, Full m=2 at 2, Reuse 3-4, Full m=1 (candidate source) at 5,
    Reuse 6, Reindex 7; Engram before 1."""
    base = dict(
        vocab_size=300, dim=64, n_layers=8, n_mtp_layers=1, n_heads=4, q_lora_rank=32, head_dim=64,
        rope_head_dim=16, o_groups=2, o_lora_rank=32, window_size=8,
        compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 0), kv_source_layers=(2, 5), index_source_layers=(2, 5, 7),
        index_n_heads=2, index_head_dim=32, index_topk=8, candidate_source_layer=5, candidate_topk_blocks=2,
        candidate_block_size=4, moe_inter_dim=32, n_routed_experts=8, n_activated_experts=6,
        engram_layer_ids=(1,), engram_num_embeddings=(2000,), engram_max_ngram_size=3, engram_n_heads=2,
        engram_head_dim=32, engram_vocab_size=300, engram_compressed_vocab_size=300,
        dspark_target_layer_ids=(7,), dspark_n_routed_experts=4, dspark_n_activated_experts=2,
        vision_n_layers=0, image_token_id=3, dspark_noise_token_id=4, max_seq_len=4096, original_seq_len=256)
    base.update(changes)
    return ModelConfig(**base)


def release_lists_config(**changes) -> ModelConfig:
    """The release's 40-layer plan (all its lists) at a small width."""
    rel = release_config()
    base = dict(
        vocab_size=512, dim=64, n_layers=40, n_mtp_layers=rel.n_mtp_layers, n_heads=2, q_lora_rank=32,
        head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=32, window_size=32,
        compress_ratios=rel.compress_ratios, kv_source_layers=rel.kv_source_layers,
        index_source_layers=rel.index_source_layers, index_n_heads=2, index_head_dim=32, index_topk=64,
        candidate_source_layer=rel.candidate_source_layer, candidate_topk_blocks=32, candidate_block_size=8,
        moe_inter_dim=32, n_routed_experts=16, n_activated_experts=6, engram_layer_ids=rel.engram_layer_ids,
        engram_num_embeddings=(4000, 4000), engram_max_ngram_size=4, engram_n_heads=2, engram_head_dim=32,
        engram_vocab_size=600, engram_compressed_vocab_size=512, dspark_target_layer_ids=rel.dspark_target_layer_ids,
        dspark_n_routed_experts=4, dspark_n_activated_experts=2, vision_n_layers=0, image_token_id=3,
        dspark_noise_token_id=4, max_seq_len=8192, original_seq_len=4096)
    base.update(changes)
    return ModelConfig(**base)


class IdentityTokenizer:
    """Stands in for a tokenizer where only the Engram compressed vocabulary is needed."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.eos_id = 1

    def compressed_vocab(self):
        return list(range(self.vocab)), self.vocab

    def token_strings(self, ids):
        return [f"<{i}>" for i in ids]

    def decode(self, ids):
        return "".join(self.token_strings(ids))


def tiny_model(cfg: ModelConfig | None = None, seed: int = 0, act_quant: bool = True) -> Model:
    cfg = cfg or tiny_config()
    weights = TensorWeights(random_weights(cfg, seed))
    return Model(cfg, weights, IdentityTokenizer(cfg.engram_compressed_vocab_size), act_quant=act_quant)


def write_tiny_checkpoint(out, seed: int, n_shards: int, **changes):
    """A release-layout checkpoint of `tiny_config(**changes)` with random weights, written to out."""
    from engine.checkpoint.writer import write_checkpoint
    cfg = tiny_config(**changes)
    write_checkpoint(cfg, out, tensors=random_weights(cfg, seed), n_shards=n_shards)
    return out


def random_ids(cfg: ModelConfig, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, cfg.vocab_size, (n,), generator=g)


def check_same_experts_but_near_ties(kern: dict, cpu: dict, bias: torch.Tensor, most: int = 1) -> None:
    """One layer's routing on two routes: the same experts for every token but at most `most` near ties,
    tokens where the CPU route's last chosen and first left-out expert (on score + bias) are closer than
    twice the two routes' largest score difference on that token: a last-bit difference in an earlier
    GEMM flips such a tie (run 9's layer 0, token 6: experts 6 and 7 apart by 1e-3, the routes' scores
    by 1.6e-3)."""
    chosen_k, chosen_c = kern["experts"].sort(-1).values, cpu["experts"].sort(-1).values
    differ = (chosen_k != chosen_c).any(-1).nonzero().flatten().tolist()
    assert len(differ) <= most, differ
    for t in differ:
        ranked = (cpu["scores"][t].float() + bias).sort(descending=True).values
        k = chosen_c.shape[-1]
        noise = (kern["scores"][t].float() - cpu["scores"][t].float()).abs().max()
        assert ranked[k - 1] - ranked[k] <= 2 * noise, (t, float(ranked[k - 1] - ranked[k]), float(noise))
