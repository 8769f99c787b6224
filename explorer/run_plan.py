"""When the explorer runs the model, what it probes, and why it does not: pure rules (no Streamlit),
so the app only wires widgets to them and the tests check them directly.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from engine.roles import LayerRole

from .prompt import SOURCE_CONFIG

NO_WEIGHTS_CONFIG = ("Config only: no weights are loaded, so there are no live views. Pick the shipped model or a "
                     "checkpoint folder in the sidebar.")
EMPTY_PROMPT = "The prompt is empty."
DSPARK_NOT_RUN = "DSpark stages are counted, not run, by this engine."
PARITY_NEEDS = ("Needs a prompt, a local checkpoint folder (not a remote engine) and a model layer "
                "(DSpark stages are not run).")


def has_shards(folder: Path) -> bool:
    """A folder with at least one safetensors shard."""
    return folder.is_dir() and any(folder.glob("*.safetensors"))


def weights_folder(source: str, path: str) -> Path | None:
    """The checkpoint folder to load weights from, or None (config only, or no shards there)."""
    folder = Path(path)
    if source == SOURCE_CONFIG or not has_shards(folder):
        return None
    return folder


def probe_layers(role: LayerRole) -> tuple[int, ...]:
    """The layers whose probes one layer's page shows: itself and the layer whose top-k it borrows."""
    return tuple(sorted({role.layer} | ({role.index_source} if role.index_source is not None else set())))


def why_no_run(source: str, path: str, text: str, role: LayerRole, remote: bool) -> str | None:
    """Why the selected layer is not run on the prompt (first reason that applies), or None: run it.
    `remote`: an engine service answers runs, so no local shards are needed."""
    if source == SOURCE_CONFIG:
        return NO_WEIGHTS_CONFIG
    folder = Path(path)
    if not has_shards(folder) and not remote:
        return f"No weights at {folder}: live views need a checkpoint with safetensors shards."
    if not text.strip():
        return EMPTY_PROMPT
    if role.is_dspark:
        return DSPARK_NOT_RUN
    return None


def parity_blocker(source: str, path: str, text: str, role: LayerRole, remote: bool) -> str | None:
    """Why the kernel parity check cannot be offered here, or None. It needs the weights in this
    process (not a remote engine), a prompt and a model layer."""
    if source == SOURCE_CONFIG or remote or role.is_dspark or not text.strip() or not has_shards(Path(path)):
        return PARITY_NEEDS
    return None


def interpreter_possible(interpreter_active: bool, modules: Mapping[str, object] | None = None) -> bool:
    """Whether the Triton kernels can run under the CPU interpreter in this process: already on, or
    not yet imported (the interpreter can only be switched on before the kernels load)."""
    loaded = sys.modules if modules is None else modules
    return interpreter_active or "kernels.sparse_attn" not in loaded
