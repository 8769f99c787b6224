"""Build the offline text corpus (train / held-out split) and its manifest.

This is the small corpus the tokenizer (assets/tokenizer/) and the first shipped model were made
from. The large training corpus is built by scripts/corpus_prose.py (Debian documentation, here) and
scripts/corpus_code.py (installed PyPI distributions, on the device); see notes/corpus.md.

Sources, both rebuildable on any Debian machine without network beyond the package mirror:
- the reStructuredText sources of the Python documentation shipped in Debian's `python3.11-doc`
  (`usr/share/doc/python3.11/html/_sources/**/*.rst.txt`), fetched with `apt-get download` and
  unpacked with `dpkg -x` (nothing is installed);
- the CPython standard library `.py` sources of the running interpreter, without `site-packages`
  and without any `test` / `tests` package.

Outputs:
- build/corpus/train.txt, build/corpus/heldout.txt: documents in sorted path order, each followed by
  one blank line; the manifest gives each document's byte offset and length in its split file.
- assets/corpus/MANIFEST.json: package name+version, python version, every document's path, sha256
  (of its UTF-8 text exactly as written), split, offset, length; total bytes per split.
- assets/corpus/heldout_sample.txt: ~200 KB of held-out documents, taken in sha256(path) order so
  prose and code mix (whole documents, plus at most one truncated at a line boundary).

The split is by document: sha256(path) read as a big-endian integer, modulo 10000, below
HELDOUT_PER_10000 means held out. It never depends on content, so edits to a file do not move it.

Usage: python scripts/build_corpus.py [--deb FILE.deb] [--include-stdlib-tests] [--skip-tokenizer]
Then (unless --skip-tokenizer) the BPE tokenizer is trained on train.txt (scripts/train_tokenizer.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC_PACKAGE = "python3.11-doc"
DOC_SOURCES = "usr/share/doc/python3.11/html/_sources"
HELDOUT_PER_10000 = 200  # 2 %
SAMPLE_BYTES = 200_000
SEPARATOR = "\n\n"
STDLIB_SKIP = ("site-packages", "test", "tests", "idle_test", "__pycache__")


class CorpusError(RuntimeError):
    """A corpus source could not be obtained; the message says what to do."""


def split_of(path: str) -> str:
    """'heldout' or 'train', from the hash of the document path alone."""
    bucket = int.from_bytes(hashlib.sha256(path.encode("utf-8")).digest(), "big") % 10000
    return "heldout" if bucket < HELDOUT_PER_10000 else "train"


def normalize_text(text: str) -> str:
    """Unix newlines, no BOM, exactly one trailing newline."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    return text.rstrip("\n") + "\n"


def fetch_doc_package(workdir: Path, deb: Path | None) -> tuple[Path, str, str]:
    """Unpack the docs .deb into workdir; return (unpacked root, package name, version)."""
    if deb is None:
        cmd = ["apt-get", "download", DOC_PACKAGE]
        result = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
        if result.returncode != 0:
            raise CorpusError(
                f"`{' '.join(cmd)}` failed ({result.stderr.strip()[-300:]}). "
                "Run `apt-get update` first, or pass --deb with a local copy of the package."
            )
        debs = sorted(workdir.glob(f"{DOC_PACKAGE}_*.deb"))
        if not debs:
            raise CorpusError(f"apt-get download left no {DOC_PACKAGE}_*.deb in {workdir}")
        deb = debs[-1]
    if not deb.is_file():
        raise CorpusError(f"no such .deb file: {deb}")
    fields = subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Package", "Version"], capture_output=True, text=True, check=True
    ).stdout
    meta = dict(line.split(": ", 1) for line in fields.strip().splitlines())
    root = workdir / "unpacked"
    subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    return root, meta["Package"], meta["Version"]


def doc_documents(root: Path) -> dict[str, str]:
    """{'pydoc/<relative path>': text} for every .rst.txt source of the docs."""
    base = root / DOC_SOURCES
    if not base.is_dir():
        raise CorpusError(f"{DOC_SOURCES} missing from the unpacked package")
    docs = {}
    for path in sorted(base.rglob("*.rst.txt")):
        rel = path.relative_to(base).as_posix()
        docs[f"pydoc/{rel}"] = normalize_text(path.read_text(encoding="utf-8"))
    return docs


def stdlib_documents(include_tests: bool = False) -> tuple[dict[str, str], Path]:
    """{'stdlib/<relative path>': text} for the interpreter's stdlib .py files, tests excluded
    unless include_tests (which adds about 19 MB)."""
    base = Path(sysconfig.get_paths()["stdlib"])
    skipped = ("site-packages", "__pycache__") if include_tests else STDLIB_SKIP
    docs = {}
    for dirpath, dirnames, filenames in os.walk(base):
        rel_dir = Path(dirpath).relative_to(base)
        skip_dir = lambda name: name in skipped or (rel_dir == Path(".") and name.startswith("config-"))
        dirnames[:] = sorted(d for d in dirnames if not skip_dir(d))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                with tokenize.open(path) as handle:  # honours PEP 263 coding cookies
                    text = handle.read()
            except (SyntaxError, UnicodeDecodeError):
                continue  # a deliberately undecodable file: not text we want
            docs[f"stdlib/{(rel_dir / name).as_posix()}"] = normalize_text(text)
    return docs, base


