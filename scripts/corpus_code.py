"""Build the code part of the corpus from installed Python distributions, or from their wheels.

    python3 scripts/corpus_code.py --out DIR [--workers 16] [--max-tokens N]
        [--from-wheels WHEELDIR | --path SITEDIR ...] [--only NAME ...]
        [--prose-pack build/corpus_pack/prose.txt.xz]

Every distribution that importlib.metadata finds (first one per name, in sys.path order), or every
*.whl in WHEELDIR, gives its files as listed by RECORD / the wheel: the path inside the wheel,
e.g. `torch/nn/modules/linear.py`. Kept: `*.py` (domain "code"), `*.md` / `*.rst` and the long
description in `*.dist-info/METADATA` (domain "prose"), except anything under a `tests`/`test`
folder, `test_*.py`, `*_test.py`, `conftest.py`, files over 1 MB, text that is not UTF-8, nearly
empty files and data-like files (mean line over 200 characters). An installed file whose bytes no
longer match its RECORD hash is dropped (a wheel would not give it back). Wheels fetched with
`pip download --no-deps NAME==VERSION` for the versions in the manifest give the same documents.

Identical files (same sha256) are kept once; the copy is held out when any of its paths is.
--prose-pack adds the whole prose pack (scripts/corpus_prose.py) first. Then documents are taken
in sha256("<source>/<path>") order (C/C++ after the rest, with --with-c) until --max-tokens train
tokens in all (so a cap samples every package; held-out documents are always taken), tokenized with
the project's tokenizer (<bos> before each document) on --workers threads, and written as described
in engine/train/corpus_data.py.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import json
import os
import re
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from email.parser import BytesParser
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from engine.train.corpus_data import (  # noqa: E402
    BOS_ID, FORMAT, CorpusDataError, doc_key, key_hash, read_manifest, read_prose_pack, split_of,
)

TOKENIZER = REPO / "assets" / "tokenizer" / "tokenizer.json"
PROSE_MANIFEST = REPO / "assets" / "corpus" / "prose_manifest.json.gz"
MAX_FILE_BYTES = 1_000_000
MIN_CHARS = 64
MAX_MEAN_LINE = 200
SHARD_TOKENS = 1 << 26
SKIP_DIRS = {"tests", "test", "__pycache__"}
PROSE_EXT = (".md", ".rst")
PY_EXT = (".py",)
C_EXT = (".h", ".hpp", ".hh", ".cuh", ".c", ".cc", ".cpp", ".cu")  # --with-c: the C/C++/CUDA sources and headers
BATCH_DOCS = 2048


class BuildError(RuntimeError):
    """The build cannot go on; the message says why and what to do."""


def canonical(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def domain_of(path: str, code_ext: tuple[str, ...] = PY_EXT) -> str | None:
    """'code', 'prose' or None (not taken) for a path inside a wheel."""
    parts = path.split("/")
    name = parts[-1]
    if len(parts) == 2 and parts[0].endswith(".dist-info"):
        return "prose" if name == "METADATA" else None
    if any(p in SKIP_DIRS or p.startswith("..") for p in parts[:-1]) or ".dist-info" in parts[0]:
        return None
    if name.endswith(code_ext):
        stem = name.rsplit(".", 1)[0]
        if stem.startswith("test_") or stem.endswith("_test") or name == "conftest.py":
            return None
        return "code"
    if name.endswith(PROSE_EXT) and not name.upper().startswith(("LICENSE", "COPYING", "AUTHORS")):
        return "prose"
    return None


def metadata_description(data: bytes) -> str:
    """The long description (README) of a METADATA file: its body, or its Description header."""
    message = BytesParser().parsebytes(data)
    body = message.get_payload()
    if isinstance(body, str) and body.strip():
        return body
    return str(message.get("Description", "") or "")


def document_text(path: str, data: bytes) -> tuple[str | None, str]:
    """(normalized text or None, reason) for the bytes of one file."""
    if len(data) > MAX_FILE_BYTES:
        return None, "over 1 MB"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    if path.endswith("/METADATA"):
        text = metadata_description(data)
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").strip("\n")
    if len(text.strip()) < MIN_CHARS:
        return None, "nearly empty"
    lines = text.count("\n") + 1
    if len(text) / lines > MAX_MEAN_LINE:
        return None, "data-like"
    return text + "\n", "kept"


def _record_hash_ok(entry, data: bytes) -> bool:
    if entry.hash is None or entry.hash.mode != "sha256":
        return True
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return digest == entry.hash.value


def installed_sources(paths: list[str] | None, only: set[str] | None, code_ext=PY_EXT) -> list[dict]:
    """[{name, version, origin, files: [(path, loader)]}] of the installed distributions."""
    import importlib.metadata as md

    found, skipped = {}, []
    dists = md.distributions(path=paths) if paths else md.distributions()
    for dist in dists:
        name = canonical(dist.metadata["Name"] or "")
        if not name or name in found or (only and name not in only):
            continue
        if dist.files is None:
            skipped.append(name)
            continue
        files = []
        for entry in dist.files:  # RECORD order; the build sorts by key later
            path = entry.as_posix()
            if domain_of(path, code_ext) is None:
                continue
            files.append((path, domain_of(path, code_ext), lambda e=entry: _read_installed(e)))
        found[name] = {"name": name, "version": dist.version, "origin": "installed", "files": files}
    if skipped:
        print(f"corpus_code: no RECORD, skipped: {', '.join(sorted(skipped))}", file=sys.stderr)
    return [found[n] for n in sorted(found)]


def _read_installed(entry) -> tuple[bytes | None, str]:
    try:
        data = Path(entry.locate()).read_bytes()
    except OSError:
        return None, "unreadable"
    if not _record_hash_ok(entry, data):
        return None, "differs from RECORD"
    return data, "ok"


def wheel_sources(wheel_dir: Path, only: set[str] | None, code_ext=PY_EXT) -> list[dict]:
    """The same records for every *.whl in wheel_dir (paths as installed: .data/purelib mapped)."""
    wheels = sorted(Path(wheel_dir).glob("*.whl"))
    if not wheels:
        raise BuildError(f"no *.whl in {wheel_dir}; fetch them with `pip download --no-deps NAME==VERSION`")
    found = {}
    for wheel in wheels:
        archive = zipfile.ZipFile(wheel)
        meta = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if not meta:
            raise BuildError(f"{wheel.name} has no .dist-info/METADATA: not a wheel")
        message = BytesParser().parsebytes(archive.read(meta[0]), headersonly=True)
        name = canonical(message["Name"])
        if name in found or (only and name not in only):
            continue
        files = []
        for member in sorted(archive.namelist()):
            path = re.sub(r"^[^/]+\.data/(purelib|platlib)/", "", member)
            if path != member or not re.match(r"^[^/]+\.data/", member):
                if domain_of(path, code_ext) is not None:
                    files.append((path, domain_of(path, code_ext), lambda a=archive, m=member: (a.read(m), "ok")))
        found[name] = {"name": name, "version": message["Version"], "origin": f"wheel {wheel.name}",
                       "files": files}
    return [found[n] for n in sorted(found)]


def collect(sources: list[dict], workers: int) -> tuple[list[dict], dict[str, int]]:
    """Read and filter every candidate file; return (documents, counts of skip reasons)."""
    jobs = [(src, path, domain, load) for src in sources for path, domain, load in src["files"]]

    def one(job):
        src, path, domain, load = job
        data, why = load()
        if data is None:
            return None, why
        text, why = document_text(path, data)
        if text is None:
            return None, why
        return {"source": src["name"], "version": src["version"], "path": path,
                "sha256": hashlib.sha256(data).hexdigest(), "domain": domain, "text": text}, why

    reasons: dict[str, int] = {}
    docs = []
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for doc, why in pool.map(one, jobs, chunksize=64):
            reasons[why] = reasons.get(why, 0) + 1
            if doc is not None:
                docs.append(doc)
    return docs, reasons


def dedupe_and_split(docs: list[dict]) -> tuple[list[dict], int]:
    """One document per sha256 (the smallest key), held out when any copy's key is; sorted by
    key hash, C/C++ last. Returns (documents, number of copies dropped)."""
    groups: dict[str, list[dict]] = {}
    for doc in docs:
        groups.setdefault(doc["sha256"], []).append(doc)
    kept = []
    for copies in groups.values():
        keys = [doc_key(d["source"], d["path"]) for d in copies]
        doc = copies[keys.index(min(keys))]
        held = any(split_of(d["source"], d["path"]) == "heldout" for d in copies)
        doc["split"] = "heldout" if held else "train"
        doc["copies"] = len(copies)
        kept.append(doc)
    # C/C++ after Python and prose, so that under a cap (--with-c) they only fill what is left
    kept.sort(key=lambda d: (d["path"].endswith(C_EXT), key_hash(doc_key(d["source"], d["path"]))))
    return kept, len(docs) - len(kept)


def load_backend(path: Path):
    from tokenizers import Tokenizer

    if not path.is_file():
        raise BuildError(f"no tokenizer at {path}")
    backend = Tokenizer.from_file(str(path))
    if backend.token_to_id("<bos>") != BOS_ID:
        raise BuildError(f"{path}: <bos> is not id {BOS_ID}")
    return backend


def tokenize(backend, docs: list[dict], max_tokens: int | None, always_heldout: bool = True):
    """Tokenize docs in order until max_tokens; held-out ones are taken even past the cap (they are
    few) when always_heldout. Sets doc['tokens'] and returns {split/domain: [uint16 arrays]}."""
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    streams: dict[tuple[str, str], list[np.ndarray]] = {}
    total, full = 0, False
    for start in range(0, len(docs), BATCH_DOCS):
        batch = docs[start:start + BATCH_DOCS]
        if full:
            batch = [d for d in batch if d["split"] == "heldout" and always_heldout]
        if not batch:
            continue
        encoded = encode([d["text"] for d in batch], add_special_tokens=False)
        for doc, enc in zip(batch, encoded):
            n = len(enc.ids) + 1
            if not full and max_tokens is not None and total + n > max_tokens and doc["split"] == "train":
                full = True  # the cap counts train tokens only
            if full and not (doc["split"] == "heldout" and always_heldout):
                continue
            ids = np.empty(n, dtype=np.uint16)
            ids[0] = BOS_ID
            ids[1:] = enc.ids
            streams.setdefault((doc["split"], doc["domain"]), []).append(ids)
            doc["tokens"] = n
            total += n if doc["split"] == "train" else 0
    return streams


def write_corpus(out: Path, streams: dict, docs: list[dict], meta: dict) -> dict:
    """Shards, held-out streams, manifest.json.gz and index.json; returns the index."""
    out.mkdir(parents=True, exist_ok=True)
    index = {"format": FORMAT, "train": [], "heldout": {}, "tokens": {}}
    location: dict[int, tuple[str, int]] = {}
    by_stream: dict[tuple[str, str], list[dict]] = {}
    for doc in docs:
        if "tokens" in doc:
            by_stream.setdefault((doc["split"], doc["domain"]), []).append(doc)
    for (split, domain), arrays in sorted(streams.items()):
        members = by_stream[(split, domain)]
        if split == "heldout":
            name = f"heldout_{domain}.npy"
            _save(out / name, arrays)
            index["heldout"][domain] = name
            offsets = np.cumsum([0] + [a.size for a in arrays[:-1]])
            for doc, off in zip(members, offsets):
                location[id(doc)] = (name, int(off))
            index["tokens"][name] = int(sum(a.size for a in arrays))
            continue
        shard, used, part = [], 0, 0
        for i, arr in enumerate(arrays):
            if shard and used + arr.size > SHARD_TOKENS:
                part = _flush(out, index, domain, part, shard)
                shard, used = [], 0
            location[id(members[i])] = (f"train_{domain}_{part:03d}.npy", used)
            shard.append(arr)
            used += arr.size
        _flush(out, index, domain, part, shard)
    columns = ["source", "version", "path", "sha256", "split", "domain", "copies", "tokens", "file", "offset"]
    rows = [[d["source"], d["version"], d["path"], d["sha256"], d["split"], d["domain"], d["copies"],
             d["tokens"], *location[id(d)]] for d in docs if "tokens" in d]
    manifest = {**meta, "documents": {"columns": columns, "rows": rows}}
    with gzip.GzipFile(out / "manifest.json.gz", "wb", mtime=0) as handle:
        handle.write(json.dumps(manifest, separators=(",", ":")).encode("utf-8"))
    index["summary"] = meta["summary"]
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    return index


def _save(path: Path, arrays: list[np.ndarray]) -> None:
    np.save(path, np.concatenate(arrays) if arrays else np.zeros(0, np.uint16))


def _flush(out: Path, index: dict, domain: str, part: int, shard: list[np.ndarray]) -> int:
    name = f"train_{domain}_{part:03d}.npy"
    _save(out / name, shard)
    index["train"].append(name)
    index["tokens"][name] = int(sum(a.size for a in shard))
    return part + 1


def prose_documents(pack: Path, manifest_path: Path) -> list[dict]:
    """The prose pack's documents as build records (split and order from the pack's manifest)."""
    manifest = read_manifest(manifest_path)
    docs = []
    for row, text in read_prose_pack(pack, manifest):
        docs.append({"source": row["source"], "version": row["version"], "path": row["path"],
                     "sha256": row["sha256"], "domain": "prose", "split": row["split"], "copies": 1,
                     "text": text, "pack": True})
    return docs


def write_sample(path: Path, docs: list[dict], limit: int) -> dict:
    """Whole held-out code documents (key-hash order, vendored copies left out) up to `limit` bytes in
    `path`, and the list of them in `path`.json; returns that list's record."""
    chosen, used = [], 0
    for doc in docs:
        if doc["split"] != "heldout" or doc["domain"] != "code" or "tokens" not in doc or doc["copies"] > 1:
            continue
        if re.search(r"(^|/)_?(vendor|vendored|extern|_distutils)(/|$)", doc["path"]):
            continue
        size = len(doc["text"].encode("utf-8")) + 1
        if used + size > limit:
            continue
        chosen.append(doc)
        used += size
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(d["text"] + "\n" for d in chosen), encoding="utf-8")
    record = {"file": path.name, "bytes": used, "layout": "whole documents, each followed by one blank line",
              "documents": [{"source": d["source"], "version": d["version"], "path": d["path"],
                             "sha256": d["sha256"], "tokens": d["tokens"]} for d in chosen]}
    path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return record


