"""`python -m engine run` end to end on a small written checkpoint (subprocess, as a user runs it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.engine_helpers import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), 0, 2, engram_layer_ids=(), engram_num_embeddings=())


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=300)


def test_run_writes_the_documented_json(checkpoint, tmp_path):
    out = tmp_path / "probes.json"
    ids = ",".join(str(i) for i in [0] + list(range(10, 40)))
    proc = _cli("run", "--checkpoint", str(checkpoint), "--ids", ids, "--layer", "5", "--layer", "7",
                "--layer", "3", "--generate", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Reindex" in proc.stdout and "Traceback" not in proc.stderr
    data = json.loads(out.read_text())
    assert data["token_ids"] == [0] + list(range(10, 40))
    assert set(data["layers"]) == {"3", "5", "7"}
    l7 = data["layers"]["7"]
    assert (l7["role"], l7["kv_source"], l7["index_source"]) == ("reindex", 5, 7)
    assert len(l7["topk"]) == 31 and all(len(row) == len(l7["topk"][0]) for row in l7["topk"])
    assert l7["candidate_pool"] is not None and len(l7["candidate_pool"]) == 31
    assert data["layers"]["3"]["candidate_pool"] is None
    assert len(l7["routing"]["experts"][0]) == 6
    assert abs(sum(l7["routing"]["weights"][0]) - 1.5) < 1e-4
    assert len(l7["mhc"]["ffn"]["comb"][0]) == 4


@pytest.mark.parametrize("args, message", [
    (["--ids", "0,1,99999"], "outside the vocabulary"),
    (["--ids", "1,2", "--layer", "41"], "layer 41 does not exist"),
    (["--ids", "a,b"], "expected comma-separated integers"),
    (["--prompt", "hello"], "no tokenizer.json"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read the prompt file"),
])
def test_run_bad_input_is_one_clear_line(checkpoint, args, message):
    proc = _cli("run", "--checkpoint", str(checkpoint), *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_run_missing_or_corrupt_checkpoint(tmp_path, checkpoint):
    proc = _cli("run", "--checkpoint", str(tmp_path / "nope"), "--ids", "1,2")
    assert proc.returncode == 2 and "no such checkpoint folder" in proc.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in checkpoint.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    shard = sorted(broken.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])  # truncated
    proc = _cli("run", "--checkpoint", str(broken), "--ids", "1,2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert shard.name in proc.stderr
