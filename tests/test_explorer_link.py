"""The URL's source and prompt (explorer/link.py) and the checkpoint field's checks
(explorer/checkpoint_path.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from explorer import checkpoint_path as cp, link

RELEASE = Path(__file__).resolve().parents[1] / "assets" / "configs" / "v41-flash.json"


def test_short_prompt_in_the_link_long_one_through_a_draft(tmp_path):
    short = "The capital of France is"
    assert link.link_params("shipped", "", short, tmp_path) == {"source": "shipped", "prompt": short}
    long = "word " * 4000                                   # 20,000 characters
    params = link.link_params("config", "", long, tmp_path)
    key = hashlib.sha256(long.encode()).hexdigest()[:20]
    assert params == {"source": "config", "draft": key}
    assert (tmp_path / f"{key}.txt").read_text() == long
    assert link.prompt_from_link(params, tmp_path) == (long, None)
    assert link.prompt_from_link({"prompt": short}, tmp_path) == (short, None)
    assert link.prompt_from_link({}, tmp_path) == (None, None)
    # the path source keeps its folder; other sources do not carry one
    assert link.link_params("path", "/data/ckpt", "", tmp_path) == {"source": "path", "ckpt": "/data/ckpt"}
    assert link.link_params("shipped", "/data/ckpt", "", tmp_path) == {"source": "shipped"}


def test_drafts_refuse_odd_ids_and_altered_files(tmp_path):
    key = link.save_draft("x" * 1000, tmp_path)
    for bad in ("../../etc/passwd", key.upper(), key[:-1], ""):
        assert link.load_draft(bad, tmp_path) is None
    (tmp_path / f"{key}.txt").write_text("changed")       # a file that is not what its name says
    assert link.load_draft(key, tmp_path) is None
    text, problem = link.prompt_from_link({"draft": "0" * 20}, tmp_path)
    assert text is None and "not on this server" in problem
    assert link.save_draft("y" * (link.MAX_DRAFT_BYTES + 1), tmp_path) is None


def test_source_from_link_wins_over_the_server_default():
    options = ["shipped", "path", "config"]
    assert link.source_from_link({"source": "config"}, {"EXPLORER_SOURCE": "shipped"}, options, "shipped") == "config"
    assert link.source_from_link({}, {"EXPLORER_SOURCE": "path"}, options, "shipped") == "path"
    assert link.source_from_link({"source": "nope"}, {}, options, "shipped") == "shipped"


def test_listening_address_and_roots(tmp_path):
    assert cp.listens_publicly(None) and cp.listens_publicly("0.0.0.0") and cp.listens_publicly("10.1.2.3")
    assert not cp.listens_publicly("127.0.0.1") and not cp.listens_publicly("localhost")
    assert not cp.listens_publicly("[::1]")
    assert cp.allowed_roots({"EXPLORER_CHECKPOINT_ROOT": "/a:/b"}, public=False) is None
    assert cp.allowed_roots({"EXPLORER_CHECKPOINT_ROOT": f"{tmp_path}:/b"}, public=True) == [tmp_path.resolve(),
                                                                                           Path("/b")]
    # unset: only the server's own default checkpoint folder
    assert cp.allowed_roots({"EXPLORER_CHECKPOINT": str(tmp_path)}, public=True) == [tmp_path.resolve()]
    assert cp.allowed_roots({}, public=True) == []


def test_checkpoint_problems(tmp_path):
    good = tmp_path / "ckpt"
    good.mkdir()
    (good / "config.json").write_text(RELEASE.read_text())
    assert cp.checkpoint_problem(str(good), None) is None
    assert cp.checkpoint_problem(str(good), [tmp_path]) is None
    assert cp.checkpoint_problem("/does/not/exist", None) == "No folder at /does/not/exist."
    assert "is a file" in cp.checkpoint_problem(str(good / "config.json"), None)
    assert "No config.json" in cp.checkpoint_problem(str(tmp_path), None)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"secret": "token-123"}))
    msg = cp.checkpoint_problem(str(bad), None)
    assert "not a model config" in msg and "token-123" not in msg and "secret" not in msg
    # outside the roots: refused before reading, whatever is there; '..' and symlinks cannot climb out
    for outside in ("/etc/passwd", "/does/not/exist", str(good / ".." / ".." )):
        assert "allowed roots" in cp.checkpoint_problem(outside, [good])
    link_out = good / "escape"
    link_out.symlink_to("/etc")
    assert "allowed roots" in cp.checkpoint_problem(str(link_out), [good])
