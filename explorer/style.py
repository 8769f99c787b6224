"""Shared look of every figure: a colour-blind-safe role palette (Okabe-Ito) and number formats."""

from __future__ import annotations

# Okabe-Ito, chosen so the five roles stay apart under the common colour-vision deficiencies.
ROLE_COLOURS = {
    "swa": "#A6A6A6",       # grey: window only
    "full_m2": "#0072B2",   # blue: encoder KV source
    "full_m1": "#D55E00",   # vermillion: decoder KV source
    "reindex": "#E69F00",   # orange: own indexer queries
    "reuse": "#56B4E9",     # sky blue: borrows everything
}
ENGRAM_COLOUR = "#009E73"   # bluish green
DSPARK_COLOUR = "#CC79A7"   # reddish purple
MHC_COLOUR = "#7F63B8"
INK = "#1F2430"
MUTED = "#6B7280"
GRID = "#E5E7EB"
PAPER = "rgba(0,0,0,0)"
HIGHLIGHT = "#F0E442"       # Okabe-Ito yellow, for boxes picked in the tally
# Colour scales spelled out: plotly.js and plotly.py mean different things by the same names
# ("Blues" runs dark-to-light in plotly.js), and these figures go to plotly.js unconverted.
BLUES = [[0, "#F7FBFF"], [0.25, "#C6DBEF"], [0.5, "#6BAED6"], [0.75, "#2171B5"], [1, "#08306B"]]
PURPLES = [[0, "#FCFBFD"], [0.25, "#DADAEB"], [0.5, "#9E9AC8"], [0.75, "#6A51A3"], [1, "#3F007D"]]
FONT = dict(family="Inter, 'Source Sans Pro', 'Segoe UI', Helvetica, Arial, sans-serif", size=12, color=INK)


def fmt_params(n: float) -> str:
    """Parameter counts the way the diagram prints them: 5.41M, 543.6B, 5,120."""
    n = float(n)
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.1f}{suffix}" if value >= 100 else f"{value:.2f}{suffix}".replace(".00", "")
    return f"{int(n):,}"


def fmt_bytes(n: float) -> str:
    """Decimal byte sizes (890 B, 1.8 GB), matching how the tech report states the cache."""
    n = float(n)
    for scale, suffix in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {suffix}"
    return f"{int(round(n)):,} B"


def fmt_tokens(n: int) -> str:
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}K"
    return f"{n:,}"


# The parts of Plotly's "plotly_white" look these charts use (the whole template is ~8 kB per chart).
# No automargin: charts set margins that fit their ticks and titles, and the browser draws each chart
# once instead of drawing, measuring the labels and drawing again (~100 ms less per click here).
_AXIS = dict(gridcolor="#EBF0F8", linecolor="#EBF0F8", zerolinecolor="#EBF0F8", zerolinewidth=2, ticks="",
             automargin=False, title=dict(standoff=15))
LOOK = dict(
    layout=dict(xaxis=_AXIS, yaxis=_AXIS, hovermode="closest", hoverlabel=dict(align="left"),
                coloraxis=dict(colorbar=dict(outlinewidth=0, ticks=""))),
    data=dict(bar=[dict(marker=dict(line=dict(color="white", width=0.5)))],
              heatmap=[dict(colorbar=dict(outlinewidth=0, ticks=""))]),
)


def base_layout(**overrides) -> dict:
    """Layout keys every figure shares; callers override per figure."""
    layout = dict(
        template=LOOK,  # the app draws charts with theme=None (its own look: ~0.1 s less per click)
        font=FONT,
        paper_bgcolor=PAPER,
        plot_bgcolor=PAPER,
        margin=dict(l=8, r=8, t=8, b=8),
        showlegend=False,
        hoverlabel=dict(bgcolor="white", bordercolor=GRID, font=dict(size=12, color=INK)),
        dragmode=False,
    )
    layout.update(overrides)
    return layout
