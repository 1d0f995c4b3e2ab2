"""The live expert view: utility 0..K per layer × expert, residency and τ per layer.

Layout choice (48 layers × 128 experts must stay readable on a 120×40 terminal):
- **Experts fold horizontally.** Each character cell shows a group of `G` neighbouring experts,
  `G = ceil(E / cells)` where `cells` is the width left after the layer label and the τ column
  (120 columns: 128 experts → G = 2, 64 cells). A cell's colour is the group's *max* utility, so one
  hot expert is never averaged away; the legend states G. Wide enough panes get G = 1 (exact).
- **One text row per layer, rows scroll.** Half-block glyphs would fit two layers per line, but
  then each cell's colour slot is taken by utility and there is no room for a per-layer residency
  glyph or a τ per row. So every layer keeps its own row; the widget is a `ScrollView` (line API:
  only visible lines are built) whose header, expert ruler and legend stay pinned while the layer
  rows scroll (120×40: 35 of 48 layers visible at once, the rest one scroll away). A short pane keeps
  MIN_ROWS layer rows before those pinned lines: it drops the legend, then the ruler, then the header (a small
  terminal's expert view showed the four pinned lines and no layer).
- **Residency is a glyph, utility a background colour**, so both read at once: "●" every expert
  of the cell resident, "•" some, blank none; the glyph takes the contrast colour of its cell.
- Colours come from the theme (surface → primary → warning → error), so light and dark themes work.
- **Without colour** (`NO_COLOR`: Textual draws in grey, where K came out darker than K-1 and 0 as 1), and where the
  terminal's colours show two levels alike (16 colours: the theme's ramp falls on two or three of them; 256 at a large
  K), a cell shows its utility as a digit ("·" for 0; K > 9 scaled to 1..9) and residency as a style: reversed every
  expert resident, underlined some.

`update_frame` only stores the newest frame and schedules at most one redraw per `INTERVAL_S`:
a flood of frames never queues renders, and folding happens once per redraw, not per frame.
Give it a height (e.g. `height: 1fr`); it scrolls itself, so don't wrap it in a VerticalScroll.
"""
from __future__ import annotations

import math
import textwrap
import time
from typing import ClassVar

from rich.console import COLOR_SYSTEMS
from rich.segment import Segment
from rich.style import Style
from textual.color import Color, Gradient
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from moechat.app.tui.messages import Frame

INTERVAL_S = 0.1  # at most 10 redraws per second
ALL_RESIDENT, SOME_RESIDENT = "●", "•"
TOP_LINES, BOTTOM_LINES = 2, 2  # header + expert ruler; legend (levels, marks)
MIN_ROWS = 3  # layer rows a short pane keeps before its pinned lines
MARKED = (Style(), Style(underline=True), Style(reverse=True))  # without colour: no, some, every expert resident
WAITING = "waiting for the first expert frame…"


def group_size(n_experts: int, cells: int) -> int:
    """Experts per character cell so that `n_experts` fit in `cells` columns (at least 1 cell)."""
    return max(1, math.ceil(n_experts / max(1, cells)))


def fold_row(utility: list[int], resident: list[bool], group: int) -> list[tuple[int, int, int]]:
    """One layer folded to cells: (max utility, resident count, experts in the cell) per group."""
    cells = []
    for start in range(0, len(utility), group):
        u, r = utility[start:start + group], resident[start:start + group]
        cells.append((max(u), sum(bool(x) for x in r), len(u)))
    return cells


def level_mark(level: int, bound: int) -> str:
    """A cell's utility as one character, for a terminal without colour: "·" for 0, else 1..9 (K > 9 scaled)."""
    level = min(max(level, 0), bound)
    return "·" if level == 0 else str(level if bound <= 9 else math.ceil(9 * level / bound))


def layer_labels(frame: Frame) -> list[str]:
    """The row labels: the frame's layer names where given, else the layer index."""
    names = frame.layer_names or [""] * len(frame.utility)
    return [name[:6] or str(i) for i, name in enumerate(names)]


def columns(frame: Frame) -> tuple[int, int]:
    """(label width, τ width) of a frame's rows; τ is at most K+1 (in-use experts are frozen at K+1)."""
    label_w = max((len(s) for s in layer_labels(frame)), default=1)
    tau_w = max(len(str(t)) for t in [*frame.tau, frame.utility_bound, 0])
    return label_w, tau_w


def pinned(height: int, layers: int) -> tuple[int, int]:
    """(top, bottom) pinned lines in `height` rows: header, ruler, the legend's levels, its marks, in that order, as
    many as leave min(layers, MIN_ROWS) rows for the layers."""
    kept = min(TOP_LINES + BOTTOM_LINES, max(0, height - min(layers, MIN_ROWS)))
    return min(kept, TOP_LINES), max(0, kept - TOP_LINES)


def grid_cells(width: int, frame: Frame) -> int:
    """Character cells left for experts in a row of `width` columns: "label ␣ cells ␣ τ"."""
    label_w, tau_w = columns(frame)
    return max(1, width - label_w - tau_w - 2)


