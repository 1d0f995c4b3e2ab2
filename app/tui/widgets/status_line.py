"""The chat screen's status line: the model, the reply's figures, then the engine's state, in a short form that fits
a narrow terminal rather than a cut (`status_line`); `StatusLine` draws it for its width."""
from __future__ import annotations

from rich.cells import cell_len
from textual.content import Content
from textual.widgets import Static

from ..messages import Stats


def status_line(model: str, state: str, stats: Stats | None, brief: str = "", width: int | None = None) -> str:
    """Model, then the reply's figures (they matter most), then the state: the engine's summary once it is ready. Wider
    than `width`: the figures abbreviated, those with no value left out, and the summary's short form `brief`, whose last
    parts go until it fits (Textual cut the line mid-word below about 150 columns)."""
    parts = [model or "no model"]
    if stats is not None:
        parts.append(f"{stats.tokens_per_s:.1f} tok/s")
        parts.append("acceptance –" if stats.acceptance is None else f"acceptance {stats.acceptance:.2f}")
        parts.append("hit rate –" if stats.hit_rate is None else f"hit rate {stats.hit_rate:.2f}")
        parts.append(f"{stats.new_tokens} tokens")
    line = "  ·  ".join(p for p in [*parts, state] if p)
    if width is None or cell_len(line) <= width:
        return line
    short = [model or "no model"]
    if stats is not None:
        short.append(f"{stats.tokens_per_s:.1f} tok/s")
        short += [f"{name} {value:.2f}" for name, value in (("acc", stats.acceptance), ("hit", stats.hit_rate))
                  if value is not None]
        short.append(f"{stats.new_tokens} tok")
    tail = brief.split(" · ") if brief else [state]  # a loading or failure line kept whole: cut, with an ellipsis
    while len(tail) > (0 if brief else 1) and cell_len(" · ".join(short + tail)) > width:
        tail.pop()
    return " · ".join(short + tail)


class StatusLine(Static):
    """The status line: `status_line` for its width, chosen again when the terminal's width changes."""

    def __init__(self, **kwargs) -> None:
        super().__init__(markup=False, **kwargs)  # an error message may hold "[/b]"
        self.parts: tuple = ("", "starting", None, "")  # model, state, stats, brief

    def show(self, *parts) -> None:
        if parts != self.parts:
            self.parts = parts
            self.refresh()  # one line high whatever its text: no layout of the screen

    def render(self) -> Content:
        return Content(status_line(*self.parts, width=self.content_size.width or None))
