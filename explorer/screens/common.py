"""What every screen of the explorer shares: the chart helper, section guards and timing, the view
state in st.session_state, and the cached model, tally and runs (one per process)."""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import streamlit as st

from engine.config import load_config
from engine.tally import tally_from_config
from explorer import chart_titles as ct, glossary as gl, layer_views as lv, prompt as pr, remote
from explorer.components import plotly_chart, png_config
from explorer.state import ViewState

PLOT_CONFIG = {"displayModeBar": False, "scrollZoom": False}
STATIC_DIR = Path(__file__).resolve().parents[2] / "static"   # plotly.js is served from here (no CDN)


def chart(fig, key: str, *, tag: str = "", png: str | None = None, on_click=None) -> None:
    """One Plotly chart, kept mounted across reruns and updated in place (explorer/components);
    `png` names the file its mode-bar button downloads."""
    config = png_config(png, PLOT_CONFIG) if png else PLOT_CONFIG
    plotly_chart(fig, key=key, static_dir=STATIC_DIR, tag=tag, config=config, on_click=on_click)


def named_chart(fig, key: str, name: ct.ChartName, *, tag: str = "", on_click=None, width: int | None = None) -> None:
    """A chart that carries its title (drawn, so also in the PNG) and downloads under a file name
    naming what it shows (explorer/chart_titles.py); `width`: the characters one title line holds."""
    title, room, pad = name.drawn_title(width)
    fig = gl.titled(fig, title, room)
    if pad != ct.TITLE_PAD:
        fig.update_layout(title=dict(pad=dict(t=pad)))
    chart(fig, key, tag=tag, png=name.file, on_click=on_click)


def guarded(what: str, section, *args) -> None:
    """Draw one section; a failure becomes a message there, and the rest of the page still draws.
    EXPLORER_TIMING=1 logs each section's server time (benches/ui.py reads it)."""
    started = time.perf_counter()
    try:
        section(*args)
    except Exception as err:
        fail(what, err)
    log_time(section.__name__, started)


def log_time(what: str, started: float | None = None) -> None:
    """EXPLORER_TIMING=1: a section's server time since `started` (ms), or a wall-clock mark (s)."""
    if not os.environ.get("EXPLORER_TIMING"):
        return
    if started is None:
        print(f"[timing] {what} {time.time():.3f} s", flush=True)
    else:
        print(f"[timing] {what} {1000 * (time.perf_counter() - started):.1f} ms", flush=True)


def fail(what: str, err: Exception) -> None:
    """A user-facing error: one clear line, the traceback only in the server log."""
    print(traceback.format_exc())
    st.error(f"{what}: {err}")


@st.cache_resource(show_spinner="Reading the tally…")
def cached_tally(source: str, path: str):
    from engine.tally import tally_from_checkpoint
    if source == pr.SOURCE_CONFIG or not any(Path(path).glob("*.safetensors")):
        return tally_from_config(load_config(path))
    return tally_from_checkpoint(path)


@st.cache_resource(show_spinner="Loading the model…")
def cached_engine(path: str):
    from engine.run.api import load
    return remote.attached_engine() or load(path)   # one shared engine; its run() holds a lock


def view() -> ViewState:
    return st.session_state["view"]


def set_view(new: ViewState) -> None:
    st.session_state["view"] = new


def cpu_refusal(source: str, path: str) -> str | None:
    """Why this model is not run in this process (too big for a CPU), or None."""
    if remote.engine_url():
        return None
    return lv.cpu_run_refusal(cached_tally(source, path).active_decode_params, on_cpu=True)


@st.cache_resource(show_spinner="Running the prompt through all layers…", max_entries=8)
def prompt_run(identity: str, folder: str, text: str, spans: tuple):
    """One run per prompt with every layer probed, shared read-only: another layer is a lookup."""
    return cached_engine(folder).run(text, image_spans=list(spans))


@st.cache_resource(show_spinner=False, max_entries=16)
def run_cached(identity: str, folder: str, text: str, layers: tuple, spans: tuple) -> dict:
    """The prompt's run as JSON with these layers' probes (read-only, shared): going back to a layer
    costs a lookup."""
    return prompt_run(identity, folder, text, spans).to_json(layers=list(layers))
