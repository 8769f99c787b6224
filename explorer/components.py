"""Page pieces that stay mounted across reruns and are updated in place: Plotly charts, and blocks
of the app's own HTML (the token strip).

`st.plotly_chart` gives a chart a new element id whenever its figure changes, so the browser throws
the old chart away and draws the new one from scratch (`Plotly.newPlot`, 30-100 ms per chart on a
small machine; a layer click changes about seven). This component keeps one chart per key and hands
each new figure to `Plotly.react`, which updates the chart it already has. plotly.js is the copy
that ships inside the installed plotly package, served from the app's own static folder: nothing
is fetched from a CDN. Where static serving is off, charts fall back to `st.plotly_chart`.

`html_block` does the same for HTML the app builds itself (escaped text only): `st.html` runs every
update through a sanitizer and a new element (~90 ms per click for a 1,000-token strip here).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

import plotly
from plotly.io.json import to_json_plotly
from plotly.offline import get_plotlyjs_version

COMPONENT_NAME = "explorer.plotly_chart"
HTML_COMPONENT_NAME = "explorer.html_block"

# Only the views in sight are updated at once: an update of an element out of sight (below the fold, in
# a closed tab) waits until it scrolls into sight, or until the page has had no update for QUIET_MS and
# the browser is idle (at most IDLE_MS more), so a click's visible result is painted first and the
# held-back draws do not compete with it. Whether an element is in sight is what an IntersectionObserver
# last said (every chart is observed from its first draw): asking getBoundingClientRect on each update
# forced a layout of the half-updated page, ~8 per click. `data-received` says which update came in,
# `data-pending` that one is waiting; `data-tag` still says what is drawn.
QUIET_MS = 300
IDLE_MS = 1500
DRAW_ALL_JS = "function (el, run) { delete el.dataset.pending; run(); }"   # EXPLORER_DRAW_OFFSCREEN=1 (a baseline)
SIGHT_JS = r"""function (el, run) {
  const sight = window.__explorerSight || (window.__explorerSight = {
    waiting: new Set(),
    timer: null,
    observer: new IntersectionObserver((entries) => {
      for (const e of entries) {
        e.target._explorerInSight = e.isIntersecting;
        if (e.isIntersecting && e.target._explorerLater) e.target._explorerLater();
      }
    }),
  });
  const now = () => {
    sight.waiting.delete(el);
    el._explorerLater = null;
    delete el.dataset.pending;
    run();
  };
  if (!el._explorerSeen) {     // the first draw is never held back; from then on the observer says
    el._explorerSeen = true;
    sight.observer.observe(el);
    now();
    return;
  }
  if (el._explorerInSight) {
    now();
    return;
  }
  el.dataset.pending = "1";
  el._explorerLater = now;
  sight.waiting.add(el);
  clearTimeout(sight.timer);   // each update restarts the wait: held-back draws follow the last one
  sight.timer = setTimeout(() => requestIdleCallback(() => {
    for (const waiting of [...sight.waiting]) if (waiting._explorerLater) waiting._explorerLater();
  }, {timeout: """ + str(IDLE_MS) + r"""}), """ + str(QUIET_MS) + r""");
}"""

# Sets the block's HTML when it changed. Only for HTML built by the app with every user text escaped.
HTML_COMPONENT_JS = r"""
export default function ({ data, parentElement }) {
  let root = parentElement.querySelector(":scope > .explorer-html");
  if (!root) {
    root = document.createElement("div");
    root.className = "explorer-html";
    parentElement.appendChild(root);
  }
  root.dataset.received = data.tag;
  const apply = () => {
    if (root._explorerHtml !== data.html) {
      root.innerHTML = data.html;
      root._explorerHtml = data.html;
    }
    root.dataset.tag = data.tag;
  };
  __SIGHT__(root, apply);
}
"""

# The component's browser side: one <div> per key, Plotly.react on every new figure, clicks sent
# back as a one-rerun trigger ("click": the picked points, like st.plotly_chart's selection points).
COMPONENT_JS = r"""
// Our own plotly.js (the version plotly.py wrote the figures for), loaded once per page, whatever
// else may have set window.Plotly.
function loadPlotly(src) {
  const loads = window.__explorerPlotly || (window.__explorerPlotly = {});
  if (!loads[src]) {
    loads[src] = new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = src;
      script.onload = () => resolve(window.Plotly);
      script.onerror = () => {
        delete loads[src];
        reject(new Error("plotly.js did not load from " + src));
      };
      document.head.appendChild(script);
    });
  }
  return loads[src];
}

