"""Hostile checkpoint folders in the app (issue 16), under Streamlit's AppTest: a folder whose config,
index, shard or tokenizer is a FIFO or a `/dev/zero` symlink, typed into the checkpoint-folder field
or named by a shared `?session=` link. Each run ends in bounded time with one message next to the
field naming the file and what it is; the rest of the page (plan, KV panel, sessions) still draws."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from explorer.sessions import SessionData, SessionStore
from tests.engine_helpers import write_tiny_checkpoint

APP = str(Path(__file__).resolve().parents[1] / "app.py")
BOUND_S = 30   # a run of this page takes ~1.5 s; a blocked open would run into AppTest's timeout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small release-layout checkpoint (no Engram, two shards)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_app_rel"), 3, 2, engram_layer_ids=(),
                                 engram_num_embeddings=(), max_seq_len=40)


@pytest.fixture
def root(tmp_path, monkeypatch):
    """The allowed root (AppTest listens like Streamlit's default: beyond localhost), a fresh SQLite
    session file, the release config as the page's first source."""
    monkeypatch.setenv("EXPLORER_CHECKPOINT_ROOT", str(tmp_path))
    monkeypatch.setenv("EXPLORER_SOURCE", "config")
    monkeypatch.setenv("EXPLORER_DB_PATH", str(tmp_path / "app.sqlite3"))
    for name in ("EXPLORER_DB_URL", "EXPLORER_RUN_JSON", "EXPLORER_CHECKPOINT", "EXPLORER_ENGINE_URL"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def hostile_copy(tiny: Path, root: Path, name: str, kind: str) -> tuple[Path, str]:
    """A copy of the checkpoint with `name` ("shard": its first shard) replaced by a FIFO or by a
    symlink to /dev/zero. Returns (folder, the replaced file's name)."""
    folder = root / "ckpt"
    shutil.copytree(tiny, folder)
    if name == "shard":
        name = sorted(folder.glob("*.safetensors"))[0].name
    target = folder / name
    target.unlink(missing_ok=True)
    if kind == "FIFO":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    return folder, name


def run(at: AppTest) -> AppTest:
    started = time.monotonic()
    at.run()
    assert time.monotonic() - started < BOUND_S
    assert not at.exception, [e.value for e in at.exception]
    return at


def the_one_message(at: AppTest, folder: Path, name: str, kind: str) -> str:
    """Exactly one error, in the sidebar beside the field, naming the file and what it is; none in the
    page; the page itself still drawn from the release config."""
    errors = [e.value for e in at.sidebar.error]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{name} in {folder} is {'a FIFO' if kind == 'FIFO' else 'a device'}"), errors
    assert "release config is shown" in errors[0]
    assert not at.main.error, [e.value for e in at.main.error]
    assert [t.value for t in at.title] == ["DeepSeek-V4.1-Flash explorer"]
    assert "### Layer plan" in "\n".join(m.value for m in at.markdown)                 # the plan
    assert any(m.label == "Total cache" for m in at.metric)                             # the KV panel
    assert "### Sessions" in "\n".join(m.value for m in at.sidebar.markdown)          # the sessions
    return errors[0]


@pytest.mark.parametrize("name, kind", [("config.json", "FIFO"), ("model.safetensors.index.json", "FIFO"),
                                        ("shard", "FIFO"), ("tokenizer.json", "FIFO"),
                                        ("config.json", "device"), ("shard", "device")])
def test_checkpoint_field_naming_a_folder_with_a_fifo_or_device(tiny, root, name, kind):
    folder, name = hostile_copy(tiny, root, name, kind)
    at = run(AppTest.from_file(APP, default_timeout=BOUND_S))
    at.sidebar.radio(key="source").set_value("path")
    run(at)
    at.sidebar.text_input(key="ckpt_path").input(str(folder))
    run(at)
    the_one_message(at, folder, name, kind)


@pytest.mark.parametrize("name, kind", [("shard", "FIFO"), ("config.json", "device")])
def test_session_link_naming_a_folder_with_a_fifo_or_device(tiny, root, name, kind):
    folder, name = hostile_copy(tiny, root, name, kind)
    with SessionStore(f"sqlite:///{root / 'app.sqlite3'}") as store:
        sid = store.save(SessionData(name="shared", author="t", model_source=str(folder), prompts=["Paris is"],
                                     layer=24, tab="reindex", view={"position": "total", "source": "path"})).id
    at = AppTest.from_file(APP, default_timeout=BOUND_S)
    at.query_params["session"] = sid
    run(at)
    assert at.sidebar.radio(key="source").value == "path"           # the link did name the folder
    assert at.sidebar.text_input(key="ckpt_path").value == str(folder)
    the_one_message(at, folder, name, kind)
    assert any(m.value == "**Session:** shared" for m in at.markdown)   # the session itself still opened
