"""Session values, errors, validation and small helpers (no database code here)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import secrets
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

EXPORT_FORMAT = "v41-flash-explorer-session"
EXPORT_VERSION = 1
MAX_IMPORT_BYTES = 256 * 1024 * 1024

MAX_NAME = 200
MAX_AUTHOR = 100
MAX_NOTES = 50_000
MAX_PROMPT_CHARS = 200_000

_ID_RE = re.compile(r"^[A-Za-z0-9_-]{8,64}$")
_LAYER_WORD_RE = re.compile(r"^layer[:=](\d{1,5})$", re.IGNORECASE)


# ----------------------------------------------------------------------------------------------
# errors: each carries a message fit to show a user as is


class SessionError(Exception):
    """Base of every error this module raises on purpose; str(err) is a user-facing message."""


class SessionNotFound(SessionError):
    """No session with that id (never existed, malformed id, or deleted)."""

    def __init__(self, session_id: str, deleted: bool = False):
        self.session_id = session_id
        self.deleted = deleted
        shown = session_id if len(session_id) <= 64 else session_id[:64] + "..."
        if deleted:
            msg = f"Session {shown!r} was deleted."
        else:
            msg = f"No saved session has the id {shown!r}; the link may be wrong or out of date."
        super().__init__(msg)


class StoreUnavailable(SessionError):
    """The session database cannot be reached or used; nothing was changed."""


class SavedButUnreadable(StoreUnavailable):
    """The change was committed, but reading the session back failed: do not save it again."""

    def __init__(self, session_id: str, what: str, cause: Exception):
        self.session_id = session_id
        super().__init__(
            f"{what} (session id {session_id!r}), but reading it back failed: {cause} "
            "It is stored: do not save it again (that would make a duplicate); reopen it from the list."
        )


class DamagedSession(SessionError):
    """A stored row that cannot be read (damaged outside the app)."""

    def __init__(self, session_id: str, reason: str):
        self.session_id = session_id
        self.reason = reason
        super().__init__(f"The stored session {session_id!r} is damaged ({reason}) and cannot be opened.")


class InvalidSessionFile(SessionError):
    """An import file that is not a session export (or is damaged, or from a newer app)."""


class InvalidSessionData(SessionError):
    """A field given to save/update has the wrong type or is out of bounds."""


class SessionConflict(SessionError):
    """Someone else changed the session since it was loaded (revision mismatch)."""

    def __init__(self, session_id: str, expected: int, actual: int):
        self.session_id = session_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"Session {session_id!r} was changed by someone else (revision {actual}, you edited "
            f"revision {expected}). Reload it and apply your change again; nothing was overwritten."
        )


# ----------------------------------------------------------------------------------------------
# value objects


@dataclass(kw_only=True)
class SessionData:
    """What the user saves. ``probes`` is the engine's ``RunResult.to_json()`` dict (opaque here)."""

    name: str
    author: str
    notes: str = ""
    model_source: str = ""
    model_identity: str = ""
    engine_version: str = ""
    prompts: list[str] = field(default_factory=list)
    # token-span marks, e.g. {"prompt": 0, "start": 3, "end": 7, "label": "subject"}
    spans: list[dict[str, Any]] = field(default_factory=list)
    layer: int | None = None
    tab: str | None = None
    view: dict[str, Any] = field(default_factory=dict)
    probes: dict[str, Any] | None = None


@dataclass(kw_only=True)
class Session(SessionData):
    """A stored session. ``revision`` goes up by one on every change."""

    id: str
    created_at: datetime
    updated_at: datetime
    revision: int

    def data(self) -> SessionData:
        """The editable part, e.g. to save a copy."""
        return SessionData(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SessionData)})


@dataclass(frozen=True, kw_only=True)
class SessionSummary:
    """One row of a listing: no probes, no view settings."""

    id: str
    name: str
    author: str
    layer: int | None
    prompts: list[str]
    model_source: str
    notes_preview: str
    created_at: datetime
    updated_at: datetime
    revision: int


_EDITABLE = frozenset(f.name for f in dataclasses.fields(SessionData))


# ----------------------------------------------------------------------------------------------
# small helpers


def new_session_id() -> str:
    """A URL-safe, unguessable id (128 random bits)."""
    return secrets.token_urlsafe(16)


def is_valid_session_id(value: object) -> bool:
    """True when ``value`` looks like a session id (cheap check before touching the database)."""
    return isinstance(value, str) and bool(_ID_RE.match(value))


