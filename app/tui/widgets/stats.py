"""The figures beside the heatmap: which engine (embedded or a remote backend), tokens/s history, acceptance, hit
rate, traffic, busy split, memory, the prompt's reused tokens and the conversations' KV caches kept
(engine/prefix_cache.py).

One `Static` per line (ids below, so the chat screen and tests can find them) and Textual's
`Sparkline` for the tokens/s history. Bars are drawn as text with theme variables in Textual
markup, so they follow light and dark themes; an unknown figure (None) reads "n/a".
"""
from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from moechat.app.tui.messages import Stats

HISTORY = 120  # tokens/s samples kept for the sparkline
BAR_WIDTH = 16
LABEL_WIDTH = 12  # "bytes/token " before each figure


def human_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"; binary units, 3 significant figures."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def percent(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def seconds(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A filled/empty bar in Textual markup; over 1.0 turns $error (over budget)."""
    filled = round(min(max(fraction, 0.0), 1.0) * width)
    colour = "$error" if fraction > 1.0 else "$primary"
    return f"[{colour}]{'█' * filled}[/][$text-muted]{'░' * (width - filled)}[/]"


def bar_width(room: int, figures: str) -> int:
    """Cells for a bar before `figures` in `room` columns: BAR_WIDTH, less where the figures would not fit beside it, none
    under 4. The figures come first: a narrow expert view cut them off (at 60 columns the line wrapped, leaving its label
    alone)."""
    width = min(BAR_WIDTH, room - len(figures) - 1)
    return width if width >= 4 else 0


def with_bar(drawn: str, figures: str) -> str:
    return f"{drawn} {figures}" if drawn else figures


def busy_bar(cpu_s: float, device_s: float, width: int = BAR_WIDTH) -> str:
    """CPU share then device share of the step's expert time in one bar."""
    total = cpu_s + device_s
    if width <= 0:
        return ""
    if total <= 0:
        return f"[$text-muted]{'░' * width}[/]"
    cpu = round(width * cpu_s / total)
    return f"[$warning]{'█' * cpu}[/][$primary]{'█' * (width - cpu)}[/]"


def memory_line(used: int | None, budget: int | None, room: int, more: str = "") -> str:
    """Used of budget as a bar and figures (then `more`, where it fits whole: a narrow panel cut it mid-word) in `room`
    columns."""
    figures = "n/a" if used is None else f"{human_bytes(used)} / {'n/a' if budget is None else human_bytes(budget)}"
    figures += more if len(figures + more) <= room else ""
    width = bar_width(room, figures)
    if not width:
        return figures
    if used is None or budget is None:
        return f"[$text-muted]{'░' * width}[/] {figures}"
    return f"{bar(used / budget if budget else 2.0, width)} {figures}"


class StatsPanel(Vertical):
    """Live engine figures; call `update_stats` with each `Stats` (the bridge coalesces them)."""

    DEFAULT_CSS = """
    StatsPanel { height: auto; padding: 0 1; }
    StatsPanel > Static { height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    StatsPanel > Sparkline { height: 2; margin-bottom: 1; }
    """

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.history: deque[float] = deque(maxlen=HISTORY)
        self.stats: Stats | None = None

    def compose(self) -> ComposeResult:
        yield Static("engine      n/a", id="engine")
        yield Static("tokens/s    n/a", id="tps")
        yield Sparkline([], id="tps-history")
        for key in ("acceptance", "hit-rate", "bytes-per-token", "pcie", "busy", "vram", "ram", "prompt", "kv-kept"):
            yield Static("", id=key)

    def on_mount(self) -> None:
        self.draw()

    def on_resize(self) -> None:
        self.draw()  # the bars take what the figures leave of the width

    def update_stats(self, stats: Stats, draw: bool = True) -> None:
        """Keep `stats` (and its rate in the history); draw=False while the panel is hidden: `draw` shows it later."""
        self.stats = stats
        self.history.append(stats.tokens_per_s)
        if draw and self.is_mounted:
            self.draw()

    def draw(self) -> None:
        s = self.stats or Stats()
        room = (self.content_region.width or 80) - LABEL_WIDTH  # columns after the labels
        cpu, device = seconds(s.cpu_busy_s), seconds(s.device_busy_s)
        busy = busy_bar(s.cpu_busy_s, s.device_busy_s, bar_width(room, f"CPU {cpu} · device {device}"))
        # the engine's kept prompts, not the chat list's chats: a stopped reply and its regeneration are two
        kept = f"{s.kept_conversations} prompt" + ("" if s.kept_conversations == 1 else "s")
        where = f"remote {s.remote} (its figures; memory is the server's)" if s.remote else "embedded"
        lines = {
            "engine": f"engine      {where}" if self.stats else "engine      n/a",
            "tps": f"tokens/s    [b]{s.tokens_per_s:.1f}[/b]" if self.stats else "tokens/s    n/a",
            "acceptance": f"acceptance  {percent(s.acceptance)}",
            "hit-rate": f"hit rate    {percent(s.hit_rate)}",
            "bytes-per-token": f"bytes/token {human_bytes(s.bytes_per_token)}",
            "pcie": f"PCIe        {human_bytes(s.pcie_bytes_s)}/s",
            "busy": f"busy        {with_bar(busy, f'[$warning]CPU[/] {cpu} · [$primary]device[/] {device}')}",
            "vram": f"VRAM        {memory_line(s.vram_used, s.vram_budget, room)}",
            "ram": f"RAM         {memory_line(s.ram_used, s.ram_budget, room)}",
            "prompt": (f"prompt      {s.prompt_tokens:,} tokens, {s.reused_tokens:,} reused" if s.prompt_tokens
                       else "prompt      n/a"),
            "kv-kept": ("KV kept     " + memory_line(s.kept_bytes, s.kept_budget, room, f" · {kept}")
                        if s.kept_budget else "KV kept     off"),
        }
        for key, text in lines.items():
            for line in self.query(f"#{key}").results(Static):  # none once the app has closed
                if line.content != text:  # one line high whatever its text: no layout of the screen
                    line.update(text, layout=False)
        for sparkline in self.query(Sparkline):
            sparkline.data = list(self.history)
