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