def write_splits(docs: dict[str, str], out_dir: Path) -> list[dict]:
    """Write train.txt / heldout.txt in sorted path order; return the manifest rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    handles = {split: open(out_dir / f"{split}.txt", "wb") for split in ("train", "heldout")}
    offsets = {"train": 0, "heldout": 0}
    rows = []
    try:
        for path in sorted(docs):
            split = split_of(path)
            data = docs[path].encode("utf-8")
            handles[split].write(data + SEPARATOR[1:].encode())  # text ends in "\n": one blank line
            rows.append(
                {
                    "path": path,
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "split": split,
                    "offset": offsets[split],
                    "bytes": len(data),
                }
            )
            offsets[split] += len(data) + 1
    finally:
        for handle in handles.values():
            handle.close()
    return rows


def heldout_sample(docs: dict[str, str], rows: list[dict], limit: int = SAMPLE_BYTES) -> str:
    """Whole held-out documents in sha256(path) order until `limit` bytes, the last cut at a line end."""
    parts, used = [], 0
    heldout = [r for r in rows if r["split"] == "heldout"]
    for row in sorted(heldout, key=lambda r: hashlib.sha256(r["path"].encode("utf-8")).digest()):
        text = docs[row["path"]] + "\n"
        size = len(text.encode("utf-8"))
        if used + size > limit:
            room = text.encode("utf-8")[: limit - used].decode("utf-8", errors="ignore")
            cut = room.rfind("\n")
            if cut > 0:
                parts.append(room[: cut + 1])
            break
        parts.append(text)
        used += size
    return "".join(parts)


def build(deb: Path | None, out_dir: Path, assets: Path, include_tests: bool = False) -> dict:
    """Collect both sources, write the splits, the sample and the manifest; return the manifest."""
    with tempfile.TemporaryDirectory(prefix="corpus_") as tmp:
        root, package, version = fetch_doc_package(Path(tmp), deb)
        docs = doc_documents(root)
    stdlib, _ = stdlib_documents(include_tests)
    docs.update(stdlib)
    rows = write_splits(docs, out_dir)
    totals = {s: sum(r["bytes"] + 1 for r in rows if r["split"] == s) for s in ("train", "heldout")}
    manifest = {
        "description": "Corpus for the V4.1-Flash explorer's small models; rebuild with scripts/build_corpus.py",
        "sources": {
            "docs": {"package": package, "version": version, "files": f"{DOC_SOURCES}/**/*.rst.txt"},
            "stdlib": {
                "python_version": sys.version.split()[0],
                "implementation": sys.implementation.name,
                "root": "sysconfig stdlib path; *.py, without site-packages"
                + ("" if include_tests else ", test/, tests/, idle_test/"),
            },
        },
        "split_rule": f"int(sha256(path)) % 10000 < {HELDOUT_PER_10000} -> heldout",
        "layout": "documents in sorted path order, each followed by one blank line; offset/bytes locate "
        "a document's text in its split file; sha256 is of those bytes",
        "n_documents": {s: sum(1 for r in rows if r["split"] == s) for s in ("train", "heldout")},
        "total_bytes": {**totals, "all": sum(totals.values())},
        "documents": rows,
    }
    sample = heldout_sample(docs, rows)
    assets.mkdir(parents=True, exist_ok=True)
    (assets / "heldout_sample.txt").write_text(sample, encoding="utf-8")
    manifest["heldout_sample"] = {
        "file": "assets/corpus/heldout_sample.txt",
        "bytes": len(sample.encode("utf-8")),
        "sha256": hashlib.sha256(sample.encode("utf-8")).hexdigest(),
    }
    (assets / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deb", type=Path, help=f"local {DOC_PACKAGE} .deb instead of apt-get download")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "corpus")
    parser.add_argument("--assets", type=Path, default=REPO / "assets" / "corpus")
    parser.add_argument("--include-stdlib-tests", action="store_true",
                        help="also take the stdlib's test packages (about 19 MB more; not the default)")
    parser.add_argument("--skip-tokenizer", action="store_true", help="do not train the tokenizer afterwards")
    args = parser.parse_args(argv)
    try:
        manifest = build(args.deb, args.out, args.assets, args.include_stdlib_tests)
    except CorpusError as err:
        print(f"build_corpus: {err}", file=sys.stderr)
        return 1
    print(
        f"corpus: {manifest['n_documents']} documents, bytes {manifest['total_bytes']} -> {args.out}",
        file=sys.stderr,
    )
    if not args.skip_tokenizer:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import train_tokenizer

        return train_tokenizer.main([str(args.out / "train.txt")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
