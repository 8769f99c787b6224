"""What the CLI and the app need from the engine before any model exists, without importing torch:
the default checkpoint and the engine's error for bad input (engine/run/api.py re-exports both)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CHECKPOINT = REPO_ROOT / "assets" / "model"


class EngineError(ValueError):
    """Bad input to the engine (prompt, layer, checkpoint); the message says what and why."""
