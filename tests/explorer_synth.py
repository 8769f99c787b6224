"""A synthetic run in the shape of `RunResult.to_json()`, for the explorer's tests and bench.

Deterministic (seeded), small, and built by hand so tests can predict every count."""

from __future__ import annotations

import random


def synthetic_layer(T: int, *, role: str = "reindex", ratio: int = 1, k: int = 4, n_experts: int = 16,
                    top: int = 6, hc: int = 4, kv_source: int | None = 20, index_source: int | None = 24,
                    window: int = 8, image: list[bool] | None = None, pool: bool = True, seed: int = 0) -> dict:
    rng = random.Random(seed)
    topk, scores, pools = [], [], []
    for t in range(T):
        visible = [j for j in range((t + 1) // ratio) if t >= (j + 1) * ratio - 1]
        picked = sorted(rng.sample(visible, min(k, len(visible))))
        topk.append(picked + [-1] * (k - len(picked)))
        scores.append([round(rng.random(), 4) for _ in picked] + [None] * (k - len(picked)))
        pools.append(sorted(set(picked) | set(visible[-2:])))
    experts, weights, all_scores = [], [], []
    for t in range(T):
        es = rng.sample(range(n_experts), top)
        ws = [rng.random() + 0.1 for _ in es]
        s = sum(ws)
        experts.append(es)
        weights.append([1.5 * w / s for w in ws])
        all_scores.append([round(rng.random(), 4) for _ in range(n_experts)])

    def mixes():
        pre = [[rng.random() for _ in range(hc)] for _ in range(T)]
        post = [[2 * rng.random() for _ in range(hc)] for _ in range(T)]
        comb = [[[1.0 / hc] * hc for _ in range(hc)] for _ in range(T)]
        return {"pre": pre, "post": post, "comb": comb}

    layer = {"role": role, "kv_source": kv_source, "index_source": index_source, "compress_ratio": ratio,
             "window_size": window, "topk": topk if kv_source is not None else None,
             "topk_scores": scores if kv_source is not None else None,
             "candidate_pool": pools if pool and kv_source is not None else None,
             "mhc": {"attn": mixes(), "ffn": mixes()},
             "routing": {"experts": experts, "weights": weights, "scores": all_scores},
             "residual_norms": [[1.0 + c + t / T for c in range(hc)] for t in range(T)], "time_s": 0.01}
    if image is not None:
        layer["routing"]["image_mask"] = image
    return layer


def synthetic_run(T: int = 12, layers: dict[int, dict] | None = None, image: list[bool] | None = None) -> dict:
    tokens = [f"t{i}" if i % 3 else f" w{i}" for i in range(T)]
    tokens[0] = "<bos>"
    layers = layers if layers is not None else {24: synthetic_layer(T, image=image)}
    return {"tokens": tokens, "token_ids": list(range(T)), "image_mask": image or [False] * T,
            "layers": {str(k): v for k, v in layers.items()},
            "cache_bytes": {"global": 1000, "window": 500, "pending": 0, "total": 1500}, "kv_bytes_formula": 1000}
