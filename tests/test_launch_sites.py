"""benches/launch_sites.py: aten ops of one step charged to engine lines, per layer. On the tiny model with
the `reference` numerics: the plain numerics' RoPE and mHC stream update show up as their torch lines, the
kernel ops' do not (one kernel each), and nothing inside a kernel's CPU reference is counted."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benches.launch_sites import launch_sites  # noqa: E402
from engine.checkpoint.reader import CheckpointReader  # noqa: E402
from engine.checkpoint.weights import CheckpointWeights  # noqa: E402
from engine.model.transformer import Model  # noqa: E402
from engine_helpers import IdentityTokenizer, random_ids, tiny_config, write_tiny_checkpoint  # noqa: E402


def test_sites_show_what_the_kernel_ops_take_in_one_launch(tmp_path, monkeypatch):
    import engine.ops.triton as kernel_ops
    monkeypatch.setattr(kernel_ops, "interpreter_active", lambda: False)  # the kernels' references (fast)
    cfg = tiny_config()
    weights = CheckpointWeights(CheckpointReader(write_tiny_checkpoint(tmp_path, seed=5, n_shards=1), cfg))
    ids = random_ids(cfg, 48, seed=4)
    counts = {}
    for kernels in (False, True):
        model = Model(cfg, weights, IdentityTokenizer(cfg.engram_compressed_vocab_size), numerics="reference",
                      kernels=kernels)
        counts[kernels] = launch_sites(model, ids[:40], ids[40:])
    full = 2  # tiny_config's Full m=2 layer
    plain, kern = counts[False][full], counts[True][full]
    assert sum(plain.values()) > sum(kern.values()) > 0
    sites = lambda c: " ".join(c)  # noqa: E731
    for line in ("out[..., -rd:] = torch.view_as_real", "mixed.add_(torch.mul("):  # rotate_by, expand_in_order
        assert line in sites(plain) and line not in sites(kern), line
    assert all(where.startswith("engine/") for c in counts.values() for layer in c.values() for where in layer)


def test_op_bytes_counts_what_an_op_moves():
    """Views and conversions to the input's own dtype move nothing; a fresh output counts with its inputs; an
    in-place op counts what it reads and the tensor it writes."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from benches.launch_sites import op_bytes

    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append((str(func), op_bytes(func, args, kwargs or {}, out)))
            return out

    a, b = torch.ones(8, 4), torch.ones(8, 4)  # 128 bytes each
    with Spy():
        a.view(32)
        a + b
        a.add_(b)
        a.bfloat16()
        a.t().contiguous()
    assert seen == [("aten.view.default", 0), ("aten.add.Tensor", 3 * 128),
                    ("aten.add_.Tensor", 3 * 128), ("aten._to_copy.default", 128 + 64), ("aten.t.default", 0),
                    ("aten.clone.default", 2 * 128)]
    # a conversion to the input's own dtype hands the input back (as `.float()` of a float32 does under a mode)
    assert op_bytes(torch.ops.aten.to.dtype, (a, torch.float32), {}, a) == 0


def test_prefill_bytes_show_the_engram_glue_the_kernel_op_takes(tmp_path, monkeypatch):
    """--prefill --bytes --callers: on the tiny model's Engram layer the plain numerics' gated update moves its
    [T, hc, dim] float32 temporaries on engine/model/engram.py's lines; the kernel ops' one launch does not,
    and the ops seam's lines name the model line that called them."""
    import engine.ops.triton as kernel_ops
    monkeypatch.setattr(kernel_ops, "interpreter_active", lambda: False)
    cfg = tiny_config()
    weights = CheckpointWeights(CheckpointReader(write_tiny_checkpoint(tmp_path, seed=5, n_shards=1), cfg))
    ids = random_ids(cfg, 48, seed=4)
    layer = cfg.engram_layer_ids[0]
    moved = {}
    for kernels in (False, True):
        model = Model(cfg, weights, IdentityTokenizer(cfg.engram_compressed_vocab_size), numerics="reference",
                      kernels=kernels)
        moved[kernels] = launch_sites(model, ids, ids[:0], prefill=True, weigh_bytes=True, callers=True)[layer]
    gated = lambda c: sum(n for where, n in c.items() if "engram.py" in where and "rstd" in where)  # noqa: E731
    assert gated(moved[False]) >= 48 * 4 * cfg.dim * 4 and gated(moved[True]) == 0
    assert any(" <- engine/model/" in where for where in moved[True])
