"""The sidebar's checkpoint-folder field: is this path a checkpoint the app may read? Pure (no
Streamlit); the app shows the answer next to the field and keeps the rest of the page.

The field reads a server path. When the app listens beyond localhost, it is confined to allowed
roots: EXPLORER_CHECKPOINT_ROOT (folders separated by ':'), or, unset, only the folder named by
EXPLORER_CHECKPOINT (and what lies under it). A refused path is refused before the file system is
touched, and messages never quote what a file holds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from engine.config import ConfigError, load_config
from engine.safe_io import not_regular

ROOT_ENV = "EXPLORER_CHECKPOINT_ROOT"
# the files the app reads from a checkpoint folder (besides its *.safetensors shards)
CHECKPOINT_FILES = ("config.json", "model.safetensors.index.json", "tokenizer.json", "compressed_vocab.json")
LOCAL_ADDRESSES = {"localhost", "127.0.0.1", "::1"}


def listens_publicly(server_address: str | None) -> bool:
    """Streamlit listens on every interface unless server.address names a loopback address."""
    return (server_address or "").strip().strip("[]") not in LOCAL_ADDRESSES


def allowed_roots(env: Mapping[str, str], public: bool) -> list[Path] | None:
    """The folders the field may read under, or None for anywhere (a local-only app)."""
    if not public:
        return None
    raw = env.get(ROOT_ENV, "") or env.get("EXPLORER_CHECKPOINT", "")
    return [Path(os.path.realpath(p)) for p in raw.split(os.pathsep) if p.strip()]


def checkpoint_problem(path: str, roots: list[Path] | None) -> str | None:
    """Why `path` is not a checkpoint folder this app can read, in one line; None if it is."""
    if not path:
        return "Enter a checkpoint folder."
    real = Path(os.path.realpath(path))   # symlinks and '..' resolved before the root check
    if roots is not None and not any(real == root or root in real.parents for root in roots):
        where = ", ".join(str(r) for r in roots) or "none set"
        return (f"This app serves other machines, so it reads checkpoints only under the allowed roots "
                f"({ROOT_ENV}: {where}).")
    if not real.exists():
        return f"No folder at {path}."
    if not real.is_dir():
        return f"{path} is a file: enter the checkpoint folder (the one that holds config.json)."
    problem = odd_file(real, path)
    if problem:
        return problem
    if not (real / "config.json").is_file():
        return f"No config.json in {path}: not a checkpoint folder."
    try:
        load_config(real)
    except ConfigError:
        return f"The config.json in {path} is not a model config this explorer reads."
    except OSError as err:
        return f"Cannot read {path}: {err.strerror or 'not readable'}."
    return None


def odd_file(real: Path, path: str) -> str | None:
    """The first of the folder's checkpoint files that is there but not a regular file (a FIFO would
    block the read that opens it, /dev/zero never ends), named in one line; found by stat alone."""
    shards = sorted(p.name for p in real.glob("*.safetensors"))
    for name in (*CHECKPOINT_FILES, *shards):
        kind = not_regular(real / name)
        if kind:
            return f"{name} in {path} is {kind}, not a plain file: a checkpoint folder holds regular files only."
    return None
