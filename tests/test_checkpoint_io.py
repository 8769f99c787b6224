"""Checkpoint I/O: the release skeleton's headers, the writer's round trip, hand-computed FP8/FP4 bytes,
row reads, and clear errors for broken folders."""

from __future__ import annotations

import json
import shutil
import struct
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine import quant
from engine.checkpoint.inventory import INDEX_NAME, CheckpointError, check_against_config, read_inventory
from engine.checkpoint.reader import CheckpointReader
from engine.checkpoint.writer import write_checkpoint
from engine.config import ConfigError, load_config
from engine.tally import tally_from_checkpoint, tally_from_config
from _fixtures_checkpoint import bare_config, release_skeleton, small_config  # noqa: F401


def raw_header(path: Path) -> tuple[int, dict]:
    """Independent header parse: (data start, header dict)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


# -- the release skeleton ---------------------------------------------------------------------------

def test_release_skeleton_headers(release_skeleton):
    shards = sorted(release_skeleton.glob("*.safetensors"))
    assert len(shards) == 48 and shards[-1].name == "model-00048-of-00048.safetensors"
    count, by_dtype, on_disk, apparent = 0, Counter(), 0, 0
    for path in shards:
        start, header = raw_header(path)
        for name, info in header.items():
            if name != "__metadata__":
                count += 1
                by_dtype[info["dtype"]] += info["data_offsets"][1] - info["data_offsets"][0]
        apparent += path.stat().st_size
        on_disk += path.stat().st_blocks * 512
    assert count == 96_085
    assert sum(by_dtype.values()) == 510_286_023_000
    assert dict(by_dtype) == {"BF16": 3_952_883_712, "F32": 169_229_128, "F8_E4M3": 204_015_223_296,
                              "F8_E8M0": 23_563_015_184, "I8": 278_585_671_680}
    assert apparent > 510_286_023_000
    assert on_disk < 64 * 2**20      # sparse: only the headers take blocks
    _, last = raw_header(shards[-1])
    assert all(k.startswith("layers.14.engram.") for k in last if k != "__metadata__")
    assert load_config(release_skeleton) == load_config(Path(__file__).parents[1] / "assets/configs/v41-flash.json")


def test_release_inventory_is_fast_and_complete(release_skeleton):
    read_inventory(release_skeleton)   # warm the page cache
    t0 = time.perf_counter()
    inv = read_inventory(release_skeleton)
    elapsed = time.perf_counter() - t0
    assert len(inv) == 96_085 and inv.total_bytes == 510_286_023_000
    assert inv.index_total_size == 510_286_023_000
    assert elapsed < 2.5, f"inventory took {elapsed:.2f} s"
    from engine.config import release_config
    assert check_against_config(inv, release_config()) == []
    entry = inv.tensors["layers.1.engram.embed.weight"]
    assert entry.shard == "model-00047-of-00048.safetensors" and entry.nbytes == 384006168 * 256


def test_read_rows_of_the_sparse_engram_table(release_skeleton):
    reader = CheckpointReader(release_skeleton)
    rows = reader.read_rows("layers.14.engram.embed.weight", torch.tensor([[0, 384016681], [7, 7]]))
    assert rows.shape == (2, 2, 256) and rows.dtype == torch.float8_e4m3fn
    assert torch.all(rows.view(torch.uint8) == 0)          # holes read as zeros
    deq = reader.dequantized_rows("layers.14.engram.embed", [3, 9])
    assert deq.shape == (2, 256) and deq.dtype == torch.float32
    with pytest.raises(CheckpointError, match="row index outside"):
        reader.read_rows("layers.14.engram.embed.weight", [384016682])


# -- writer round trip ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    cfg = small_config()
    out = tmp_path_factory.mktemp("small_ckpt")
    write_checkpoint(cfg, out, seed=3)
    return cfg, out


@pytest.mark.parametrize("make", [small_config, bare_config])
def test_small_round_trip_config_and_tally(make, tmp_path):
    cfg = make()
    write_checkpoint(cfg, tmp_path, seed=1, n_shards=3)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    assert load_config(tmp_path) == cfg
    a, b = tally_from_checkpoint(tmp_path).to_json(), tally_from_config(cfg).to_json()
    a.pop("source"), b.pop("source")
    assert a == b


def test_written_shards_load_with_safetensors(small_ckpt):
    from safetensors.torch import load_file
    cfg, out = small_ckpt
    reader = CheckpointReader(out)
    for shard in sorted(out.glob("*.safetensors")):
        for name, value in load_file(shard).items():
            ours = reader.tensor(name)
            assert ours.dtype == value.dtype and ours.shape == value.shape
            assert torch.equal(ours.view(torch.uint8), value.view(torch.uint8)), name


def test_random_init_scales(small_ckpt):
    cfg, out = small_ckpt
    r = CheckpointReader(out)
    assert torch.all(r.dequantized("layers.0.attn_norm") == 1)
    assert torch.all(r.tensor("layers.0.ffn.gate.bias") == 0)
    w = r.dequantized("layers.0.attn.wq_b")              # [n_heads*head_dim, q_lora_rank]
    assert abs(w.std().item() - cfg.q_lora_rank ** -0.5) < 0.2 * cfg.q_lora_rank ** -0.5
    e = r.dequantized("layers.0.ffn.experts.0.w2")        # FP4 [dim, moe_inter_dim]
    assert e.shape == (cfg.dim, cfg.moe_inter_dim)
    assert abs(e.std().item() - cfg.moe_inter_dim ** -0.5) < 0.25 * cfg.moe_inter_dim ** -0.5


def test_given_float_tensors_round_trip_through_the_formats(tmp_path):
    cfg = bare_config()
    g = torch.Generator().manual_seed(0)
    wq = torch.randn(cfg.q_lora_rank, cfg.dim, generator=g)
    w1 = torch.randn(cfg.moe_inter_dim, cfg.dim, generator=g)
    norm = torch.rand(cfg.dim, generator=g)
    write_checkpoint(cfg, tmp_path, tensors={"layers.0.attn.wq_a.weight": wq, "layers.1.ffn.experts.3.w1.weight": w1,
                                             "layers.0.attn_norm.weight": norm})
    r = CheckpointReader(tmp_path)
    assert torch.equal(r.dequantized("layers.0.attn.wq_a.weight"), quant.dequantize_fp8_weight(*quant.quantize_fp8_weight(wq)))
    assert torch.equal(r.dequantized("layers.1.ffn.experts.3.w1"), quant.dequantize_fp4_weight(*quant.quantize_fp4_weight(w1)))
    assert torch.equal(r.tensor("layers.0.attn_norm.weight"), norm.to(torch.bfloat16))
    assert (r.dequantized("layers.0.attn.wq_a") - wq).abs().max() <= wq.abs().max() / 8


def test_fp8_and_fp4_bytes_by_hand(tmp_path):
    cfg = bare_config()
    # FP8 block 0: all 1.0 and one 448 -> scale 2^0; block 1: 0.5 and -0.25 -> scale 2^-9
    wq = torch.ones(cfg.q_lora_rank, cfg.dim)
    wq[0, 0] = 448.0
    wq[:, 32:] = 0.5
    wq[0, 33] = -0.25
    # FP4 row 0: group 0 amax 6 -> scale 1; group 1 amax 3 -> scale 0.5
    w1 = torch.zeros(cfg.moe_inter_dim, cfg.dim)
    w1[0, :4] = torch.tensor([1.0, -3.0, 6.0, 0.5])
    w1[0, 32:34] = torch.tensor([3.0, -1.5])
    write_checkpoint(cfg, tmp_path, tensors={"layers.0.attn.wq_a.weight": wq, "layers.0.ffn.experts.0.w1.weight": w1})
    index = json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]

    def raw(name: str) -> bytes:
        path = tmp_path / index[name]
        start, header = raw_header(path)
        b, e = header[name]["data_offsets"]
        return path.read_bytes()[start + b:start + e]

    q = raw("layers.0.attn.wq_a.weight")
    assert q[0] == 0x7E                  # 448 = 1.75 * 2^8: sign 0, exponent 15, mantissa 110
    assert q[1] == 0x38                  # 1.0: exponent 7 (bias 7), mantissa 0
    assert q[32] == 0x78                 # 0.5 / 2^-9 = 256 = 2^8
    assert q[33] == 0xF0                 # -0.25 / 2^-9 = -128: sign 1, exponent 14
    assert q[cfg.dim + 1] == 0x38        # row 1
    s = raw("layers.0.attn.wq_a.scale")   # [1, 2] blocks of 32x32
    assert s == bytes([127, 127 - 9])
    p = raw("layers.0.ffn.experts.0.w1.weight")   # [32, 32] packed, even index in the low nibble
    assert p[0] == 0x2 | (0x8 | 0x5) << 4        # 1.0 = code 2, -3.0 = sign | code 5
    assert p[1] == 0x7 | 0x1 << 4                # 6.0 = code 7, 0.5 = code 1
    assert p[2:16] == bytes(14)
    assert p[16] == 0x7 | (0x8 | 0x5) << 4       # 3/0.5 = 6 -> 7, -1.5/0.5 = -3 -> sign | 5
    e8 = raw("layers.0.ffn.experts.0.w1.scale")   # [32, 2]: one E8M0 per 32 inputs
    assert e8[:2] == bytes([127, 126])
    r = CheckpointReader(tmp_path)
    assert torch.equal(r.dequantized("layers.0.ffn.experts.0.w1")[0, :4], torch.tensor([1.0, -3.0, 6.0, 0.5]))


def test_writer_rejects_bad_tensors(tmp_path):
    cfg = bare_config()
    with pytest.raises(CheckpointError, match="not in the config's layout"):
        write_checkpoint(cfg, tmp_path / "a", tensors={"layers.99.attn.wq_a.weight": torch.zeros(1)})
    with pytest.raises(CheckpointError, match="layers.0.attn.wq_a.weight.*shape"):
        write_checkpoint(cfg, tmp_path / "b", tensors={"layers.0.attn.wq_a.weight": torch.zeros(3, 3)})


# -- broken folders -------------------------------------------------------------------------------

@pytest.fixture
def broken(small_ckpt, tmp_path):
    """A fresh copy of the small checkpoint to damage."""
    out = tmp_path / "ckpt"
    shutil.copytree(small_ckpt[1], out)
    return out


def first_shard(folder: Path) -> Path:
    return sorted(folder.glob("*.safetensors"))[0]


def test_truncated_shard(broken):
    shard = first_shard(broken)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    with pytest.raises(CheckpointError, match=f"{shard.name}.*truncated"):
        read_inventory(broken)
    with open(shard, "r+b") as f:
        f.truncate(5)
    with pytest.raises(CheckpointError, match=f"{shard.name}.*truncated"):
        read_inventory(broken)


def test_header_length_past_the_end(broken):
    shard = first_shard(broken)
    with open(shard, "r+b") as f:
        f.write(struct.pack("<Q", 10**9))
    with pytest.raises(CheckpointError, match=f"{shard.name}: header length 1000000000 runs past the end"):
        read_inventory(broken)


def test_malformed_header_json(broken):
    shard = first_shard(broken)
    with open(shard, "r+b") as f:
        f.seek(8)
        f.write(b"[[[")
    with pytest.raises(CheckpointError, match=f"{shard.name}: malformed header JSON"):
        read_inventory(broken)


def test_index_names_a_tensor_the_shard_lacks(broken):
    index = json.loads((broken / INDEX_NAME).read_text())
    shard = first_shard(broken).name
    index["weight_map"]["layers.0.attn.ghost.weight"] = shard
    (broken / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{shard}: tensor 'layers.0.attn.ghost.weight' is in the index but not"):
        read_inventory(broken)


def _write_shard(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_data_offsets_outside_the_file_or_inconsistent(tmp_path):
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"x": "a.safetensors"}}))
    _write_shard(tmp_path / "a.safetensors", {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8))
    with pytest.raises(CheckpointError, match="a.safetensors: truncated shard or data offsets outside the file: tensor 'x'"):
        read_inventory(tmp_path)
    _write_shard(tmp_path / "a.safetensors", {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, bytes(16))
    with pytest.raises(CheckpointError, match="a.safetensors: tensor 'x' data_offsets .* do not hold F32"):
        read_inventory(tmp_path)
    _write_shard(tmp_path / "a.safetensors", {"x": {"dtype": "Q7", "shape": [4], "data_offsets": [0, 4]}}, bytes(4))
    with pytest.raises(CheckpointError, match="a.safetensors: tensor 'x' has unknown dtype 'Q7'"):
        read_inventory(tmp_path)
    _write_shard(tmp_path / "a.safetensors", {"x": {"shape": [4]}}, bytes(4))
    with pytest.raises(CheckpointError, match="a.safetensors: malformed header entry for tensor 'x'"):
        read_inventory(tmp_path)


def test_layout_disagreement_with_the_config(small_ckpt):
    cfg, out = small_ckpt
    other = cfg.replace(q_lora_rank=64)
    problems = check_against_config(read_inventory(out), other)
    assert any("layers.0.attn.wq_a.weight is F8_E4M3 [32, 64], the config's layout says F8_E4M3 [64, 64]" in p
               for p in problems)
    assert all(p.startswith("model-") for p in problems)
    with pytest.raises(CheckpointError, match="disagrees with its config"):
        CheckpointReader(out, cfg=other)
    fewer = cfg.replace(n_routed_experts=4)
    assert any(p.startswith("model-") and "unexpected tensor layers.0.ffn.experts.7.w1.weight" in p
               for p in check_against_config(read_inventory(out), fewer))


def test_missing_folder_index_and_config(broken, tmp_path):
    with pytest.raises(CheckpointError, match="nowhere: no such checkpoint folder"):
        read_inventory(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="not a folder"):
        read_inventory(first_shard(broken))
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        tally_from_checkpoint(broken)
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing config.json"):
        tally_from_checkpoint(broken)
    shard = first_shard(broken)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: shard file is missing"):
        read_inventory(broken)
    (broken / INDEX_NAME).unlink()
    with pytest.raises(CheckpointError, match=f"{INDEX_NAME}: missing index"):
        read_inventory(broken)
