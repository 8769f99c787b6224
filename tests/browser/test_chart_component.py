"""The chart component (explorer/components.py) on its own, in a real browser: a small app steps one chart
through plotly.js missing (a message in the chart's place), plotly.js there (drawn), a layout-only change
(Plotly.relayout) and a data change (Plotly.react), and sends clicks back with their customdata."""

from __future__ import annotations

import textwrap

import pytest

from harness import streamlit_server

APP = textwrap.dedent('''
    from pathlib import Path

    import streamlit as st

    from explorer.components import plotly_chart
    from explorer.figure import Figure

    step = st.session_state.setdefault("step", 0)
    if st.button("next"):
        step = st.session_state["step"] = step + 1
    st.write(f"step {step}, clicked {st.session_state.get('clicked')}")
    ring_y = 1 if step <= 1 else 2
    fig = Figure([dict(type="scatter", x=[0, 0, 0], y=[0, 1, 2], mode="markers", customdata=[[0], [1], [2]],
                       marker=dict(size=20, symbol="square"))],
                 dict(height=300, shapes=[dict(type="rect", name="ring", x0=-0.3, x1=0.3, y0=ring_y - 0.3,
                                               y1=ring_y + 0.3, layer="below")]))
    if step >= 3:
        fig.data[0]["y"] = [0, 1, 3]
    # step 0: plotly.js is put where the server does not serve it, as if it were missing
    static = Path(__file__).parent / ("static" if step else "elsewhere")
    plotly_chart(fig, key="chart", static_dir=static, tag=f"step {step}",
                 on_click=lambda points: st.session_state.update(clicked=points[0]["customdata"]))
''')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chart_app")
    (folder / "chart_app.py").write_text(APP)
    (folder / ".streamlit").mkdir()
    (folder / ".streamlit" / "config.toml").write_text("[server]\nenableStaticServing = true\n")
    with streamlit_server({}, "streamlit_chart_component.log", script=folder / "chart_app.py") as url:
        yield url


def test_the_chart_updates_in_place_recovers_and_reports_clicks(server, browser):
    page = browser.new_page(viewport={"width": 900, "height": 700})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server)
    page.wait_for_selector(".st-key-chart .explorer-chart[data-error]", timeout=60_000)
    assert "could not be drawn: plotly.js did not load" in page.locator(".st-key-chart .explorer-chart").inner_text()

    page.get_by_role("button", name="next").click()      # plotly.js there: the chart is drawn
    page.wait_for_selector(".st-key-chart .explorer-chart[data-tag='step 1']", timeout=30_000)
    page.evaluate("""() => { window.calls = []; for (const f of ['react', 'relayout']) { const o = Plotly[f];
        Plotly[f] = function (...a) { window.calls.push(f); return o.apply(this, a); }; } }""")
    ring = "() => document.querySelector('.st-key-chart .js-plotly-plot')._fullLayout.shapes[0].y0"
    assert page.evaluate(ring) == pytest.approx(0.7)

    page.get_by_role("button", name="next").click()      # the ring moves: layout only
    page.wait_for_selector(".st-key-chart [data-tag='step 2']", timeout=30_000)
    assert page.evaluate("window.calls") == ["relayout"] and page.evaluate(ring) == pytest.approx(1.7)

    page.get_by_role("button", name="next").click()      # new data: a full update
    page.wait_for_selector(".st-key-chart [data-tag='step 3']", timeout=30_000)
    assert page.evaluate("window.calls") == ["relayout", "react"]
    assert page.evaluate("() => document.querySelector('.st-key-chart .js-plotly-plot').data[0].y") == [0, 1, 3]

    # a click on a point comes back to Python with its customdata
    page.locator(".st-key-chart .scatterlayer .point").nth(2).click(force=True)
    page.wait_for_selector("text=step 3, clicked [2]", timeout=30_000)
    assert not errors, errors
    page.close()
