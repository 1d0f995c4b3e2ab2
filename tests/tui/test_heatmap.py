"""The live expert view: ExpertHeatmap (fold, τ, residency, capped redraws) and StatsPanel."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static

from moechat.app.tui.messages import Frame, Stats
from moechat.app.tui.widgets.heatmap import (
    ALL_RESIDENT,
    INTERVAL_S,
    SOME_RESIDENT,
    ExpertHeatmap,
    fold_row,
    grid_cells,
    group_size,
)
from moechat.app.tui.widgets.stats import StatsPanel, human_bytes

pytestmark = pytest.mark.notorch  # runs without torch (the Python 3.10 check)

L, E, K = 48, 128, 4


@pytest.fixture(autouse=True)
def truecolor(monkeypatch):
    """Drawn as on a terminal of true colour, whatever TERM and COLORTERM the tests run under (TERM=xterm alone is 16
    colours, where the levels show as digits); a test asks for fewer colours itself."""
    from textual import constants

    monkeypatch.setattr(constants, "COLOR_SYSTEM", "truecolor")  # read as each app is made


def make_frame(step: int = 0, seed: int = 0, layers: int = L, experts: int = E) -> Frame:
    """Deterministic frame: seeded utilities, resident where utility ≥ τ, τ cycling 1..K."""
    rng = random.Random(seed)
    utility = [[min(K, int(rng.expovariate(1.2))) for _ in range(experts)] for _ in range(layers)]
    tau = [1 + layer % K for layer in range(layers)]
    resident = [[u >= t for u in row] for row, t in zip(utility, tau)]
    return Frame(utility, resident, tau, K, "utility", step)


def make_stats(tokens_per_s: float = 12.5, **kv) -> Stats:
    return Stats(tokens_per_s=tokens_per_s, acceptance=0.734, hit_rate=None, bytes_per_token=3.5 * 2**20,
                 pcie_bytes_s=11.5 * 2**30, cpu_busy_s=0.012, device_busy_s=0.004,
                 vram_used=5 * 2**30, vram_budget=8 * 2**30, ram_used=None, ram_budget=64 * 2**30, new_tokens=40, **kv)


class Demo(App):
    """Demo harness: both widgets side by side, fed frames and stats by the test."""

    CSS = "ExpertHeatmap { width: 1fr; height: 1fr; } StatsPanel { width: 60; }"

    def __init__(self, heatmap: bool = True, stats: bool = True) -> None:
        super().__init__()
        self.show_heatmap, self.show_stats = heatmap, stats

    def compose(self) -> ComposeResult:
        with Horizontal():
            if self.show_heatmap:
                yield ExpertHeatmap()
            if self.show_stats:
                yield StatsPanel()


def lines(heatmap: ExpertHeatmap) -> list[str]:
    return [heatmap.render_line(y).text for y in range(heatmap.size.height)]


# -- fold logic by hand -----------------------------------------------------------------------------

def test_fold_48x128_at_120_columns():
    frame = make_frame()
    # 120 columns less a 2-column scrollbar: label "47" + space + cells + space + τ (1 digit).
    cells = grid_cells(118, frame)
    assert cells == 118 - 2 - 1 - 1 - 1
    assert group_size(E, cells) == 2  # 113 cells cannot hold 128 experts; pairs (64 cells) can
    assert group_size(E, 128) == 1 and group_size(E, 40) == 4
    row = [0] * E
    row[77] = K  # one hot expert...
    folded = fold_row(row, [False] * E, 2)
    assert len(folded) == 64
    assert folded[38] == (K, 0, 2)  # ...makes its cell (experts 76, 77) hot: max, not mean
    assert all(level == 0 for i, (level, _, _) in enumerate(folded) if i != 38)
    assert fold_row([1, 2, 3], [True, False, True], 2) == [(2, 1, 2), (3, 1, 1)]  # short last group


# -- the widget ---------------------------------------------------------------------------------------

def test_flood_of_frames_draws_few_times_and_shows_the_newest():
    async def run():
        app = Demo(stats=False)
        async with app.run_test(size=(120, 40)) as pilot:
            heatmap = app.query_one(ExpertHeatmap)
            frames = [make_frame(step=i, seed=i % 3) for i in range(200)]
            start = time.monotonic()
            for i, frame in enumerate(frames):  # 200 frames as fast as the loop lets them in
                heatmap.update_frame(frame)
                if i % 20 == 0:
                    await asyncio.sleep(0.01)
            elapsed = time.monotonic() - start
            await pilot.pause(2 * INTERVAL_S)
            await pilot.pause()
            assert heatmap.frame is frames[-1]
            assert heatmap.draws <= elapsed / INTERVAL_S + 2, (heatmap.draws, elapsed)
            assert heatmap.draws < 20
            shown = lines(heatmap)
            assert "step 199" in shown[0] and "2 experts/cell (max)" in shown[0]
            # Layer 0's cells match the newest frame's residency, folded by 2.
            want = fold_row(frames[-1].utility[0], frames[-1].resident[0], 2)
            glyphs = "".join(ALL_RESIDENT if r == n else SOME_RESIDENT if r else " " for _, r, n in want)
            assert shown[2][3:3 + 64] == glyphs
    asyncio.run(run())


def test_tau_column_resident_mark_and_legend():
    async def run():
        app = Demo(stats=False)
        async with app.run_test(size=(120, 40)) as pilot:
            heatmap = app.query_one(ExpertHeatmap)
            frame = make_frame(layers=6, experts=16)
            frame.tau = [0, 1, 2, 3, 4, 5]
            frame.resident = [[False] * 16 for _ in range(6)]
            frame.resident[3][5] = True
            heatmap.update_frame(frame)
            await pilot.pause(2 * INTERVAL_S)
            shown = lines(heatmap)
            rows = shown[2:8]
            assert [row.rstrip().split()[-1] for row in rows] == ["0", "1", "2", "3", "4", "5"]  # τ per row
            assert "τ" in shown[1]
            assert heatmap._group == 1  # 16 experts fit: one per cell
            assert [row.count(ALL_RESIDENT) for row in rows] == [0, 0, 0, 1, 0, 0]
            assert rows[3][2 + 5] == ALL_RESIDENT  # label "3" + space, then expert 5
            assert "utility" in shown[8] and " 0 " in shown[8] and f" {K} " in shown[8]
            assert ALL_RESIDENT in shown[9] and "resident" in shown[9]
            # The hot colour differs from the cold one (theme ramp).
            palette = heatmap.level_colors(K)
            assert len(palette) == K + 1 and palette[0] != palette[K]
    asyncio.run(run())


def test_rows_scroll_with_pinned_header_and_legend():
    async def run():
        app = Demo(stats=False)
        async with app.run_test(size=(120, 40)) as pilot:
            heatmap = app.query_one(ExpertHeatmap)
            heatmap.update_frame(make_frame())
            await pilot.pause(2 * INTERVAL_S)
            assert lines(heatmap)[2].startswith(" 0 ")
            heatmap.scroll_end(animate=False, immediate=True)
            await pilot.pause()
            shown = lines(heatmap)
            assert shown[0].startswith(" utility · step 0 · 48×128")
            assert shown[-3].startswith(f"{L - 1} ")  # last layer just above the legend
            assert "utility" in shown[-2]
    asyncio.run(run())


@pytest.mark.parametrize("size", [(60, 20), (80, 24), (100, 30)])
def test_the_chat_apps_expert_view_shows_layer_rows_on_a_small_terminal(tmp_path, size):
    """At 60×20 the stats left the heatmap four rows, all four its pinned header and legend: no layer at all."""
    from test_tui_chat import pilot_test, without_model

    @pilot_test
    async def run():
        async with without_model(tmp_path, size) as (app, pilot):
            app.chat.show_stats(make_stats())
            app.chat.show_frame(make_frame())
            await pilot.press("f3")
            await pilot.pause(2 * INTERVAL_S)
            heatmap = app.chat.heatmap
            rows = [line for line in lines(heatmap) if line.split() and line.split()[0].isdigit() and line.rstrip()[-1].isdigit()]
            assert len(rows) >= min(heatmap.size.height, 3) and rows[0].split()[0] == "0", lines(heatmap)
            heatmap.scroll_end(animate=False, immediate=True)
            await pilot.pause()
            assert any(line.startswith(f"{L - 1} ") for line in lines(heatmap)), lines(heatmap)  # the last one a scroll away
    run()


def test_colours_follow_the_theme():
    async def run():
        app = Demo(stats=False)
        async with app.run_test(size=(80, 20)) as pilot:
            heatmap = app.query_one(ExpertHeatmap)
            heatmap.update_frame(make_frame(layers=4, experts=8))
            app.theme = "textual-dark"
            await pilot.pause(2 * INTERVAL_S)
            dark = heatmap.level_colors(K)
            app.theme = "textual-light"
            await pilot.pause()
            light = heatmap.level_colors(K)
            assert dark[0] != light[0] and light[0].brightness > dark[0].brightness  # cold cells follow the surface
            assert len({c.hex for c in light}) == K + 1  # every level distinct on the light theme too
    asyncio.run(run())


@pytest.mark.parametrize("bound", [4, 12])
def test_without_colour_a_cell_shows_its_utility_and_residency_in_text(monkeypatch, bound):
    """Utility was a background colour alone: under NO_COLOR (Textual draws in grey) level K came out darker than K-1
    and 1 as 0, so the heatmap no longer said which experts were hot."""
    monkeypatch.setenv("NO_COLOR", "1")

    async def run():
        app = Demo(stats=False)
        async with app.run_test(size=(80, 16)) as pilot:
            heatmap = app.query_one(ExpertHeatmap)
            utility = [[0, 1, bound // 2, bound, bound + 1, 0] * 4] * 2  # in-use experts report K+1
            resident = [[False, True, False, True, False, False] * 4] * 2
            heatmap.update_frame(Frame(utility, resident, [1, 1], bound, "spac"))
            await pilot.pause(2 * INTERVAL_S)
            await pilot.pause()
            row = heatmap.render_line(2)
            marks = ["·", "1", "2", "4", "4", "·"] if bound == 4 else ["·", "1", "5", "9", "9", "·"]
            assert row.text.split()[:2] == ["0", "".join(marks) * 4]
            cells = [(char, bool(segment.style.reverse)) for segment in row if segment.text.strip(" ") and segment.text[0] in
                     "·123456789" for char in segment.text]
            assert cells[:6] == [(m, bool(r)) for m, r in zip(marks, resident[0])]
            text = lines(heatmap)
            assert any(line.startswith(f" utility 0-{bound}: · is 0") for line in text)
            assert any(line.startswith(" 2 resident") for line in text)
    asyncio.run(run())


@pytest.mark.parametrize("system", ["standard", "256", "truecolor"])
def test_each_level_reads_apart_in_the_terminals_colours(monkeypatch, system):
    """On a terminal of 16 colours (TERM=xterm, no COLORTERM) the theme's ramp fell on two or three ANSI colours: levels
    0 and 1, K-1 and K looked the same. There a cell shows its utility as a digit, as without colour."""
    from rich.console import COLOR_SYSTEMS
    from textual import constants

    monkeypatch.setattr(constants, "COLOR_SYSTEM", system)
    bound = 8

    async def run():
        app = Demo(stats=False)
        async with app.run_test(size=(80, 16)) as pilot:
            assert app.console.color_system == system
            heatmap = app.query_one(ExpertHeatmap)
            utility = [list(range(bound + 1)) * 2] * 2
            heatmap.update_frame(Frame(utility, [[False] * len(utility[0])] * 2, [1, 1], bound, "spac"))
            await pilot.pause(2 * INTERVAL_S)
            await pilot.pause()
            for theme in ("textual-dark", "textual-light"):
                app.theme = theme
                await pilot.pause()
                sent = {tuple(style.bgcolor.downgrade(COLOR_SYSTEMS[system]).get_ansi_codes(False))
                        for style in heatmap.level_styles(bound)}  # what the terminal is sent for levels 0..K
                alike = len(sent) < bound + 1
                assert alike == (system == "standard") or system == "256"  # 256 colours: alike at this K on some themes
                cells = "".join(segment.text for segment in heatmap.render_line(2))[2:2 + bound + 1]
                assert cells == ("·12345678" if alike else " " * (bound + 1)), (theme, sent)  # no expert resident
    asyncio.run(run())


def test_stats_panel_formats_values_and_na():
    async def run():
        app = Demo(heatmap=False)
        async with app.run_test(size=(80, 16)) as pilot:
            panel = app.query_one(StatsPanel)
            for i in range(10):
                panel.update_stats(make_stats(tokens_per_s=10.0 + i))
            await pilot.pause()
            text = {w.id: str(w.render()) for w in panel.query(Static)}
            assert text["tps"] == "tokens/s    19.0"
            assert text["acceptance"].endswith("73.4%")
            assert text["hit-rate"].endswith("n/a")
            assert text["bytes-per-token"].endswith("3.5 MiB")
            assert text["pcie"].endswith("11.5 GiB/s")
            assert "CPU 12.0 ms" in text["busy"] and "device 4.0 ms" in text["busy"]
            assert text["busy"].count("█") == 16
            assert text["vram"].endswith("5 GiB / 8 GiB") and text["vram"].count("█") == 10
            assert text["ram"].endswith("n/a")
            assert text["prompt"] == "prompt      n/a" and text["kv-kept"] == "KV kept     off"
            panel.update_stats(make_stats(prompt_tokens=1234, reused_tokens=1200, kept_conversations=3,
                                          kept_bytes=3 << 29, kept_budget=4 << 30))
            await pilot.pause()
            text = {w.id: str(w.render()) for w in panel.query(Static)}
            assert text["prompt"] == "prompt      1,234 tokens, 1,200 reused"
            assert text["kv-kept"].endswith("1.5 GiB / 4 GiB · 3 prompts") and text["kv-kept"].count("█") == 6
            panel.history.pop()
            assert list(panel.history) == [10.0 + i for i in range(10)]
            panel.update_stats(make_stats(prompt_tokens=9, kept_conversations=1, kept_bytes=1 << 20, kept_budget=4 << 30))
            await pilot.pause()
            assert str(panel.query_one("#kv-kept").render()).endswith("1 MiB / 4 GiB · 1 prompt")  # not "1 prompts"
    asyncio.run(run())


@pytest.mark.parametrize("width", [29, 39])  # the stats' width in the expert view at 60 and 80 columns
def test_a_narrow_stats_panel_shows_the_figures_beside_its_bars(width):
    """At 60 columns the busy, VRAM and RAM lines showed their labels alone (the 16-cell bar left no room, and the line
    wrapped out of its one row); at 80 the device time and the VRAM budget were cut off."""
    async def run():
        app = Demo(heatmap=False)
        async with app.run_test(size=(80, 16)) as pilot:
            panel = app.query_one(StatsPanel)
            panel.styles.width = width
            deadline = time.monotonic() + 10
            while panel.content_region.width != width - 2:  # the new width laid out (padding 0 1)
                assert time.monotonic() < deadline, panel.content_region
                await pilot.pause(0.02)
            panel.update_stats(make_stats(kept_conversations=3, kept_bytes=3 << 29, kept_budget=4 << 30))
            await pilot.pause()
            shown = {key: panel.query_one(f"#{key}").render_line(0).text.rstrip() for key in ("busy", "vram", "ram", "kv-kept")}
            assert shown["busy"].startswith("busy        CPU 12.0 ms ·"), shown
            assert shown["vram"].startswith("VRAM        ") and shown["vram"].endswith(" 5 GiB / 8 GiB"), shown
            assert shown["ram"].startswith("RAM         ") and shown["ram"].endswith(" n/a"), shown
            assert shown["kv-kept"].startswith("KV kept     ") and shown["kv-kept"].endswith(" 1.5 GiB / 4 GiB"), shown  # whole
            if width == 39:
                assert shown["busy"].startswith("busy        CPU 12.0 ms · device 4.0"), shown
    asyncio.run(run())


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 2**40) == "3 TiB"


# -- snapshots (baselines under tests/__snapshots__/test_heatmap/) --------------------------------------

def test_snapshot_heatmap(snap_compare):
    async def feed(pilot):
        pilot.app.query_one(ExpertHeatmap).update_frame(make_frame(step=42, seed=5))
        await pilot.pause(2 * INTERVAL_S)
        await pilot.pause()

    assert snap_compare(Demo(stats=False), terminal_size=(120, 40), run_before=feed)


def test_snapshot_stats(snap_compare):
    async def feed(pilot):
        panel = pilot.app.query_one(StatsPanel)
        for i in range(40):
            panel.update_stats(make_stats(tokens_per_s=8.0 + (i * 7) % 11))
        await pilot.pause()

    assert snap_compare(Demo(heatmap=False), terminal_size=(60, 14), run_before=feed)
