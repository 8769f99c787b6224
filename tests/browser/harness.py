"""What every browser test shares: Debian's chromium through Playwright, and a Streamlit server of
app.py on a free local port (the test's own process; stopped at the end of the module).

Without /usr/bin/chromium the tests skip, except under CI=true where they fail. Never `playwright install`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def require_browser() -> None:
    if Path(CHROMIUM).exists():
        return
    message = f"{CHROMIUM} is missing: apt-get install -y chromium"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def streamlit_server(env: dict[str, str], log_name: str, script: Path | None = None):
    """Serve app.py (or `script`, from its own folder) with these environment overrides; yields the base URL."""
    require_browser()
    port = _free_port()
    full_env = {k: v for k, v in os.environ.items() if k not in ("EXPLORER_DB_URL", "EXPLORER_RUN_JSON")}
    full_env.update(env, PYTHONPATH=str(REPO))
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / log_name
    with open(log_path, "w") as log:
        # no file watcher: a "source changed" banner (someone editing the tree) would hang the waits
        script = Path(script or REPO / "app.py")
        proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", script.name, "--server.headless", "true",
                                 "--server.port", str(port), "--browser.gatherUsageStats", "false",
                                 "--server.fileWatcherType", "none"],
                                cwd=script.parent, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 60
            while True:
                try:
                    urllib.request.urlopen(url + "/_stcore/health", timeout=2)
                    break
                except OSError:
                    if proc.poll() is not None:
                        pytest.fail(f"streamlit exited with {proc.returncode}; see {log_path}")
                    if time.time() > deadline:
                        pytest.fail("streamlit did not answer its health check within 60 s")
                    time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def hover_chart(page, chart: str, fx: float, fy: float, tries: int = 20) -> str:
    """Move the mouse to the point (fx, fy) of the chart's plot area, as fractions of its width and height,
    until Plotly shows its hover box; return the box's text. Plotly answers mouse moves only: a single
    move made while the chart was still being laid out (scrolled into sight just now, or redrawn) shows
    nothing, however long one waits after it, so the plot area is measured again before every move."""
    for attempt in range(tries):
        box = page.evaluate("""(sel) => { const gd = document.querySelector(sel + ' .js-plotly-plot');
            const r = gd && gd.querySelector('.nsewdrag'); if (!r) return null;
            const b = r.getBoundingClientRect(); return [b.x, b.y, b.width, b.height]; }""", chart)
        if box and box[2] > 0 and box[3] > 0:
            # a move from elsewhere, then onto the point: Plotly ignores a move that does not change it
            page.mouse.move(box[0] + box[2] * fx + 1 + attempt % 3, box[1] + box[3] * fy + 1)
            page.mouse.move(box[0] + box[2] * fx, box[1] + box[3] * fy)
            try:
                page.wait_for_selector(f"{chart} .hoverlayer .hovertext", timeout=500)
                return page.locator(f"{chart} .hoverlayer .hovertext").first.text_content()
            except Exception:      # playwright's TimeoutError: measure and move again
                pass
        page.wait_for_timeout(250)
    raise AssertionError(f"no hover box on {chart} after {tries} mouse moves")


def page_idle(page, timeout: int = 120_000) -> None:
    """Wait until Streamlit runs no script (its status widget gone), then half a second for the repaint."""
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=timeout)
    page.wait_for_timeout(500)


def _until_settled(act, settled, what: str, tries: int = 3) -> None:
    """Does `act()`, then asks `settled()`; if it is false or Playwright times out, acts again, `tries` times in all.

    Under load an input that lands while a rerun is still repainting can be lost: a fill overwritten by the server's
    value, a click on the element being replaced (CI lost a typed prompt and a radio click that way). A user would
    just do it again; so do the tests, where doing it again changes nothing if the first one was not lost."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(tries):
        act()
        try:
            if settled():
                return
        except PlaywrightTimeout:
            if attempt == tries - 1:
                raise
    raise AssertionError(f"{what} did not hold after {tries} tries")


def type_and_commit(page, box: str, text: str, committed: str | None = None, timeout: int = 120_000) -> None:
    """Types `text` into the text box `box` (a selector) and commits it as a user would (the box commits on blur);
    settled when, after the rerun, the box still holds the text and `committed` (a JS predicate, e.g. on the URL)
    holds."""
    field = page.locator(box)

    def act():
        field.fill(text)
        field.blur()

    def settled():
        if committed:
            page.wait_for_function(committed, timeout=timeout // 3)
        page_idle(page, timeout)
        return field.input_value() == text

    _until_settled(act, settled, f"the text typed into {box}")


def press(page, button, done: str, timeout: int = 120_000) -> None:
    """Clicks `button` (a locator) and waits, after the rerun, for `done` (a JS predicate) to hold; clicks again only
    when the page has gone idle without it (a lost click: the callback never ran, so nothing happens twice)."""
    def settled():
        page_idle(page, timeout)
        page.wait_for_function(done, timeout=timeout // 3)
        return True

    _until_settled(button.click, settled, f"the click on {button}")


def choose(page, group: str, label: str, shows: str | None = None, timeout: int = 120_000) -> None:
    """Clicks the option `label` of the radio group or checkbox `group` (a selector); settled when, after the rerun,
    the option is checked and `shows` (a selector of what the choice brings up) is there. A checked option is not
    clicked again (that would clear a checkbox)."""
    option = page.locator(f"{group} label").filter(has=page.get_by_text(label, exact=True))
    box = option.locator("input")

    def act():
        if not box.is_checked():
            option.click()

    def settled():
        page_idle(page, timeout)
        if box.is_checked() and shows:
            page.wait_for_selector(shows, timeout=timeout // 3)
        return box.is_checked()

    _until_settled(act, settled, f"{label!r} of {group}")


def pick(page, box: str, text: str, shows: str, timeout: int = 120_000) -> None:
    """Picks the option of the select box `box` (a selector) that typing `text` finds, as a user would; settled when
    `shows` (what the pick brings up) is there (picking the same option again changes nothing)."""
    def act():
        page.locator(f"{box} input").click()
        page.keyboard.type(text)
        page.keyboard.press("Enter")

    _until_settled(act, lambda: page.wait_for_selector(shows, timeout=timeout // 3) is not None, f"{text!r} in {box}")