// When only the layout changed (same traces by their digest, same config), the changed layout keys go
// to Plotly.relayout: moving the plan's selection ring costs ~2 ms instead of ~35 for a full update.
function layoutChanges(prev, msg) {
  const a = prev.figure.layout || {}, b = msg.figure.layout || {};
  if (a.datarevision === undefined || a.datarevision !== b.datarevision) return null;
  if (JSON.stringify(prev.config) !== JSON.stringify(msg.config)) return null;
  const changes = {};
  for (const key of new Set([...Object.keys(a), ...Object.keys(b)])) {
    if (JSON.stringify(a[key]) !== JSON.stringify(b[key])) changes[key] = key in b ? b[key] : null;
  }
  return changes;
}

function pointOf(p) {
  return {customdata: p.customdata, curve_number: p.curveNumber, point_index: p.pointIndex, x: p.x, y: p.y};
}

export default function ({ data, parentElement, setTriggerValue }) {
  let gd = parentElement.querySelector(":scope > .explorer-chart");
  if (!gd) {
    gd = document.createElement("div");
    gd.className = "explorer-chart";
    gd.style.width = "100%";
    parentElement.appendChild(gd);
  }
  gd._explorerSend = (points) => setTriggerValue("click", points);
  const text = typeof data === "string" ? data : new TextDecoder().decode(data);
  if (text === gd._explorerText) return;
  gd._explorerText = text;
  const msg = JSON.parse(text);
  gd.dataset.received = msg.tag;
  const base = window.location.pathname.replace(/[^/]*$/, "");
  const draw = () => loadPlotly(base + msg.src)
    .then((Plotly) => {
      if (gd._explorerText !== text) return null;   // a newer figure came in meanwhile: it draws instead
      // compared with what the chart shows (a figure skipped above was never drawn)
      const shown = gd._explorerShown;
      const changes = shown && gd.data ? layoutChanges(shown, msg) : null;
      const drawn = changes ? Plotly.relayout(gd, changes) : Plotly.react(gd, msg.figure.data, msg.figure.layout || {}, msg.config);
      gd._explorerShown = msg;     // Plotly has taken the figure in by now; the promise is its redraw
      return drawn.then(() => {
        gd.dataset.tag = msg.tag;
        if (!gd._explorerClicks) {
          gd._explorerClicks = true;
          gd.on("plotly_click", (ev) => gd._explorerSend(ev.points.map(pointOf)));
          // follow the column's width (window, sidebar, layout changes), as st.plotly_chart does
          let width = gd.clientWidth;
          new ResizeObserver(() => {
            if (gd.clientWidth && gd.clientWidth !== width) {
              width = gd.clientWidth;
              Plotly.Plots.resize(gd);
            }
          }).observe(gd);
        }
      });
    })
    .catch((err) => {
      gd._explorerShown = null;      // the next figure is drawn afresh
      try { if (window.Plotly) window.Plotly.purge(gd); } catch (ignored) { /* nothing drawn to purge */ }
      gd.dataset.error = String(err && err.message || err);
      gd.textContent = "This chart could not be drawn: " + gd.dataset.error;
    });
  __SIGHT__(gd, draw);
}
"""


def plotly_js_source() -> Path:
    """plotly.js as shipped inside the installed plotly package (the version plotly.py writes for)."""
    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def plotly_js_name() -> str:
    return f"plotly-{get_plotlyjs_version()}.min.js"


def publish_plotly_js(static_dir: Path) -> str:
    """Put the installed plotly.js into the app's static folder (once per version) and return its path
    under the app's URL. Written to a temporary name and renamed, so concurrent apps never serve half
    a file."""
    source = plotly_js_source()
    target = Path(static_dir) / plotly_js_name()
    if not target.exists() or target.stat().st_size != source.stat().st_size:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".plotly-", suffix=".tmp")
        with os.fdopen(fd, "wb") as out:
            out.write(source.read_bytes())
        os.replace(tmp, target)
    return f"app/static/{target.name}"


def chart_payload(fig, *, src: str, tag: str = "", config: dict | None = None) -> bytes:
    """What one chart sends to the browser: the script's path, a tag the page exposes as the chart's
    `data-tag` once drawn (tests and benchmarks wait on it), Plotly's config, and the figure JSON.

    `layout.datarevision` is a digest of the traces: when it and the config are unchanged (a selection
    ring, a highlight), the browser sends only the changed layout keys to Plotly.relayout."""
    spec = fig.to_plotly_json() if hasattr(fig, "to_plotly_json") else dict(fig)
    data = to_json_plotly(spec.get("data", []))
    layout = dict(spec.get("layout", {}), datarevision=hashlib.blake2b(data.encode(), digest_size=8).hexdigest())
    head = json.dumps({"src": src, "tag": tag, "config": config or {}})
    return (head[:-1] + ',"figure":{"data":' + data + ',"layout":' + to_json_plotly(layout) + "}}").encode()


def png_config(filename: str, base: dict | None = None) -> dict:
    """Plotly config with one mode-bar button: download the chart as a PNG (drawn by plotly.js in the
    browser, at twice the on-screen resolution)."""
    return {**(base or {}), "displayModeBar": "hover", "displaylogo": False, "modeBarButtons": [["toImage"]],
            "toImageButtonOptions": {"format": "png", "filename": filename, "scale": 2}}


def _published(static_dir: Path) -> str | None:
    """plotly.js's path under the app's URL, or None where it cannot be written (a read-only install):
    the charts are then Streamlit's own."""
    try:
        return publish_plotly_js(static_dir)
    except OSError as err:
        _warn_once(f"plotly.js could not be put in {static_dir} ({err}); charts fall back to st.plotly_chart")
        return None


