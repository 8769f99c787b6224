"""What the page's exported images are called and the title they carry (issue 14): the model they
show (the release config, the live small model or a checkpoint folder), the layer or stage, and the
prompt's hash where a prompt is involved. Names and titles are built by explorer/glossary.py's
`export_name` / `export_title`; this module only says, per chart, what goes into them. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelConfig
from engine.roles import LayerRole

from . import glossary as gl, prompt as pr
from .style import fmt_tokens

RELEASE_MODEL = "release config"
SHIPPED_MODEL = "V4.1-Flash live small model"
TITLE_ROOM, LINE_ROOM = 22, 14       # px above the plot for a one-line title, and for a second line
TITLE_PAD, SECOND_LINE_LIFT = 4, 9   # px above the title (glossary.titled's pad), and more for two lines
HALF_WIDTH = 72                      # characters of an 11 px title that fit a half-width chart
B_CHARS = 32                         # of a side-by-side's B label (a session name) in its title


def model_label(source: str | None, path: str | None) -> str:
    """The model a chart shows, as its title and file name say it. A checkpoint folder is named by
    its last path part; a path that is the release config (the page's fallback) is the release."""
    if source == pr.SOURCE_CONFIG or (path and Path(path) == pr.RELEASE_CONFIG):
        return RELEASE_MODEL
    if source == pr.SOURCE_PATH:
        return f"checkpoint {str(path or '').rstrip('/').rsplit('/', 1)[-1]}"
    return SHIPPED_MODEL


@dataclass(frozen=True)
class ChartName:
    """One chart's export: `what` it shows and the model, layer, query and prompt that name it."""
    what: str
    model: str
    layer: int | None = None
    query: int | None = None
    prompt: str | None = None
    short: str | None = None     # `what` in the file name, where the title's words run long

    def _kw(self) -> dict:
        return dict(model=self.model, layer=self.layer, query=self.query, prompt=self.prompt or None)

    @property
    def file(self) -> str:
        """The PNG's file name, without its extension."""
        return gl.export_name(self.short or self.what, **self._kw())

    @property
    def title(self) -> str:
        """The title drawn on the chart (and so in its PNG)."""
        return gl.export_title(self.what, **self._kw())

    def drawn_title(self, width: int | None = None) -> tuple[str, int, int]:
        """(title text, pixels of room above the plot, title pad above): one line, or, where the title
        runs past `width` characters (a half-width chart), two: what it shows, then the model and prompt."""
        one = self.title
        if width is None or len(one) <= width:
            return one, TITLE_ROOM, TITLE_PAD
        parts = one.split(" · ")
        tail = 2 if self.prompt else 1     # export_title ends with the model, then the prompt's hash
        # Plotly lifts a two-line title anchored at its top by about half a line (measured in chromium:
        # its first line was cut off by the chart's top edge): the pad puts it back in the chart
        return (" · ".join(parts[:-tail]) + "<br>" + " · ".join(parts[-tail:]), TITLE_ROOM + LINE_ROOM,
                TITLE_PAD + SECOND_LINE_LIFT)


def diagram_name(model: str, tab: str, tab_title: str, role: LayerRole, cfg: ModelConfig) -> ChartName:
    """A block diagram: the layer it draws and its tab, or the DSpark stage it draws."""
    if role.is_dspark:
        k = role.layer - cfg.n_layers
        # no "Layer 41": a stage is not a backbone layer (issue 17, item 9)
        return ChartName(f"Block diagram of DSpark stage {k} (mtp.{k})", model, short=f"diagram mtp{k}")
    return ChartName(f"block diagram ({tab_title})", model, role.layer, short=f"diagram {tab}")


def tally_name(model: str, position: str, position_title: str) -> ChartName:
    """The parameter tally at one position, of the release or of the live model."""
    return ChartName(f"Parameter tally, {position_title.lower()}", model, short=f"tally {position}")


def kv_name(context_len: int) -> ChartName:
    """The KV cache by context length (always the release config's formula), the picked length marked."""
    return ChartName(f"KV cache by context length, {fmt_tokens(context_len)} marked", RELEASE_MODEL,
                     short=f"kv cache {fmt_tokens(context_len)}")


def comparison_name(model: str, kind: str, label_b: str, layer: int, prompt: str | None) -> ChartName:
    """A side-by-side chart: run A (on screen, `prompt`) against B at one layer. B's label (a session
    name: user text) is escaped, since Plotly reads tags in titles."""
    what = "top-k selections" if kind == "selections" else "routed experts"
    b = label_b if len(label_b) <= B_CHARS else label_b[:B_CHARS - 1] + "…"
    b = b.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return ChartName(f"{what}, A vs {b}", model, layer, prompt=prompt, short=f"side by side {kind}")