class ExpertHeatmap(ScrollView):
    """Heatmap of the newest `Frame`; see the module docstring for the layout."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"expert-heatmap--label", "expert-heatmap--tau", "expert-heatmap--header"}
    DEFAULT_CSS = """
    ExpertHeatmap {
        overflow-x: hidden;
        overflow-y: auto;
        background: $surface;
    }
    ExpertHeatmap > .expert-heatmap--label { color: $text-muted; }
    ExpertHeatmap > .expert-heatmap--tau { color: $accent; text-style: bold; }
    ExpertHeatmap > .expert-heatmap--header { color: $text; text-style: bold; }
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.frame: Frame | None = None  # the frame on screen
        self.draws = 0  # redraws done (≤ 1 per INTERVAL_S however many frames arrive)
        self._pending: Frame | None = None
        self._scheduled = False  # a redraw is due (timer or call_later pending)
        self._last_draw = -math.inf
        self._rows: list[list[tuple[int, int, int]]] = []  # [L][cells] folded
        self._group = 1
        self._layout_key: tuple | None = None
        self._palette_key: tuple | None = None
        self._palette: list[Color] = []
        self._alike = False  # two levels of the palette look the same on this terminal's colours
        self._styles: list[Style] = []  # cell style per level, for the current palette
        self._labels: list[str] = []
        self._columns = (1, 1)  # (label width, τ width)
        self._pinned = (TOP_LINES, BOTTOM_LINES)  # (top, bottom) lines kept at this height
        self.idle = WAITING  # shown, wrapped, while there is no frame

    def say(self, text: str) -> None:
        """`text` in place of a frame: none came yet, or the model that sent it is gone (its frame would still show)."""
        if self.frame is None and self._pending is None and self.idle == text:
            return
        self.frame, self._pending, self.idle = None, None, text
        self.refresh()

    # -- frames in, capped redraws out ------------------------------------------------------------

    def update_frame(self, frame: Frame | None = None, draw: bool = True) -> None:
        """Keep `frame` as the newest (None: the newest kept) and redraw at most once per INTERVAL_S; draw=False
        while the heatmap is hidden."""
        self._pending = frame if frame is not None else self._pending
        if not draw or not self.is_mounted or self._pending is None or self._scheduled:
            return
        self._scheduled = True
        delay = self._last_draw + INTERVAL_S - time.monotonic()
        if delay > 0:
            self.set_timer(delay, self._draw)
        else:
            self.call_later(self._draw)  # idle for a while: draw on the next turn of the loop

    def _draw(self) -> None:
        self._scheduled, self._last_draw = False, time.monotonic()
        self.frame, self._pending = self._pending, None
        self.draws += 1
        self._layout_key = None
        self._relayout()
        self.refresh()

    def on_resize(self) -> None:
        self._relayout()

    def _relayout(self) -> None:
        """Fold the frame to the current width (once per frame and size, not per line)."""
        if self.frame is None:
            return
        width = self.scrollable_content_region.width or self.size.width
        key = (id(self.frame), width, self.size.height)
        if key == self._layout_key:
            return
        self._layout_key = key
        n_experts = max((len(r) for r in self.frame.utility), default=1)
        self._group = group_size(n_experts, grid_cells(width, self.frame))
        self._rows = [fold_row(u, r, self._group) for u, r in zip(self.frame.utility, self.frame.resident)]
        self._labels, self._columns = layer_labels(self.frame), columns(self.frame)
        self._pinned = pinned(self.size.height, len(self._rows))
        self.virtual_size = Size(0, sum(self._pinned) + len(self._rows))

    # -- colours ------------------------------------------------------------------------------------

    def level_colors(self, bound: int) -> list[Color]:
        """Background colour of utility 0..K from the theme: 0 is a faint surface, K is $error."""
        key = (self.app.theme, bound)
        if key != self._palette_key:
            var = self.app.theme_variables
            surface, fg = Color.parse(var["surface"]), Color.parse(var["foreground"])
            primary, warning, error = (Color.parse(var[k]) for k in ("primary", "warning", "error"))
            ramp = Gradient((0.0, surface.blend(primary, 0.45)), (0.5, warning), (1.0, error))
            hot = [ramp.get_color(0.0 if bound <= 1 else (k - 1) / (bound - 1)) for k in range(1, bound + 1)]
            self._palette, self._palette_key = [surface.blend(fg, 0.08), *hot], key
            # A cell's glyph takes the contrast colour of its background.
            self._styles = [Style(bgcolor=bg.rich_color, color=bg.get_contrast_text(1.0).rich_color)
                            for bg in self._palette]
            system = COLOR_SYSTEMS.get(self.app.console.color_system or "truecolor")
            shown = {tuple(bg.rich_color.downgrade(system).get_ansi_codes(False)) for bg in self._palette}
            self._alike = len(shown) < len(self._palette)  # what the terminal is sent: 16 colours made K and K-1 one
        return self._palette

    def plain(self, bound: int) -> bool:
        """Utility as digits, residency as a style: without colour (NO_COLOR), or where the terminal's colours cannot
        tell the levels 0..K apart."""
        self.level_colors(bound)
        return self.app.no_color or self._alike

    def level_styles(self, bound: int) -> list[Style]:
        """Cell style of utility 0..K (index with min(level, K): in-use experts may report K+1)."""
        self.level_colors(bound)
        return self._styles

    # -- line API -------------------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width or self.size.width
        base = self.rich_style
        if self.frame is None:
            said = textwrap.wrap(self.idle, max(width - 2, 8))
            text = " " + said[y] if y < len(said) else ""
            return Strip([Segment(text.ljust(width), base)]).crop(0, width)
        self._relayout()
        shown, (top, bottom) = min(self.size.height, self.virtual_size.height), self._pinned
        if y < top:
            segments = self._header() if y == 0 else self._ruler()
        elif shown - bottom <= y < shown:
            segments = self._legend(y - (shown - bottom))
        elif top <= y < shown - bottom and y - top + self.scroll_offset.y < len(self._rows):
            segments = self._row(y - top + self.scroll_offset.y)
        else:
            segments = []
        return Strip(segments).extend_cell_length(width, base).crop(0, width)

    def _header(self) -> list[Segment]:
        f = self.frame
        n_experts = max((len(r) for r in f.utility), default=0)
        fold = "1 expert/cell" if self._group == 1 else f"{self._group} experts/cell (max)"
        text = f" {f.policy} · step {f.step} · {len(f.utility)}×{n_experts} · {fold}"
        return [Segment(text, self.get_component_rich_style("expert-heatmap--header"))]

    def _ruler(self) -> list[Segment]:
        """Expert index above every 8th cell, and "τ" above the τ column."""
        label_w, tau_w = self._columns
        n_cells = max((len(r) for r in self._rows), default=0)
        ruler, c = [" "] * n_cells, 0
        while c < n_cells:
            tick = str(c * self._group)
            if c + len(tick) <= n_cells:
                ruler[c:c + len(tick)] = tick
            c += 8
        muted = self.get_component_rich_style("expert-heatmap--label")
        return [Segment(" " * (label_w + 1) + "".join(ruler) + " ", muted),
                Segment("τ".rjust(tau_w), self.get_component_rich_style("expert-heatmap--tau"))]

    def _row(self, layer: int) -> list[Segment]:
        f = self.frame
        label_w, tau_w = self._columns
        segments = [Segment(self._labels[layer].rjust(label_w) + " ",
                            self.get_component_rich_style("expert-heatmap--label"))]
        styles, top = self.level_styles(f.utility_bound), f.utility_bound
        run, run_style = "", None  # neighbouring cells of one style become one segment
        plain = self.plain(top)
        marked = [self.rich_style + style for style in MARKED]
        for level, n_resident, n in self._rows[layer]:
            style = styles[min(max(level, 0), top)]
            if plain:
                style = marked[2 if n_resident == n else 1 if n_resident else 0]
            if style is not run_style and run:
                segments.append(Segment(run, run_style))
                run = ""
            run += level_mark(level, top) if plain else ALL_RESIDENT if n_resident == n else SOME_RESIDENT if n_resident else " "
            run_style = style
        if run:
            segments.append(Segment(run, run_style))
        tau = f.tau[layer] if layer < len(f.tau) else 0
        segments += [Segment(" ", self.rich_style),
                     Segment(str(tau).rjust(tau_w), self.get_component_rich_style("expert-heatmap--tau"))]
        return segments

    def _legend(self, line: int) -> list[Segment]:
        f, muted = self.frame, self.get_component_rich_style("expert-heatmap--label")
        plain = self.plain(f.utility_bound)
        if line == 1 and plain:
            some = [Segment("  ", muted), Segment("2", muted + MARKED[1]), Segment(" partly", muted)] if self._group > 1 else []
            return [Segment(" ", muted), Segment("2", muted + MARKED[2]), Segment(" resident", muted), *some,
                    Segment("  τ threshold (keep utility ≥ τ)", muted)]
        if line == 1:
            some = f"  {SOME_RESIDENT} partly" if self._group > 1 else ""
            text = f" {ALL_RESIDENT} resident{some}  τ threshold (keep utility ≥ τ)"
            return [Segment(text, muted)]
        bound = f.utility_bound
        if plain:
            scaled = f", 1-9 scaled from 1-{bound}" if bound > 9 else ""
            return [Segment(f" utility 0-{bound}: · is 0{scaled}", muted)]
        # Up to 12 swatches: large K shows evenly spaced levels, always including 0 and K.
        levels = sorted({round(i * bound / min(bound, 11)) for i in range(min(bound, 11) + 1)}) if bound else [0]
        segments = [Segment(" utility ", muted)]
        styles = self.level_styles(bound)
        for level in levels:
            segments += [Segment(f" {level} ", styles[level]), Segment(" ", self.rich_style)]
        return segments