def model_identity(config: Mapping[str, Any] | bytes | str, checkpoint: Mapping[str, Any] | bytes | str | None) -> str:
    """A stable hash of the model config and the checkpoint's index/headers: ``"sha256:<hex>"``.

    Mappings are hashed as canonical JSON (sorted keys), so key order does not matter.
    """
    digest = hashlib.sha256()
    for part in (config, checkpoint):
        if part is None:
            blob = b"null"
        elif isinstance(part, bytes):
            blob = part
        elif isinstance(part, str):
            blob = part.encode("utf-8")
        else:
            blob = json.dumps(part, sort_keys=True, separators=(",", ":")).encode("utf-8")
        digest.update(len(blob).to_bytes(8, "big"))
        digest.update(blob)
    return "sha256:" + digest.hexdigest()


def compress_probes(probes: Mapping[str, Any] | None) -> bytes | None:
    """zlib-compressed compact JSON, or None."""
    if probes is None:
        return None
    raw = json.dumps(probes, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return zlib.compress(raw, 6)


def decompress_probes(blob: bytes | memoryview | None) -> dict[str, Any] | None:
    if blob is None:
        return None
    return json.loads(zlib.decompress(bytes(blob)).decode("utf-8"))


def default_sqlite_path() -> Path:
    """``EXPLORER_DB_PATH`` or ``$XDG_DATA_HOME/v41-flash-explorer/sessions.sqlite3``."""
    configured = os.environ.get("EXPLORER_DB_PATH")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "v41-flash-explorer" / "sessions.sqlite3"


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _iso(moment: datetime) -> str:
    # Fixed width, UTC: sorts as text identically on every backend.
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_iso(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)


def _prompt_search_text(prompts: Iterable[str]) -> str:
    return "\n".join(prompts)


# ----------------------------------------------------------------------------------------------
# validation


def _check_text(label: str, value: object, limit: int, *, required: bool = False) -> str:
    if not isinstance(value, str):
        raise InvalidSessionData(f"{label} must be text, got {type(value).__name__}.")
    if "\x00" in value:
        raise InvalidSessionData(f"{label} contains a NUL character.")
    _check_encodable(label, value)
    if required and not value.strip():
        raise InvalidSessionData(f"{label} must not be empty.")
    if len(value) > limit:
        raise InvalidSessionData(f"{label} is too long ({len(value)} characters, at most {limit}).")
    return value


def _check_encodable(label: str, text: str) -> None:
    """Refuse text that UTF-8 cannot hold (a lone UTF-16 surrogate, e.g. from a "\\ud800" escape in
    an imported file): the database and the probe compression would fail on it later."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidSessionData(
            f"{label} holds an invalid character (a lone surrogate, U+{ord(text[exc.start]):04X}, at "
            f"position {exc.start})."
        ) from None


def _json_able(label: str, value: object) -> None:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except RecursionError:
        raise InvalidSessionData(f"{label} is nested too deeply to store.") from None
    except (TypeError, ValueError) as exc:
        raise InvalidSessionData(f"{label} is not JSON data: {exc}.") from None
    _check_encodable(label, text)


def _validate_field(name: str, value: Any) -> Any:
    """Check one editable field; returns the (normalized) value."""
    if name == "name":
        return _check_text("The session name", value, MAX_NAME, required=True).strip()
    if name == "author":
        return _check_text("The author", value, MAX_AUTHOR, required=True).strip()
    if name == "notes":
        return _check_text("The notes", value, MAX_NOTES)
    if name in ("model_source", "model_identity", "engine_version"):
        return _check_text(name.replace("_", " ").capitalize(), value, 2_000)
    if name == "prompts":
        if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
            raise InvalidSessionData("Prompts must be a list of texts.")
        if sum(len(p) for p in value) > MAX_PROMPT_CHARS:
            raise InvalidSessionData(f"The prompts are too long (at most {MAX_PROMPT_CHARS} characters).")
        for p in value:
            _check_text("A prompt", p, MAX_PROMPT_CHARS)
        return list(value)
    if name == "spans":
        if not isinstance(value, (list, tuple)) or not all(isinstance(s, dict) for s in value):
            raise InvalidSessionData("Token-span marks must be a list of objects.")
        _json_able("The token-span marks", list(value))
        return [dict(s) for s in value]
    if name == "layer":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > 10_000:
            raise InvalidSessionData(f"The layer must be a non-negative whole number, got {value!r}.")
        return int(value)
    if name == "tab":
        if value is None:
            return None
        return _check_text("The tab", value, 200)
    if name == "view":
        if not isinstance(value, dict):
            raise InvalidSessionData("View settings must be an object.")
        _json_able("The view settings", value)
        return dict(value)
    if name == "probes":
        if value is None:
            return None
        if not isinstance(value, dict):
            raise InvalidSessionData("Probe results must be an object (the engine's RunResult.to_json()).")
        _json_able("The probe results", value)
        return value
    raise InvalidSessionData(f"Unknown session field {name!r}.")


def _validated(data: SessionData) -> SessionData:
    return SessionData(**{f: _validate_field(f, getattr(data, f)) for f in _EDITABLE})
