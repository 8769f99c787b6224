"""The corpus builders: the code part from installed distributions or their wheels (the same
documents either way), the split by document, the token shards and the prose pack's checks."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import lzma
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import corpus_code  # noqa: E402
from corpus_text import html_to_text, split_dictionary  # noqa: E402

from engine.train.corpus_data import (  # noqa: E402
    CorpusDataError, key_hash, load_token_streams, manifest_rows, read_manifest, read_prose_pack, split_of,
)

TOKENIZER = REPO / "assets" / "tokenizer" / "tokenizer.json"
CORE = "def area(width, height):\n    \"\"\"The area of a width by height rectangle, in square units.\"\"\"\n" \
       "    return width * height\n"


def _record_line(rel: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{rel},sha256={digest},{len(data)}"


def _fake_distribution(name: str, version: str, files: dict[str, bytes]) -> dict[str, bytes]:
    """All files of an installed distribution (dist-info included), relative to site-packages."""
    info = f"{name}-{version}.dist-info"
    metadata = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n"
                f"{name} is a small package made up for the corpus builder's tests; this paragraph is its "
                "long description, which the builder keeps as a prose document.\n").encode()
    out = dict(files)
    out[f"{info}/METADATA"] = metadata
    record = [_record_line(rel, data) for rel, data in sorted(out.items())] + [f"{info}/RECORD,,"]
    out[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    return out


@pytest.fixture(scope="module")
def fake_site(tmp_path_factory):
    """(site-packages dir, wheels dir, {name: files}) for two made-up distributions."""
    root = tmp_path_factory.mktemp("corpus")
    alpha = {
        "alpha/__init__.py": b'"""Alpha: a package of geometry helpers used to exercise the builder."""\n',
        "alpha/core.py": CORE.encode(),
        "alpha/copy_of_core.py": CORE.encode(),  # identical content: kept once
        "alpha/tests/test_core.py": b"def test_area():\n    assert area(2, 3) == 6  # long enough to count\n",
        "alpha/test_more.py": b"def test_more():\n    assert True  # a test module at the top level\n",
        "alpha/latin.py": "# caf\u00e9 au lait, written in Latin-1 rather than UTF-8 on purpose\n".encode("latin-1"),
        "alpha/big.py": b"X = 1  # padding\n" * 70_000,  # over 1 MB
        "alpha/empty.py": b"\n",
        "alpha/include/alpha.h": b"/* Alpha's C interface: the area of a rectangle, in square units. */\n"
                                 b"double alpha_area(double width, double height);\n",
        "alpha/README.md": b"# Alpha\n\nAlpha computes areas and perimeters of rectangles, for the tests.\n",
    }
    beta = {f"beta/mod_{i:03d}.py": (f'"""Module {i} of beta."""\n\n\ndef value_{i}(x):\n'
                                     f'    return x * {i} + {i % 7}  # a distinct body per module\n').encode()
            for i in range(120)}
    dists = {("Alpha", "1.0"): _fake_distribution("Alpha", "1.0", alpha),
             ("beta_pkg", "2.0"): _fake_distribution("beta_pkg", "2.0", beta)}
    site, wheels = root / "site", root / "wheels"
    wheels.mkdir()
    for (name, version), files in dists.items():
        for rel, data in files.items():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_bytes(data)
        with zipfile.ZipFile(wheels / f"{name}-{version}-py3-none-any.whl", "w") as whl:
            for rel, data in sorted(files.items()):
                whl.writestr(rel, data)
    return site, wheels, dists


def _build(out: Path, *extra: str) -> dict:
    assert corpus_code.main(["--out", str(out), "--workers", "2", *extra]) == 0
    return read_manifest(out / "manifest.json.gz")


def _npy_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.npy"))}


def test_installed_and_wheels_give_the_same_documents_and_tokens(fake_site, tmp_path):
    site, wheels, _ = fake_site
    installed = _build(tmp_path / "a", "--path", str(site))
    again = _build(tmp_path / "a2", "--path", str(site))
    from_wheels = _build(tmp_path / "w", "--from-wheels", str(wheels))
    assert installed["documents"] == from_wheels["documents"]
    assert _npy_bytes(tmp_path / "a") == _npy_bytes(tmp_path / "w")
    assert installed["documents"] == again["documents"]
    assert _npy_bytes(tmp_path / "a") == _npy_bytes(tmp_path / "a2")
    assert [d["pip"] for d in installed["distributions"]] == ["alpha==1.0", "beta-pkg==2.0"]


def test_filters_dedupe_and_split_by_document(fake_site, tmp_path):
    site, _, _ = fake_site
    manifest = _build(tmp_path / "a", "--path", str(site))
    rows = manifest_rows(manifest)
    paths = {r["path"] for r in rows}
    for dropped in ("alpha/tests/test_core.py", "alpha/test_more.py", "alpha/latin.py", "alpha/big.py",
                    "alpha/empty.py"):
        assert dropped not in paths
    assert {"alpha/README.md", "Alpha-1.0.dist-info/METADATA"} <= paths
    # two identical files: the smaller key stays ('copy_of_core' < 'core')
    assert "alpha/copy_of_core.py" in paths and "alpha/core.py" not in paths
    core = [r for r in rows if r["sha256"] == hashlib.sha256(CORE.encode()).hexdigest()]
    assert len(core) == 1 and core[0]["copies"] == 2
    reasons = manifest["summary"]["files_by_reason"]
    assert reasons["over 1 MB"] == 1 and reasons["not UTF-8"] == 1 and reasons["nearly empty"] == 1
    by_split = {s: {r["sha256"] for r in rows if r["split"] == s} for s in ("train", "heldout")}
    assert by_split["heldout"] and by_split["train"] and not (by_split["heldout"] & by_split["train"])
    for r in rows:
        if r["copies"] == 1:
            assert r["split"] == split_of(r["source"], r["path"])
    order = [key_hash(f"{r['source']}/{r['path']}") for r in rows]
    assert order == sorted(order)


def test_c_sources_only_with_c(fake_site, tmp_path):
    site, wheels, _ = fake_site
    plain = {r["path"] for r in manifest_rows(_build(tmp_path / "a", "--path", str(site)))}
    with_c = manifest_rows(_build(tmp_path / "c", "--from-wheels", str(wheels), "--with-c"))
    assert "alpha/include/alpha.h" not in plain
    assert [r["domain"] for r in with_c if r["path"] == "alpha/include/alpha.h"] == ["code"]
    assert plain == {r["path"] for r in with_c} - {"alpha/include/alpha.h"}


def test_token_streams_hold_each_document_after_bos(fake_site, tmp_path):
    site, _, dists = fake_site
    manifest = _build(tmp_path / "a", "--path", str(site))
    train, heldout = load_token_streams([tmp_path / "a"])
    backend = Tokenizer.from_file(str(TOKENIZER))
    files = {rel: data for d in dists.values() for rel, data in d.items()}
    rows = manifest_rows(manifest)
    for r in rows:
        stream = np.load(tmp_path / "a" / r["file"])
        piece = stream[r["offset"]:r["offset"] + r["tokens"]]
        if r["path"].endswith(".py"):
            expected = backend.encode(files[r["path"]].decode(), add_special_tokens=False).ids
            assert piece[0] == 0 and piece[1:].tolist() == expected
    n_train = sum(r["tokens"] for r in rows if r["split"] == "train")
    assert train.dtype == np.uint16 and train.size == n_train
    assert int((train == 0).sum()) == sum(1 for r in rows if r["split"] == "train")
    assert sum(a.size for a in heldout.values()) == sum(r["tokens"] for r in rows if r["split"] == "heldout")
    twice, _ = load_token_streams([tmp_path / "a"], repeat={"prose": 2})
    n_prose = sum(r["tokens"] for r in rows if r["split"] == "train" and r["domain"] == "prose")
    assert n_prose > 0 and twice.size == n_train + n_prose
    code_only, _ = load_token_streams([tmp_path / "a"], repeat={"prose": 0})
    assert code_only.size == n_train - n_prose


def test_max_tokens_takes_a_prefix_in_key_order(fake_site, tmp_path):
    site, _, _ = fake_site
    full = manifest_rows(_build(tmp_path / "full", "--path", str(site)))
    capped = manifest_rows(_build(tmp_path / "cap", "--path", str(site), "--max-tokens", "600"))
    train_full = [r["path"] for r in full if r["split"] == "train"]
    train_cap = [r["path"] for r in capped if r["split"] == "train"]
    assert 0 < len(train_cap) < len(train_full) and train_cap == train_full[:len(train_cap)]
    assert sum(r["tokens"] for r in capped if r["split"] == "train") <= 600
    heldout = [r["path"] for r in full if r["split"] == "heldout"]
    assert [r["path"] for r in capped if r["split"] == "heldout"] == heldout


def test_installed_file_changed_after_install_is_dropped(fake_site, tmp_path):
    site, _, _ = fake_site
    import shutil

    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    (copy / "beta/mod_005.py").write_text("def changed():\n    return 'edited after install, RECORD disagrees'\n")
    manifest = _build(tmp_path / "a", "--path", str(copy))
    assert "beta/mod_005.py" not in {r["path"] for r in manifest_rows(manifest)}
    assert manifest["summary"]["files_by_reason"]["differs from RECORD"] == 1


def _tiny_pack(tmp_path: Path, texts: dict[str, str]) -> tuple[Path, Path]:
    raw = b"".join(t.encode() + b"\x00" for t in texts.values())
    rows = [["pkg-doc", "1.0", p, hashlib.sha256(t.encode()).hexdigest(), split_of("pkg-doc", p), len(t), 0]
            for p, t in texts.items()]
    manifest = {"pack": {"raw_sha256": hashlib.sha256(raw).hexdigest()},
                "documents": {"columns": ["source", "version", "path", "sha256", "split", "bytes", "tokens"],
                              "rows": rows}}
    pack, man = tmp_path / "prose.txt.xz", tmp_path / "prose_manifest.json.gz"
    pack.write_bytes(lzma.compress(raw))
    man.write_bytes(gzip.compress(json.dumps(manifest).encode()))
    return pack, man


def test_prose_pack_is_checked_and_tokenized_with_the_code(fake_site, tmp_path):
    site, _, _ = fake_site
    texts = {f"doc/{i}.txt": f"Paragraph {i} of plain English prose, written for the pack test.\n" for i in range(60)}
    pack, man = _tiny_pack(tmp_path, texts)
    docs = read_prose_pack(pack, read_manifest(man))
    assert [t for _, t in docs] == list(texts.values())
    manifest = _build(tmp_path / "a", "--path", str(site), "--prose-pack", str(pack), "--prose-manifest", str(man))
    prose_rows = [r for r in manifest_rows(manifest) if r["source"] == "pkg-doc"]
    assert len(prose_rows) == 60 and all(r["domain"] == "prose" for r in prose_rows)
    bad = bytearray(lzma.decompress(pack.read_bytes()))
    bad[3] ^= 1
    pack.write_bytes(lzma.compress(bytes(bad)))
    with pytest.raises(CorpusDataError, match="does not match"):
        read_prose_pack(pack, read_manifest(man))


def test_html_to_text_drops_page_furniture_and_keeps_code_blocks():
    html = ("<html><head><title>T</title><style>p{}</style></head><body>"
            "<nav class='sidebar'><a>Chapter list</a></nav><DIV CLASS='NAVHEADER'>Prev Next</DIV>"
            "<h1>Ownership</h1><p>Rust   manages\nmemory.</p><pre>fn main() {\n    let s = 1;\n}</pre>"
            "<ul><li>one</li><li>two</li></ul><div class='footer'>Built with a tool</div></body></html>")
    assert html_to_text(html) == "Ownership\n\nRust manages memory.\n\nfn main() {\n    let s = 1;\n}\n\n- one\n- two"


def test_split_dictionary_cuts_at_entries_without_the_header():
    body = "00-database-info\n   header\n\nalpha\n   first entry text\n\nbeta\n   second entry\n\ngamma\n   third"
    parts = split_dictionary(body, part_chars=30)
    assert parts == ["alpha\n   first entry text\n\nbeta\n   second entry", "gamma\n   third"]


def test_prose_package_documents_caps_and_split(tmp_path):
    import corpus_prose

    root = tmp_path / "pkg"
    (root / "doc/html").mkdir(parents=True)
    (root / "doc/man/man1").mkdir(parents=True)
    para = "This sentence is ordinary English prose about a documentation package. " * 4
    for i in range(10, 40):  # two-digit numbers: every page the same size
        (root / f"doc/html/page{i:02d}.html").write_text(
            f"<html><body><div class='related'>Next page</div><p>Page {i}. {para}</p></body></html>")
    (root / "doc/notes.txt.gz").write_bytes(gzip.compress(f"Notes. {para}".encode()))
    (root / "doc/skip.txt").write_text(para)
    roff = f".TH DEMO 1\n.SH NAME\ndemo \\- prints a greeting\n.SH DESCRIPTION\n{para}\n"
    (root / "doc/man/man1/demo.1.gz").write_bytes(gzip.compress(roff.encode()))
    rules = [("doc/html/*.html", "html"), ("doc/*.txt*", "text"), ("doc/man/man*/*.gz", "man")]
    docs = dict(corpus_prose.package_documents("pkg", root, rules, ["*/skip.txt"]))
    pages = ["doc/html/page%02d.html" % i for i in range(10, 40)]
    assert sorted(docs) == pages + ["doc/man/man1/demo.1.gz", "doc/notes.txt.gz"]
    assert docs["doc/html/page13.html"] == f"Page 13. {para.strip()}\n"  # the 'related' bar left out
    assert docs["doc/notes.txt.gz"].startswith("Notes. This sentence")
    assert "demo - prints a greeting" in docs["doc/man/man1/demo.1.gz"]
    pages = [(p, t) for p, t in docs.items() if p.endswith(".html")]
    size = len(pages[0][1].encode())
    chosen = corpus_prose.select("pkg", "1.0", pages, cap_mb=10.5 * size / 1e6, legacy=set())
    assert sum(r["bytes"] for r in chosen) <= 10.5 * size and len(chosen) == 10
    by_hash = sorted((p for p in docs if p.endswith(".html")), key=lambda p: key_hash(f"pkg/{p}"))
    assert {r["path"] for r in chosen} == set(by_hash[:10])
    assert all(r["split"] == split_of("pkg", r["path"]) for r in chosen)
    held = corpus_prose.select("pkg", "1.0", list(docs.items()), 1.0, legacy={"pkg/doc/notes.txt.gz"})
    assert [r["split"] for r in held if r["path"] == "doc/notes.txt.gz"] == ["heldout"]
