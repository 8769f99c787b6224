"""The training corpus on disk: the held-out rule, the token-shard layout, and the trainer's loader.

A corpus build directory (written by scripts/corpus_code.py, on the device or anywhere) holds
    index.json          what is where: {"format", "train": [file, ...], "heldout": {domain: file},
                        "tokens": {file: count}, ...}
    train_*.npy         uint16 token streams: documents joined, each starting with <bos> (id 0)
    heldout_<domain>.npy the held-out documents of one domain ("code", "prose"), same layout
    manifest.json.gz    every document: source package, version, path, sha256, split, domain, tokens

The split is by document and never looks at content: sha256("<source>/<path>") read as a
big-endian integer, modulo 10000, below HELDOUT_PER_10000 means held out. The source is the
package name without its version, so a document keeps its split across package versions.

The prose pack (scripts/corpus_prose.py) is one xz file of UTF-8 documents, each followed by one
NUL byte, in the order of its manifest (assets/corpus/prose_manifest.json.gz); read_prose_pack checks
every document's sha256 against that manifest.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import re
from pathlib import Path

import numpy as np

HELDOUT_PER_10000 = 200  # 2 %
FORMAT = "v4flash-corpus-1"
BOS_ID = 0
DOC_END = b"\x00"


class CorpusDataError(ValueError):
    """A corpus directory or pack is missing, incomplete or does not match its manifest."""


def doc_key(source: str, path: str) -> str:
    """The name a document is split and ordered by: '<source>/<path>'."""
    return f"{source}/{path}"


def key_hash(key: str) -> int:
    """sha256 of the key as a big-endian integer (split bucket and build order)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest(), "big")


def split_of(source: str, path: str) -> str:
    """'heldout' or 'train' for one document, from its source and path alone."""
    return "heldout" if key_hash(doc_key(source, path)) % 10000 < HELDOUT_PER_10000 else "train"


def read_index(directory: Path) -> dict:
    """The index.json of a corpus build directory, checked for the files it names."""
    directory = Path(directory)
    path = directory / "index.json"
    if not path.is_file():
        raise CorpusDataError(f"{directory} is not a corpus build directory (no index.json); "
                              "build one with scripts/corpus_code.py")
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("format") != FORMAT:
        raise CorpusDataError(f"{path}: format {index.get('format')!r}, expected {FORMAT!r}")
    files = list(index["train"]) + list(index["heldout"].values())
    missing = [name for name in files if not (directory / name).is_file()]
    if missing:
        raise CorpusDataError(f"{directory}: index.json names missing files {missing[:4]}")
    return index


def shard_domain(name: str) -> str:
    """The domain of a train shard file named train_<domain>_<NNN>.npy."""
    match = re.fullmatch(r"train_(.+)_\d+\.npy", name)
    if not match:
        raise CorpusDataError(f"train shard {name!r} is not named train_<domain>_<NNN>.npy")
    return match.group(1)


def load_token_streams(dirs, repeat: dict[str, int] | None = None,
                       mmap: bool = True) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(train uint16 [N], {domain: held-out uint16 [M]}) from one or more corpus build directories.

    Train shards are concatenated in directory order, then index order, each shard of domain d
    `repeat[d]` times (default 1; 0 leaves the domain out), so that a trainer drawing windows
    uniformly sees that domain more often. Held-out streams of the same domain from several
    directories are concatenated. Every stream starts with <bos>."""
    if isinstance(dirs, (str, Path)):
        dirs = [dirs]
    repeat = repeat or {}
    train_parts: list[np.ndarray] = []
    heldout_parts: dict[str, list[np.ndarray]] = {}
    for directory in map(Path, dirs):
        index = read_index(directory)
        for name in index["train"]:
            times = int(repeat.get(shard_domain(name), 1))
            if times:
                train_parts.extend([_load_tokens(directory / name, mmap)] * times)
        for domain, name in sorted(index["heldout"].items()):
            heldout_parts.setdefault(domain, []).append(_load_tokens(directory / name, mmap))
    if not train_parts:
        raise CorpusDataError(f"no train shards in {list(map(str, dirs))}")
    train = np.concatenate(train_parts)
    heldout = {domain: np.concatenate(parts) for domain, parts in heldout_parts.items()}
    return train, heldout


def _load_tokens(path: Path, mmap: bool) -> np.ndarray:
    arr = np.load(path, mmap_mode="r" if mmap else None)
    if arr.dtype != np.uint16 or arr.ndim != 1:
        raise CorpusDataError(f"{path}: expected a 1-D uint16 token stream, got {arr.dtype} {arr.shape}")
    if arr.size and arr[0] != BOS_ID:
        raise CorpusDataError(f"{path}: a token stream must start with <bos> (id {BOS_ID})")
    return arr


def read_manifest(path: Path) -> dict:
    """A JSON manifest, gzipped when its name ends in .gz."""
    path = Path(path)
    if not path.is_file():
        raise CorpusDataError(f"no manifest at {path}")
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return json.loads(raw.decode("utf-8"))


def manifest_rows(manifest: dict) -> list[dict]:
    """The document rows of a manifest whose 'documents' is {'columns': [...], 'rows': [[...]]}."""
    columns = manifest["documents"]["columns"]
    return [dict(zip(columns, row)) for row in manifest["documents"]["rows"]]


def read_prose_pack(pack: Path, manifest: dict) -> list[tuple[dict, str]]:
    """[(manifest row, text)] of every document in an xz prose pack, checked against the manifest."""
    pack = Path(pack)
    if not pack.is_file():
        raise CorpusDataError(f"no prose pack at {pack}; build it with scripts/corpus_prose.py")
    try:
        raw = lzma.decompress(pack.read_bytes())
    except lzma.LZMAError as err:
        raise CorpusDataError(f"{pack} is not a readable xz file: {err}") from err
    if hashlib.sha256(raw).hexdigest() != manifest["pack"]["raw_sha256"]:
        raise CorpusDataError(f"{pack} does not match its manifest (raw sha256 differs); rebuild both")
    parts = raw.split(DOC_END)
    rows = manifest_rows(manifest)
    if parts[-1] != b"" or len(parts) - 1 != len(rows):
        raise CorpusDataError(f"{pack}: {len(parts) - 1} documents, manifest lists {len(rows)}")
    out = []
    for row, data in zip(rows, parts[:-1]):
        if hashlib.sha256(data).hexdigest() != row["sha256"]:
            raise CorpusDataError(f"{pack}: document {row['source']}/{row['path']} differs from the manifest")
        out.append((row, data.decode("utf-8")))
    return out
