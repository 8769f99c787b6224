"""Install a checkpoint that came back from scripts/device_train_call.sh as the shipped small model.

    python3 scripts/install_trained_model.py FILES_AT [--dest assets/model] [--log-dest FILE]

Joins the tar parts, checks every file against model.sha256, checks the checkpoint loads through the
engine and fits the 64 MiB budget, then replaces DEST (the old model's tokenizer and compressed vocab
files are kept: training does not change them) and copies train_log.json to assets/training/ (or --log-dest).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MAX_BYTES = 64 * 2**20


def join_parts(files_at: Path) -> bytes:
    parts = sorted(files_at.glob("model.tar.part-*"))
    if not parts:
        raise SystemExit(f"no model.tar.part-* under {files_at}: the device call exported nothing")
    return b"".join(p.read_bytes() for p in parts)


SHIPPED = REPO / "assets" / "model"


def expected_sums(files_at: Path) -> dict[str, str]:
    sums = {}
    for line in (files_at / "model.sha256").read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        sums[name.lstrip("*")] = digest
    return sums


def unpack(blob: bytes, into: Path, sums: dict[str, str]) -> Path:
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for member in tar.getmembers():
            if not member.isfile() or Path(member.name).parent.name != "model" or ".." in member.name:
                continue
            data = tar.extractfile(member).read()
            name = Path(member.name).name
            if hashlib.sha256(data).hexdigest() != sums.get(name):
                raise SystemExit(f"{name}: sha256 does not match model.sha256 (a part is missing or damaged)")
            (into / name).write_bytes(data)
    missing = set(sums) - {p.name for p in into.iterdir()}
    if missing:
        raise SystemExit(f"files listed in model.sha256 but not in the parts: {sorted(missing)}")
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files_at", type=Path)
    ap.add_argument("--dest", type=Path, default=REPO / "assets" / "model")
    ap.add_argument("--log-dest", type=Path, default=REPO / "assets" / "training" / "train_log.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        staged = unpack(join_parts(args.files_at), Path(tmp), expected_sums(args.files_at))
        for keep in ("tokenizer.json", "compressed_vocab.json"):  # the tokenizer stays the shipped one
            for source in (args.dest / keep, SHIPPED / keep):
                if source.exists() and not (staged / keep).exists():
                    shutil.copy2(source, staged / keep)
        size = sum(p.stat().st_size for p in staged.iterdir())
        if size > MAX_BYTES:
            raise SystemExit(f"the checkpoint is {size / 2**20:.1f} MiB, over the 64 MiB budget")
        from engine.run.api import load
        load(staged).run([0, 5, 6, 7])  # loads and runs, or raises with the engine's own message
        shutil.rmtree(args.dest, ignore_errors=True)
        shutil.copytree(staged, args.dest)
    log = args.files_at / "train_log.json.gz"
    if log.exists():
        args.log_dest.write_bytes(gzip.decompress(log.read_bytes()))
    print(f"installed {args.dest} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
