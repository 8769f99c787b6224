"""benches/train_step.py's plumbing: what reaches each tree's worker process (a wrong setting would
spend a device call measuring the wrong thing)."""

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("train_step", ROOT / "benches" / "train_step.py")
train_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_step)


def test_tree_env_sets_the_tree_and_the_pairs():
    env = train_step.tree_env(Path("/t"), "V41_FUSED_PICKS=1,PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,X=a=b",
                              base={"PATH": "/bin", "PYTHONPATH": "/old", "V41_FUSED_PICKS": "0"})
    assert env == {"PATH": "/bin", "PYTHONPATH": "/t", "V41_FUSED_PICKS": "1",
                   "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "X": "a=b"}
    assert train_step.tree_env(Path("/t"), "", base={"A": "1"}) == {"A": "1", "PYTHONPATH": "/t"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        train_step.tree_env(Path("/t"), "V41_FUSED_PICKS", base={})


def test_the_worker_reads_the_fused_picks_setting(monkeypatch):
    a = argparse.Namespace(tree=str(ROOT), train="x.npy", seq_balance=0.0, profile_out="")
    monkeypatch.delenv("V41_FUSED_PICKS", raising=False)
    assert train_step._args_namespace(a).fused_picks is None       # the trainer's default: in place on CUDA
    monkeypatch.setenv("V41_FUSED_PICKS", "1")
    assert train_step._args_namespace(a).fused_picks is True
    monkeypatch.setenv("V41_FUSED_PICKS", "0")
    assert train_step._args_namespace(a).fused_picks is False
