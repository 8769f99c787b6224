"""Build the prose pack: English documentation from Debian packages, as one xz file of at most 12 MiB.

    python3 scripts/corpus_prose.py [--debs DIR] [--limit-mib 12] [--workers 2]

Each package in SOURCES is fetched with `apt-get download` (or taken from --debs, where a
`NAME_*.deb` already lies), unpacked with `dpkg -x` (nothing is installed), and the files its rules
name become documents: reStructuredText / POD / asciidoc / Markdown / info / plain text as they are,
HTML through html.parser (scripts/corpus_text.py), man pages rendered by groff, dictd dictionaries
cut at entry boundaries. A document's path is its path inside the package.

Each package gives at most its `cap` of text (documents in sha256("<package>/<path>") order, so a cap
samples the whole package); the caps are set so that the xz pack stays under --limit-mib.
The split is engine/corpus_data.split_of (by document), and documents that the earlier corpus
(assets/corpus/MANIFEST.json, python3.11-doc) held out stay held out.

Outputs:
- build/corpus_pack/prose.txt.xz: the documents in manifest order, each followed by one NUL byte;
- assets/corpus/prose_manifest.json.gz: packages (name, version, .deb sha256), every document
  (source, version, path, sha256 of its UTF-8 text, split, bytes, tokens), the pack's hashes;
- assets/corpus/heldout_prose.txt: ~200 KB of whole held-out documents.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import json
import lzma
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus_text import html_to_text, maybe_gunzip, render_man, split_dictionary  # noqa: E402
from engine.train.corpus_data import BOS_ID, DOC_END, key_hash, split_of  # noqa: E402

MIB = 1 << 20
# package -> (cap in MB of text, [(glob inside the package, kind)], [globs to leave out])
SOURCES: dict[str, tuple[float, list[tuple[str, str]], list[str]]] = {
    "python3.11-doc": (9, [("usr/share/doc/python3.11/html/_sources/**.rst.txt", "text")], []),
    "linux-doc-6.1": (9, [("usr/share/doc/linux-doc-6.1/html/_sources/**.rst.txt", "text")],
                      ["*/_sources/translations/*"]),
    "perl-doc": (4, [("usr/share/perl/5.36.0/pod/*.pod", "text")], ["*/perltoc.pod", "*/perlapi.pod",
                                                                    "*/perlintern.pod", "*/perl5*delta.pod"]),
    "postgresql-doc-15": (6, [("usr/share/doc/postgresql-doc-15/html/*.html", "html")], ["*/release-*.html"]),
    "git-doc": (3, [("usr/share/doc/git-doc/*.txt", "text")], []),
    "rust-doc": (8, [(f"usr/share/doc/rust-doc/html/{book}/**.html", "html") for book in (
        "book", "reference", "nomicon", "rust-by-example", "edition-guide", "cargo", "rustc", "embedded-book",
        "rustdoc")], ["*/print.html", "*/toc.html", "*/404.html", "*/first-edition/*", "*/second-edition/*",
                     "*/2018-edition/*"]),
    "python-django-doc": (5, [(f"usr/share/doc/python-django-doc/html/{part}/**.html", "html")
                              for part in ("intro", "topics", "howto", "ref", "faq", "internals", "misc")], []),
    "sphinx-doc": (1.5, [("usr/share/doc/sphinx-doc/html/_sources/**.txt", "text")], []),
    "cmake-doc": (0.8, [("usr/share/doc/cmake-data/html/_sources/**.rst.txt", "text")], []),
    "debian-handbook": (3, [("usr/share/doc/debian-handbook/html/en-US/*.html", "html")], []),
    "debian-policy": (1.5, [("usr/share/doc/debian-policy/*.txt.gz", "text")], []),
    "developers-reference": (1, [("usr/share/developers-reference/_sources/*.rst.txt", "text")], []),
    "debian-reference-en": (2, [("usr/share/debian-reference/*.en.html", "html")], []),
    "maint-guide": (0.5, [("usr/share/doc/maint-guide/html/*.en.html", "html")], []),
    "bash-doc": (1, [("usr/share/doc/bash/bash.html", "html")], []),
    "zsh-doc": (1, [("usr/share/doc/zsh-common/html/*.html", "html")], []),
    "nodejs-doc": (1, [("usr/share/doc/nodejs/api/*.md.gz", "text")], []),
    "vim-runtime": (1.5, [("usr/share/vim/vim90/doc/*.txt", "text")], []),
    "gnu-standards": (1, [("usr/share/info/*.info.gz", "text")], []),
    "gettext-doc": (0.5, [("usr/share/doc/gettext/*.html", "html")], []),
    "abs-guide": (1, [("usr/share/doc/abs-guide/html/*.html", "html")], []),
    "manpages": (1.5, [("usr/share/man/man*/*.gz", "man")], []),
    "manpages-dev": (1.5, [("usr/share/man/man*/*.gz", "man")], []),
    "libssl-doc": (0.5, [("usr/share/man/man*/*.gz", "man")], []),
    "dict-foldoc": (2, [("usr/share/dictd/foldoc.dict.dz", "dict")], []),
    "dict-jargon": (1, [("usr/share/dictd/jargon.dict.dz", "dict")], []),
    "dict-devil": (0.3, [("usr/share/dictd/devil.dict.dz", "dict")], []),
    "fortunes": (1.5, [("usr/share/games/fortunes/*", "text")], ["*.dat", "*.u8"]),
}
MIN_CHARS = 200
DICT_PART_CHARS = 60_000
SAMPLE_BYTES = 200_000
LEGACY_MANIFEST = REPO / "assets" / "corpus" / "MANIFEST.json"
LEGACY_PREFIX = ("python3.11-doc", "usr/share/doc/python3.11/html/_sources/", "pydoc/")


class ProseError(RuntimeError):
    """A package could not be fetched or unpacked; the message says what to do."""


def fetch(package: str, debs: Path) -> Path:
    """The .deb of `package` in debs, downloaded with apt-get when missing."""
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        result = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
        found = sorted(debs.glob(f"{package}_*.deb"))
        if result.returncode != 0 or not found:
            raise ProseError(f"`apt-get download {package}` failed ({result.stderr.strip()[-200:]}); "
                             "run `apt-get update` first, or put the .deb in --debs")
    return found[-1]


def deb_version(deb: Path) -> str:
    out = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _matches(rel: str, pattern: str) -> bool:
    # '**' in a rule spans folders; fnmatch's '*' does too, so one rule form covers both
    return fnmatch.fnmatchcase(rel, pattern.replace("**", "*"))


def package_documents(package: str, root: Path, rules, excludes) -> list[tuple[str, str]]:
    """[(path, text)] of one unpacked package, in path order."""
    docs = []
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    for path in files:
        rel = path.relative_to(root).as_posix()
        kinds = [kind for pattern, kind in rules if _matches(rel, pattern)]
        if not kinds or any(_matches(rel, ex) for ex in excludes):
            continue
        name, data = maybe_gunzip(rel, path.read_bytes())
        kind = kinds[0]
        if kind == "man":
            text = render_man(data)
        else:
            text = data.decode("utf-8", errors="replace")
            if "\ufffd" in text:
                text = data.decode("latin-1")
            if kind == "html":
                text = html_to_text(text)
        text = text.replace("\r\n", "\n").replace("\x00", "").strip("\n")
        if kind == "dict":
            docs.extend((f"{rel}#part{i:03d}", part) for i, part in enumerate(split_dictionary(text, DICT_PART_CHARS)))
        else:
            docs.append((rel, text))
    return [(p, t + "\n") for p, t in docs if len(t.strip()) >= MIN_CHARS]


def legacy_heldout() -> set[str]:
    """Paths (in this builder's naming) that the earlier corpus held out."""
    if not LEGACY_MANIFEST.is_file():
        return set()
    rows = json.loads(LEGACY_MANIFEST.read_text(encoding="utf-8"))["documents"]
    package, base, old = LEGACY_PREFIX
    return {f"{package}/{base}{r['path'][len(old):]}" for r in rows
            if r["split"] == "heldout" and r["path"].startswith(old)}


def select(package: str, version: str, docs: list[tuple[str, str]], cap_mb: float, legacy: set[str]) -> list[dict]:
    """The package's documents in key-hash order up to its cap, as manifest rows with text."""
    rows, used = [], 0
    for path, text in sorted(docs, key=lambda d: key_hash(f"{package}/{d[0]}")):
        size = len(text.encode("utf-8"))
        if used + size > cap_mb * 1e6:
            continue  # a smaller one later may still fit
        held = split_of(package, path) == "heldout" or f"{package}/{path}" in legacy
        rows.append({"source": package, "version": version, "path": path, "split": "heldout" if held else "train",
                     "bytes": size, "text": text})
        used += size
    rows.sort(key=lambda r: r["path"])  # pack order: neighbours alike, so xz finds more to share
    return rows


def gather(debs: Path, workers: int) -> tuple[list[dict], dict]:
    """Every selected document (rows with text) and the per-package record."""
    legacy = legacy_heldout()
    rows, packages = [], {}
    with tempfile.TemporaryDirectory(prefix="prose_") as tmp:
        def one(package):
            cap, rules, excludes = SOURCES[package]
            deb = fetch(package, debs)
            root = Path(tmp) / package
            subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
            docs = package_documents(package, root, rules, excludes)
            version = deb_version(deb)
            chosen = select(package, version, docs, cap, legacy)
            record = {"version": version, "deb": deb.name, "deb_sha256": hashlib.sha256(deb.read_bytes()).hexdigest(),
                      "documents_available": len(docs), "bytes_available": sum(len(t.encode()) for _, t in docs),
                      "documents_taken": len(chosen), "bytes_taken": sum(r["bytes"] for r in chosen), "cap_mb": cap}
            return package, chosen, record

        with ThreadPoolExecutor(max(1, workers)) as pool:
            for package, chosen, record in pool.map(one, sorted(SOURCES)):
                rows.extend(chosen)
                packages[package] = record
                print(f"  {package}: {record['documents_taken']}/{record['documents_available']} documents, "
                      f"{record['bytes_taken'] / 1e6:.2f}/{record['bytes_available'] / 1e6:.2f} MB", file=sys.stderr)
    return rows, packages


def tokenize_counts(rows: list[dict], tokenizer: Path) -> None:
    """Set row['tokens'] (with the <bos> each document gets) using the project's tokenizer."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tokenizer))
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    for start in range(0, len(rows), 1024):
        batch = rows[start:start + 1024]
        for row, enc in zip(batch, encode([r["text"] for r in batch], add_special_tokens=False)):
            row["tokens"] = len(enc.ids) + 1
    assert backend.token_to_id("<bos>") == BOS_ID


def heldout_sample(rows: list[dict], limit: int = SAMPLE_BYTES) -> str:
    """Whole held-out documents in key-hash order (packages mix) until `limit` bytes."""
    parts, used = [], 0
    heldout = [r for r in rows if r["split"] == "heldout"]
    for row in sorted(heldout, key=lambda r: key_hash(f"{r['source']}/{r['path']}")):
        if used + row["bytes"] + 1 > limit:
            continue
        parts.append(row["text"] + "\n")
        used += row["bytes"] + 1
    return "".join(parts)


def _first_line(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True)
    return (out.stdout or out.stderr).strip().split("\n")[0]


def build(args) -> dict:
    start = time.perf_counter()
    args.debs.mkdir(parents=True, exist_ok=True)
    rows, packages = gather(args.debs, args.workers)
    raw = b"".join(r["text"].encode("utf-8") + DOC_END for r in rows)
    packed = lzma.compress(raw, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                           preset=9 | lzma.PRESET_EXTREME)
    if len(packed) > args.limit_mib * MIB:
        raise ProseError(f"the pack is {len(packed) / MIB:.2f} MiB, over {args.limit_mib} MiB: "
                         "lower the caps in SOURCES")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prose.txt.xz").write_bytes(packed)
    tokenize_counts(rows, args.tokenizer)
    tokens = {s: sum(r["tokens"] for r in rows if r["split"] == s) for s in ("train", "heldout")}
    columns = ["source", "version", "path", "sha256", "split", "bytes", "tokens"]
    manifest = {
        "description": "Prose pack of the V4.1-Flash explorer's training corpus (scripts/corpus_prose.py)",
        "split_rule": "engine/corpus_data.split_of(package, path), or held out by assets/corpus/MANIFEST.json",
        "pack": {"file": "build/corpus_pack/prose.txt.xz", "format": "xz of UTF-8 documents, each followed by NUL",
                 "raw_bytes": len(raw), "raw_sha256": hashlib.sha256(raw).hexdigest(),
                 "xz_bytes": len(packed), "xz_sha256": hashlib.sha256(packed).hexdigest()},
        "tokenizer_sha256": hashlib.sha256(args.tokenizer.read_bytes()).hexdigest(),
        "tools": {"python": sys.version.split()[0], "groff": _first_line(["groff", "--version"]),
                  "liblzma": lzma.__name__ + " preset 9e"},
        "tokens": {**tokens, "all": sum(tokens.values())},
        "packages": packages,
        "documents": {"columns": columns, "rows": [
            [r["source"], r["version"], r["path"], hashlib.sha256(r["text"].encode("utf-8")).hexdigest(),
             r["split"], r["bytes"], r["tokens"]] for r in rows]},
    }
    sample = heldout_sample(rows)
    args.assets.mkdir(parents=True, exist_ok=True)
    (args.assets / "heldout_prose.txt").write_text(sample, encoding="utf-8")
    manifest["heldout_sample"] = {"file": "assets/corpus/heldout_prose.txt", "bytes": len(sample.encode("utf-8")),
                                  "sha256": hashlib.sha256(sample.encode("utf-8")).hexdigest()}
    manifest["seconds"] = round(time.perf_counter() - start, 1)
    with gzip.GzipFile(args.assets / "prose_manifest.json.gz", "wb", mtime=0) as handle:
        handle.write(json.dumps(manifest, separators=(",", ":")).encode("utf-8"))
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--debs", type=Path, default=REPO / "build" / "corpus_debs", help="where .deb files are kept")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "corpus_pack")
    parser.add_argument("--assets", type=Path, default=REPO / "assets" / "corpus")
    parser.add_argument("--limit-mib", type=float, default=12.0)
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--tokenizer", type=Path, default=REPO / "assets" / "tokenizer" / "tokenizer.json")
    args = parser.parse_args(argv)
    try:
        manifest = build(args)
    except ProseError as err:
        print(f"corpus_prose: {err}", file=sys.stderr)
        return 1
    pack = manifest["pack"]
    print(f"corpus_prose: {len(manifest['documents']['rows'])} documents, {pack['raw_bytes'] / 1e6:.1f} MB text -> "
          f"{pack['xz_bytes'] / MIB:.2f} MiB xz, tokens {manifest['tokens']} in {manifest['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
