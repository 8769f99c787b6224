"""Stored rows back into sessions and listing rows, refusing values the app never wrote."""

from __future__ import annotations

import json
import zlib
from typing import Any

from .model import (DamagedSession, Session, SessionSummary, StoreUnavailable, _parse_iso, decompress_probes)


class SessionList(list):
    """``list_sessions``' result: the readable sessions, plus ``damaged`` (a ``DamagedSession`` for
    each row that was skipped because it cannot be read)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.damaged: list[DamagedSession] = []


def _row_state(row: Any) -> dict[str, Any]:
    try:
        state = json.loads(row.state_json)
    except ValueError:
        raise ValueError("its state is not valid JSON") from None
    if not isinstance(state, dict):
        raise ValueError("its state is not a JSON object")
    if not isinstance(state.get("prompts", []), list):
        raise ValueError("its prompts are not a list")
    return state


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a text column holds {type(value).__name__}")
    return value


def _layer(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"the layer column holds {value!r}")
    return value


def session_from_row(row: Any, *, with_probes: bool = True) -> Session:
    try:
        probes = decompress_probes(row.probes) if with_probes else None
    except (zlib.error, ValueError, RecursionError) as exc:
        raise StoreUnavailable(f"The stored probe results of session {row.id!r} are damaged ({exc}).") from None
    try:
        state = _row_state(row)
        return Session(
            id=row.id,
            name=_text(row.name),
            author=_text(row.author),
            notes=_text(row.notes),
            model_source=_text(row.model_source),
            model_identity=_text(row.model_identity),
            engine_version=_text(row.engine_version),
            prompts=[_text(p) for p in state.get("prompts", [])],
            spans=list(state.get("spans", [])),
            layer=_layer(row.layer),
            tab=state.get("tab"),
            view=dict(state.get("view", {})),
            probes=probes,
            created_at=_parse_iso(row.created_at),
            updated_at=_parse_iso(row.updated_at),
            revision=int(row.revision),
        )
    except (TypeError, ValueError, RecursionError) as exc:
        raise DamagedSession(str(row.id), str(exc) or type(exc).__name__) from None

def summary_from_row(row: Any) -> SessionSummary:
    """One listing row; DamagedSession when a value is not what the app wrote."""
    try:
        state = _row_state(row)
        return SessionSummary(
            id=row.id,
            name=_text(row.name),
            author=_text(row.author),
            layer=_layer(row.layer),
            prompts=[_text(p) for p in state.get("prompts", [])],
            model_source=_text(row.model_source),
            notes_preview=_text(row.notes)[:200],
            created_at=_parse_iso(row.created_at),
            updated_at=_parse_iso(row.updated_at),
            revision=int(row.revision),
        )
    except (TypeError, ValueError, RecursionError) as exc:
        raise DamagedSession(str(row.id), str(exc) or type(exc).__name__) from None