@functools.cache
def _warn_once(message: str) -> None:
    print(f"[explorer] {message}", file=sys.stderr)


def static_serving() -> bool:
    """Whether the server serves ./static (.streamlit/config.toml turns it on)."""
    import streamlit as st
    return bool(st.get_option("server.enableStaticServing"))


def _with_sight(js: str) -> str:
    """The component's script with its update policy: views out of sight wait (the default), or
    every view is drawn at once (EXPLORER_DRAW_OFFSCREEN=1, the bench's baseline)."""
    policy = DRAW_ALL_JS if os.environ.get("EXPLORER_DRAW_OFFSCREEN") == "1" else SIGHT_JS
    return js.replace("__SIGHT__", f"({policy})")


@functools.cache
def _component():
    import streamlit as st
    return st.components.v2.component(COMPONENT_NAME, js=_with_sight(COMPONENT_JS), isolate_styles=False)


@functools.cache
def _html_component():
    import streamlit as st
    return st.components.v2.component(HTML_COMPONENT_NAME, js=_with_sight(HTML_COMPONENT_JS), isolate_styles=False)


def html_block(html: str, *, key: str, tag: str = "") -> None:
    """Show HTML the app built itself (user text escaped by the builder, e.g. token_strip_html),
    updating the block already there; `tag` becomes its `data-tag`."""
    _html_component()(data={"html": html, "tag": tag}, key=key)


def plotly_chart(fig, *, key: str, static_dir: Path, tag: str = "", config: dict | None = None,
                 on_click: Callable[[list], None] | None = None) -> None:
    """Draw `fig` under `key`, updating the chart already there. `on_click(points)` runs before the
    rerun a click causes; points carry `customdata` like st.plotly_chart's selection points."""
    import streamlit as st

    src = _published(static_dir) if static_serving() else None
    if src is None:
        _native_chart(fig, key=key, config=config, on_click=on_click)
        return

    def clicked() -> None:
        value = st.session_state.get(key)
        points = value.get("click") if hasattr(value, "get") else None
        if points and on_click is not None:
            on_click(list(points))

    _component()(data=chart_payload(fig, src=src, tag=tag, config=config), key=key, on_click_change=clicked)


def _native_chart(fig, *, key: str, config: dict | None, on_click: Callable[[list], None] | None) -> None:
    import streamlit as st

    from .state import picked_points

    figure = fig.validated() if hasattr(fig, "validated") else fig
    if on_click is None:
        st.plotly_chart(figure, key=key, config=config or {}, theme=None, width="stretch")
        return
    st.plotly_chart(figure, key=key, config=config or {}, theme=None, width="stretch", selection_mode="points",
                    on_select=lambda: on_click(picked_points(st.session_state.get(key))))