def summarize(docs: list[dict], sources: list[dict], reasons: dict, dropped: int, seconds: float) -> dict:
    taken = [d for d in docs if "tokens" in d]
    tokens: dict[str, int] = {}
    for d in taken:
        key = f"{d['split']}_{d['domain']}"
        tokens[key] = tokens.get(key, 0) + d["tokens"]
    return {"documents_taken": len(taken), "documents_candidate": len(docs), "duplicates_dropped": dropped,
            "files_by_reason": dict(sorted(reasons.items())), "tokens": dict(sorted(tokens.items())),
            "tokens_total": sum(tokens.values()), "text_bytes_taken": sum(len(d["text"].encode()) for d in taken),
            "text_bytes_candidate": sum(len(d["text"].encode()) for d in docs),
            "distributions": len(sources), "seconds": round(seconds, 2)}


def build(args) -> dict:
    start = time.perf_counter()
    only = {canonical(n) for n in args.only} if args.only else None
    code_ext = PY_EXT + (C_EXT if args.with_c else ())
    if args.from_wheels:
        sources = wheel_sources(args.from_wheels, only, code_ext)
    else:
        sources = installed_sources([str(p) for p in args.path] or None, only, code_ext)
    if not sources:
        raise BuildError("no distributions found (check --path / --only / --from-wheels)")
    docs, reasons = collect(sources, args.workers)
    docs, dropped = dedupe_and_split(docs)
    t_read = time.perf_counter() - start
    backend = load_backend(args.tokenizer)
    prose = prose_documents(args.prose_pack, args.prose_manifest) if args.prose_pack else []
    cap = args.max_tokens
    streams = tokenize(backend, prose, None)  # the whole pack: it is small and the only long prose
    used = sum(d["tokens"] for d in prose if d["split"] == "train")
    for key, arrays in tokenize(backend, docs, None if cap is None else max(0, cap - used)).items():
        streams.setdefault(key, []).extend(arrays)
    seconds = time.perf_counter() - start
    all_docs = prose + docs  # the order the streams were filled in
    meta = {
        "description": "Code part of the V4.1-Flash explorer's training corpus (scripts/corpus_code.py)",
        "split_rule": "int(sha256('<source>/<path>')) % 10000 < 200 -> heldout (engine/train/corpus_data.py); "
                      "identical files kept once, held out when any copy is",
        "distributions": [{"name": s["name"], "version": s["version"], "origin": s["origin"],
                           "pip": f"{s['name']}=={s['version']}"} for s in sources],
        "python": sys.version.split()[0],
        "tokenizer_sha256": hashlib.sha256(args.tokenizer.read_bytes()).hexdigest(),
        "max_tokens": cap, "read_seconds": round(t_read, 2),
        "summary": summarize(all_docs, sources, reasons, dropped, seconds),
    }
    index = write_corpus(args.out, streams, all_docs, meta)
    if args.sample_out:
        write_sample(args.sample_out, docs, args.sample_bytes)
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (created)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="cap on train tokens in all (held-out documents are always taken)")
    parser.add_argument("--from-wheels", type=Path, help="build from the *.whl files in this directory")
    parser.add_argument("--path", type=Path, action="append", default=[],
                        help="look for installed distributions here only (repeatable)")
    parser.add_argument("--only", action="append", default=[], help="only this distribution (repeatable)")
    parser.add_argument("--prose-pack", type=Path, help="also tokenize this prose pack (scripts/corpus_prose.py)")
    parser.add_argument("--prose-manifest", type=Path, default=PROSE_MANIFEST)
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    parser.add_argument("--with-c", action="store_true", help="also take C/C++/CUDA sources and headers")
    parser.add_argument("--sample-out", type=Path, help="also write whole held-out code documents to this .txt")
    parser.add_argument("--sample-bytes", type=int, default=200_000)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, args.workers)))
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        index = build(args)
    except (BuildError, CorpusDataError) as err:
        print(f"corpus_code: {err}", file=sys.stderr)
        return 1
    s = index["summary"]
    rate = s["tokens_total"] / max(s["seconds"], 1e-9)
    print(f"corpus_code: {s['documents_taken']} documents, tokens {s['tokens']} (total {s['tokens_total']}) "
          f"in {s['seconds']} s ({rate / 1e6:.2f} M tokens/s) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
