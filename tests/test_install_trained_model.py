"""scripts/install_trained_model.py: a checkpoint split for the device's return trip comes back whole."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

from tests.engine_helpers import write_tiny_checkpoint

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "install_trained_model.py"


def _returned_files(tmp_path: Path, model: Path | None = None, part_bytes: int = 40_000) -> tuple[Path, Path]:
    """What device_train_call.sh leaves in $OUT: tar parts of out/model, their sums, the log."""
    model = model or write_tiny_checkpoint(tmp_path / "out" / "model", seed=3, n_shards=2)
    back = tmp_path / "files_at"
    back.mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(model, arcname="model")
    blob = buf.getvalue()
    for i in range(0, len(blob), part_bytes):
        (back / f"model.tar.part-a{chr(97 + i // part_bytes)}").write_bytes(blob[i:i + part_bytes])
    sums = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in sorted(model.iterdir())]
    (back / "model.sha256").write_text("\n".join(sums) + "\n")
    (back / "train_log.json.gz").write_bytes(gzip.compress(json.dumps({"steps": 7}).encode()))
    return model, back


def _install(back: Path, dest: Path, log: Path):
    return subprocess.run([sys.executable, str(SCRIPT), str(back), "--dest", str(dest), "--log-dest", str(log)],
                          capture_output=True, text=True, timeout=300)


def test_parts_are_joined_checked_and_installed(tmp_path):
    """The shipped model itself makes the round trip in 15 MiB parts, as the device's $OUT returns it."""
    model, back = _returned_files(tmp_path, REPO / "assets" / "model", part_bytes=15 * 2**20)
    assert len(list(back.glob("model.tar.part-*"))) > 1
    dest, log = tmp_path / "dest", tmp_path / "log.json"
    done = _install(back, dest, log)
    assert done.returncode == 0, done.stderr
    for f in model.iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes()
    assert json.loads(log.read_text()) == {"steps": 7}


def test_a_damaged_part_is_refused_and_the_old_model_kept(tmp_path):
    _, back = _returned_files(tmp_path)
    part = sorted(back.glob("model.tar.part-*"))[1]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    done = _install(back, dest, tmp_path / "log.json")
    assert done.returncode != 0
    assert "sha256 does not match" in done.stderr or "missing" in done.stderr
    assert (dest / "config.json").read_text() == "{}"
