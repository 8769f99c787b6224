"""The prompt as clickable token chips, one page at a time: a click on a chip makes that token the
query of every live view. A page holds PAGE_SIZE tokens; the page shown is the query's, so a prompt of
up to the model's max_seq_len is reachable (the page follows the query slider and clicks).

The HTML is built here with every token escaped; the component only swaps it in and reports clicks.
"""

from __future__ import annotations

import functools
import html
from typing import Callable

from .layer_views import STRIP_CSS
from .style import MUTED

PAGE_SIZE = 2000
COMPONENT_NAME = "explorer.token_strip"

# Sets the strip's HTML when it changed; a click on a chip sends its position once (a trigger value).
STRIP_JS = r"""
export default function ({ data, parentElement, setTriggerValue }) {
  let root = parentElement.querySelector(":scope > .explorer-html");
  if (!root) {
    root = document.createElement("div");
    root.className = "explorer-html";
    parentElement.appendChild(root);
  }
  root._send = (i) => setTriggerValue("click", i);
  if (!root._clicks) {
    root._clicks = true;
    root.addEventListener("click", (ev) => {
      const chip = ev.target.closest("span[data-i]");
      if (chip) root._send(Number(chip.dataset.i));
    });
  }
  if (root._explorerHtml !== data.html) {
    root.innerHTML = data.html;
    root._explorerHtml = data.html;
  }
  root.dataset.tag = data.tag;
}
"""


def page_of(query: int, n_tokens: int, page_size: int = PAGE_SIZE) -> range:
    """The positions of the page that holds `query`."""
    if n_tokens <= 0:
        return range(0)
    q = min(max(query, 0), n_tokens - 1)
    start = q // page_size * page_size
    return range(start, min(start + page_size, n_tokens))


def strip_html(tokens: list[str], values: list[float] | None = None, *, query: int | None = None,
               highlight: set[int] = frozenset(), image: list[bool] | None = None,
               page_size: int = PAGE_SIZE) -> str:
    """Chips of the query's page: shade by value (0..max over the whole prompt), a ring on `highlight`,
    an ink outline on the query, a dashed underline on image positions; each chip says its position."""
    n = len(tokens)
    values = values or [0.0] * n
    top = max(values) if values and max(values) > 0 else 1.0
    page = page_of(query if query is not None else 0, n, page_size)
    chips = []
    for i in page:
        v = values[i] if i < len(values) else 0
        a = v / top
        style = (f" style='background:rgba(8,48,107,{0.08 + 0.72 * a:.2f})" + (";color:white" if a > 0.55 else "")
                 + "'") if a > 0 else ""
        marks = " ".join(name for name, on in (("hl", i in highlight), ("fo", i == query),
                                                ("im", bool(image and i < len(image) and image[i]))) if on)
        text = html.escape(tokens[i].replace("\n", "⏎").replace("\t", "⇥")) or "∅"
        chips.append(f"<span data-i='{i}' title='#{i} · {v:g}'{f' class={chr(39)}{marks}{chr(39)}' if marks else ''}"
                     f"{style}>{text}</span>")
    head = ""
    if n > page_size:
        head = (f"<div style='color:{MUTED};font-size:12px'>tokens {page.start:,}-{page.stop - 1:,} of {n:,} "
                f"(the query's page; move the query to see another)</div>")
    return f"{head}<div class='strip' style='cursor:pointer'>{STRIP_CSS}{''.join(chips)}</div>"


@functools.cache
def _component():
    import streamlit as st
    return st.components.v2.component(COMPONENT_NAME, js=STRIP_JS, isolate_styles=False)


def token_strip(html_text: str, *, key: str, tag: str = "", on_pick: Callable[[int], None] | None = None) -> None:
    """Show the strip under `key`; `on_pick(position)` runs before the rerun a chip's click causes."""
    import streamlit as st

    def clicked() -> None:
        value = st.session_state.get(key)
        got = value.get("click") if hasattr(value, "get") else None
        if got is not None and on_pick is not None:
            on_pick(int(got))

    _component()(data={"html": html_text, "tag": tag}, key=key, on_click_change=clicked)
