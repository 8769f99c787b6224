"""Sessions as export files: the document format, and checking an imported one."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from .model import (
    _EDITABLE, EXPORT_FORMAT, EXPORT_VERSION, MAX_IMPORT_BYTES, InvalidSessionData, InvalidSessionFile, Session,
    SessionData, _iso, _now, _validate_field)

def session_to_export(session: Session) -> dict[str, Any]:
    """A JSON-able document: format marker, version, and the session's fields (probes as JSON)."""
    body = {f.name: getattr(session, f.name) for f in dataclasses.fields(SessionData)}
    body["id"] = session.id
    body["created_at"] = _iso(session.created_at)
    body["updated_at"] = _iso(session.updated_at)
    return {"format": EXPORT_FORMAT, "format_version": EXPORT_VERSION, "exported_at": _iso(_now()), "session": body}


def parse_export(document: str | bytes | Mapping[str, Any]) -> SessionData:
    """Validate an export document and return its content. Raises ``InvalidSessionFile``."""
    if isinstance(document, (bytes, bytearray)):
        if len(document) > MAX_IMPORT_BYTES:
            raise InvalidSessionFile(f"The file is too large for a session export (over {MAX_IMPORT_BYTES // 2**20} MiB).")
        try:
            document = bytes(document).decode("utf-8-sig")
        except UnicodeDecodeError:
            raise InvalidSessionFile("The file is not a session export: it is not UTF-8 text.") from None
    if isinstance(document, str):
        if len(document) > MAX_IMPORT_BYTES:
            raise InvalidSessionFile("The file is too large for a session export.")
        try:
            document = json.loads(document)
        except (ValueError, RecursionError) as exc:
            raise InvalidSessionFile(f"The file is not a session export: it is not valid JSON ({exc}).") from None
    if not isinstance(document, Mapping):
        raise InvalidSessionFile("The file is not a session export: it does not hold a JSON object.")
    if document.get("format") != EXPORT_FORMAT:
        raise InvalidSessionFile(
            f"The file is not a session export of this app (expected \"format\": \"{EXPORT_FORMAT}\")."
        )
    version = document.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidSessionFile("The session file has no valid \"format_version\".")
    if version > EXPORT_VERSION:
        raise InvalidSessionFile(
            f"The session file was made by a newer version of the app (format {version}; this app reads up to {EXPORT_VERSION})."
        )
    if version < 1:
        raise InvalidSessionFile(f"The session file has an unknown format version {version}.")
    body = document.get("session")
    if not isinstance(body, Mapping):
        raise InvalidSessionFile("The session file has no \"session\" object.")
    missing = [k for k in ("name", "author") if k not in body]
    if missing:
        raise InvalidSessionFile(f"The session file lacks {', '.join(missing)}.")
    values: dict[str, Any] = {}
    for name in _EDITABLE:
        if name not in body:
            continue
        try:
            values[name] = _validate_field(name, body[name])
        except InvalidSessionData as exc:
            raise InvalidSessionFile(f"The session file is damaged: {exc}") from None
    return SessionData(**values)
