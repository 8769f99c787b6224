"""What the page's URL holds besides the view: the model source (and checkpoint folder) and the
prompt. A short prompt travels in the URL itself; a long one is kept server-side as an unsaved
draft (one small file per prompt, named by its hash) and the URL holds the hash. Pure, apart from
the draft folder's files.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

SHORT_PROMPT = 600            # characters; longer prompts go through a draft
MAX_DRAFT_BYTES = 4 << 20     # a draft larger than this is not kept (the prompt box's text is far smaller)
DRAFT_ENV = "EXPLORER_DRAFT_DIR"
LINK_KEYS = ("source", "ckpt", "prompt", "draft")
_HASH = re.compile(r"^[0-9a-f]{20}$")


def draft_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get(DRAFT_ENV) or Path(tempfile.gettempdir()) / "v41-explorer-drafts")


def draft_id(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:20]


def save_draft(text: str, folder: Path) -> str | None:
    """Keep `text` as a draft; returns its id, or None when it cannot be kept (too large, no folder)."""
    data = text.encode("utf-8")
    if len(data) > MAX_DRAFT_BYTES:
        return None
    key = draft_id(text)
    target = folder / f"{key}.txt"
    if target.exists():
        return key
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, target)   # whole or nothing: a reader never sees half a draft
    except OSError:
        return None
    return key


def load_draft(key: str, folder: Path) -> str | None:
    """The draft's text, or None (a malformed id, or not on this server)."""
    if not _HASH.match(key or ""):
        return None
    try:
        text = (folder / f"{key}.txt").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if draft_id(text) == key else None


def link_params(source: str, ckpt: str, text: str, folder: Path) -> dict[str, str]:
    """The URL's source, checkpoint folder (path source only) and prompt (or draft id)."""
    out = {"source": source}
    if source == "path" and ckpt:
        out["ckpt"] = ckpt
    if text and len(text) <= SHORT_PROMPT:
        out["prompt"] = text
    elif text:
        key = save_draft(text, folder)
        if key:
            out["draft"] = key
    return out


def prompt_from_link(query: Mapping[str, str], folder: Path) -> tuple[str | None, str | None]:
    """(prompt text or None, a problem to show or None) from a link's `prompt` or `draft`."""
    if "prompt" in query:
        return query["prompt"], None
    if "draft" in query:
        text = load_draft(query["draft"], folder)
        if text is None:
            return None, "The link's draft prompt is not on this server (drafts are not saved sessions); " \
                         "the default prompt is shown."
        return text, None
    return None, None


def source_from_link(query: Mapping[str, str], env: Mapping[str, str], options: list[str],
                     fallback: str) -> str:
    """The link's source wins over EXPLORER_SOURCE (the server's default), which wins over `fallback`."""
    for candidate in (query.get("source"), env.get("EXPLORER_SOURCE")):
        if candidate in options:
            return candidate
    return fallback
