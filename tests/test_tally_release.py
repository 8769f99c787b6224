"""Tally figures against spec section 6 (from the config, from the release skeleton's headers) and
the KV cache arithmetic of spec section 5."""

from __future__ import annotations

import pytest

from engine.config import release_config
from engine.tally import (cache_breakdown_at, cache_bytes_at, kv_breakdown, kv_bytes_per_token, tally_from_checkpoint,
                          tally_from_config, window_bytes_per_layer)
from _fixtures_checkpoint import release_skeleton  # noqa: F401  (session fixture)


@pytest.fixture(scope="module")
def tally():
    return tally_from_config(release_config())


def test_exact_release_figures(tally):
    assert tally.routed_expert_params == 543_581_798_400
    assert tally.engram_params == 196_613_849_600
    assert tally.dspark_dense_params == 635_817_570
    assert tally.dspark_routed_params == 13_589_544_960
    assert tally.dspark_params == 635_817_570 + 13_589_544_960
    assert tally.tensor_count == 96_085
    assert tally.checkpoint_bytes == 510_286_023_000
    assert tally.bytes_by_dtype == {"BF16": 3_952_883_712, "F32": 169_229_128, "F8_E4M3": 204_015_223_296,
                                    "F8_E8M0": 23_563_015_184, "I8": 278_585_671_680}
    assert tally.kv_bytes_per_token == 890.0
    assert tally.window_bytes_per_layer == 128 * 528
    # the hub's own parameter total (FP4 counted as two weights a byte, scales not counted)
    assert tally.total_params == 763_205_315_794


def test_rounded_release_figures(tally):
    assert round(tally.layer_params(0, "attention") / 1e6, 1) == 126.6
    assert round(tally.layer_params(2, "csa2") / 1e6, 2) == 10.72
    assert round(tally.layer_params(20, "csa2") / 1e6, 2) == 8.09
    assert round(tally.layer_params(24, "csa2") / 1e6, 2) == 5.41
    assert tally.layer_params(25, "csa2") == 0
    assert round(tally.backbone_params / 1e9, 1) == 552.4
    assert round(tally.total_params / 1e9, 1) == 763.2
    assert round(tally.active_decode_params / 1e9, 1) == 16.1
    assert round(tally.active_prefill_params / 1e9, 1) == 7.9


def test_active_decode_by_hand(tally):
    """Dense per-token parameters equal the release inventory's 'decode_dense' count (7,637,123,184),
    plus 6/384 of the routed experts and 24 Engram rows of 256 per Engram layer."""
    routed_active = 543_581_798_400 * 6 // 384
    engram_rows = 2 * 24 * 256
    assert tally.active_decode_params == 7_637_123_184 + routed_active + engram_rows
    head = tally.row("head")
    assert head.active_decode_params == 129280 * 5120 and head.active_prefill_params == 0
    assert tally.row("embed").active_decode_params == 0


def test_rows_sum_to_totals(tally):
    assert sum(r.total_params for r in tally.rows) == tally.total_params
    assert sum(r.total_bytes for r in tally.rows) == tally.checkpoint_bytes
    experts = tally.row("ffn.experts.w1")
    assert (experts.instances, experts.params, experts.dtype, experts.shape) == (40 * 384, 2304 * 5120, "I8", [2304, 5120])
    assert experts.bytes == 2304 * 2560 + 2304 * 160
    assert tally.row("engram.embed[L1]").layers == [1]
    js = tally.to_json()
    for key in ("source", "total_params", "backbone_params", "engram_params", "dspark_params", "vision_params",
                "routed_expert_params", "active_decode_params", "active_prefill_params", "kv_bytes_per_token",
                "window_bytes_per_layer", "tensor_count", "checkpoint_bytes", "bytes_by_dtype", "rows"):
        assert key in js
    assert {"name", "params", "dtype", "bytes", "layers"} <= set(js["rows"][0])


def test_kv_breakdown_by_hand():
    cfg = release_config()
    kv = kv_breakdown(cfg)
    assert [(k.layer, k.ratio) for k in kv] == [(2, 2), (8, 2), (14, 2), (20, 1)]
    assert all(k.main_entry_bytes == 256 + 32 and k.index_key_bytes == 64 + 4 for k in kv)
    assert kv_bytes_per_token(cfg) == 2.5 * 356
    assert window_bytes_per_layer(cfg) == 128 * (512 + 16)
    # 1M tokens: 890 MB of global KV + 40 full windows
    n = 1_000_000
    assert cache_bytes_at(cfg, n) == 3 * (n // 2) * 356 + n * 356 + 40 * 128 * 528
    small = cache_breakdown_at(cfg, 5)     # floor(5/2) = 2 entries per m=2 source, 5 for layer 20
    assert small["global_kv"] == (3 * 2 + 5) * 288 and small["index_keys"] == (3 * 2 + 5) * 68
    assert small["windows"] == 40 * 5 * 528
    assert cache_bytes_at(cfg, 5, include_dspark=True) - cache_bytes_at(cfg, 5) == 3 * 5 * 528


def test_tally_from_release_skeleton_headers_equals_config(release_skeleton, tally):
    from_headers = tally_from_checkpoint(release_skeleton)
    assert from_headers.source.startswith("checkpoint headers: ")
    a, b = from_headers.to_json(), tally.to_json()
    a.pop("source"), b.pop("source")
    assert a == b
