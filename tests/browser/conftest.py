"""Browser-test fixtures: one headless Debian chromium per module (see harness.py)."""

from __future__ import annotations

import pytest

from harness import CHROMIUM, CHROMIUM_ARGS, require_browser


@pytest.fixture(scope="module")
def browser():
    require_browser()
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()
