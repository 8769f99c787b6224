"""`python -m engine`: tally, inspect and skeleton, and one-line errors (exit 2, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint.inventory import INDEX_NAME
from engine.checkpoint.writer import write_checkpoint
from _fixtures_checkpoint import release_skeleton, small_config  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def run_at_once(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """`run` of independent commands started together (each is mostly the interpreter importing torch,
    and this process only waits); the results in the order given."""
    procs = [subprocess.Popen([sys.executable, "-m", "engine", *args], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in commands]
    done = []
    try:
        for args, proc in zip(commands, procs):
            stdout, stderr = proc.communicate(timeout=120)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_tally_default_config_human_and_json():
    human, as_json = run_at_once(("tally", "--context", "1000000"), ("tally", "--json", "--context", "4"))
    assert human.returncode == 0, human.stderr
    assert "source: config: " in human.stdout and "v41-flash.json" in human.stdout
    assert "543,581,798,400" in human.stdout and "890 B" in human.stdout
    data = json.loads(as_json.stdout)
    assert data["tensor_count"] == 96_085 and data["kv_bytes_per_token"] == 890.0
    assert data["cache"]["global_kv"] == (3 * 2 + 4) * 288


def test_tally_and_inspect_from_the_release_skeleton(release_skeleton):
    from_ckpt, from_cfg, result = run_at_once(("tally", "--checkpoint", str(release_skeleton), "--json"),
                                              ("tally", "--json"), ("inspect", str(release_skeleton)))
    from_ckpt, from_cfg = json.loads(from_ckpt.stdout), json.loads(from_cfg.stdout)
    assert from_ckpt.pop("source").startswith("checkpoint headers: ")
    from_cfg.pop("source")
    assert from_ckpt == from_cfg
    assert result.returncode == 0, result.stderr
    assert "48 shards, 96,085 tensors, 510,286,023,000 data bytes" in result.stdout
    assert "matches the config's layout" in result.stdout


def test_inspect_lists_mismatches_and_exits_1(tmp_path):
    cfg = small_config()
    write_checkpoint(cfg, tmp_path / "ck")
    other = tmp_path / "other.json"
    other.write_text(json.dumps(cfg.replace(q_lora_rank=64).to_dict()))
    result = run("inspect", str(tmp_path / "ck"), "--config", str(other))
    assert result.returncode == 1
    assert "mismatches with the config" in result.stdout and "layers.0.attn.wq_a.weight" in result.stdout


def test_skeleton_command(tmp_path):
    cfg_path = tmp_path / "small.json"
    cfg_path.write_text(json.dumps(small_config().to_dict()))
    result = run("skeleton", "--config", str(cfg_path), "--out", str(tmp_path / "sk"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "sk" / INDEX_NAME).exists() and (tmp_path / "sk" / "config.json").exists()
    again = run("inspect", str(tmp_path / "sk"))
    assert again.returncode == 0, again.stdout + again.stderr


@pytest.mark.parametrize("case", ["no_folder", "no_index", "bad_header", "bad_config", "bad_args", "bad_command",
                                  "config_missing_key"])
def test_errors_are_one_line_exit_2(case, tmp_path):
    ck = tmp_path / "ck"
    if case in ("no_index", "bad_header", "bad_config"):
        write_checkpoint(small_config(), ck)
    if case == "no_folder":
        assert_one_line_error(run("inspect", str(tmp_path / "missing")), "no such checkpoint folder")
    elif case == "no_index":
        (ck / INDEX_NAME).unlink()
        assert_one_line_error(run("tally", "--checkpoint", str(ck)), "missing index")
    elif case == "bad_header":
        shard = sorted(ck.glob("*.safetensors"))[0]
        with open(shard, "r+b") as f:
            f.write((10**12).to_bytes(8, "little"))
        assert_one_line_error(run("inspect", str(ck)), shard.name, "header length")
    elif case == "bad_config":
        (ck / "config.json").write_text("{")
        assert_one_line_error(run("tally", "--checkpoint", str(ck)), "config.json", "not valid JSON")
    elif case == "bad_args":
        assert_one_line_error(run("tally", "--context", "many"), "--context")
    elif case == "bad_command":
        assert_one_line_error(run("frobnicate"), "invalid choice")
    elif case == "config_missing_key":
        cfg_path = tmp_path / "c.json"
        cfg_path.write_text(json.dumps({"dim": 64}))
        assert_one_line_error(run("skeleton", "--config", str(cfg_path), "--out", str(tmp_path / "o")),
                              "c.json", "missing key")


def test_config_commands_start_without_torch():
    """tally and plan read a config and headers: the CLI builds every command's parser and runs them
    without importing torch (it comes with the first model: `run`, `eval`, `serve`)."""
    code = """
import contextlib, io, sys
from engine.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    codes = [main(["tally"]), main(["tally", "--json"]), main(["plan", "--gpus", "8"])]
assert codes == [0, 0, 0], codes
assert "890" in out.getvalue() or "KV" in out.getvalue()
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
