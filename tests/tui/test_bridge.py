"""The engine thread (`app/bridge.py`) against the real engine on tiny models: loading, streaming,
stats and heatmap frames, stopping, failing and reloading, coalescing, closing, unloading for the wizard, and
messages arriving on a real Textual app."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from moechat.app.bridge import EngineBridge
from moechat.app.tui.messages import (
    EngineFailed,
    EngineLoading,
    EngineReady,
    ExpertFrame,
    ReplyDelta,
    ReplyFinished,
    ReplyNotice,
    ReplyProgress,
    ReplyStats,
)
from moechat.engine.config import (
    EngineConfig,
    SamplingParams,
    SchedulerConfig,
    SpecConfig,
)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a mixture of experts model?"}]
TIMEOUT = 60


class Inbox:
    """A thread-safe `post`: keeps every message and wakes whoever waits for one."""

    def __init__(self):
        self.messages, self.cond = [], threading.Condition()

    def __call__(self, message) -> bool:
        with self.cond:
            self.messages.append(message)
            self.cond.notify_all()
        return True

    def of(self, kind, **match) -> list:
        with self.cond:
            return [m for m in self.messages if isinstance(m, kind) and all(getattr(m, k) == v for k, v in match.items())]

    def wait(self, kind, count: int = 1, **match):
        deadline = time.monotonic() + TIMEOUT
        with self.cond:
            while len(found := self.of(kind, **match)) < count:
                assert self.cond.wait(deadline - time.monotonic()), f"no {kind.__name__} {match} in {TIMEOUT} s"
            return found[count - 1]

    def ending(self, request_id: int):
        """The one message that ends a request: ReplyFinished or EngineFailed."""
        deadline = time.monotonic() + TIMEOUT
        with self.cond:
            while not (ends := self.of(ReplyFinished, request_id=request_id) + self.of(EngineFailed, request_id=request_id)):
                assert self.cond.wait(deadline - time.monotonic()), f"request {request_id} did not end"
            return ends[0]


def started(factory, interval: float = 0.1) -> tuple[EngineBridge, Inbox]:
    inbox = Inbox()
    bridge = EngineBridge(inbox, factory, frame_interval_s=interval)
    bridge.start()
    return bridge, inbox


def test_a_first_quantization_shows_in_the_loading_bar(checkpoint):
    """Minutes on a real model: the loading messages name the quantization and its layers, in order, before ready."""
    path = checkpoint("olmoe", seed=9)
    bridge, inbox = started(lambda: EngineConfig(str(path), quant="int8"))
    try:
        inbox.wait(EngineReady)
        loading = inbox.of(EngineLoading)
        assert [m.fraction for m in loading] == sorted(m.fraction for m in loading) and loading[-1].label == "ready"
        layers = [m.label for m in loading if "quantizing experts (int8, once)" in m.label]
        assert layers and layers[-1].endswith(f"layer {len(layers) - 1} of {len(layers) - 1}")
        assert all(label.startswith(path.name) for label in layers)
    finally:
        bridge.close()


def test_what_resolving_the_config_said_reaches_the_ready_notice(checkpoint):
    """engine_config's warnings go to stderr, which the chat app's terminal never shows: a calibration profile set aside
    (corrupt, from another machine or moechat) was said nowhere in the app; the config carries it to EngineReady."""
    said = "calibration profile p.toml is corrupt: moved to p.toml.bad"
    bridge, inbox = started(lambda: EngineConfig(str(checkpoint("qwen3_moe")), notices=(said,)))
    try:
        ready = inbox.wait(EngineReady)
        assert said in ready.notice and "calibration profile" not in ready.summary  # none used
    finally:
        bridge.close()


def test_the_status_says_when_a_calibration_profile_is_used(checkpoint):
    from moechat.engine.calibration.types import Measurements

    measured = SchedulerConfig(policy="lru", measured=Measurements(expert_bytes=1, cpu_s_per_expert=[1e-4]))
    bridge, inbox = started(lambda: EngineConfig(str(checkpoint("qwen3_moe")), scheduler=measured))
    try:
        assert inbox.wait(EngineReady).summary.endswith("policy lru · calibration profile")
    finally:
        bridge.close()


def test_quitting_during_a_first_quantization_stops_it_and_leaves_no_half_cache(checkpoint, tmp_path, monkeypatch):
    """The app quit while its engine thread quantized: the daemon thread kept going until the process ended, leaving a
    half-written private copy of the experts for 10 minutes or for good, and aborting the process ("terminate called
    without an active exception") when PyTorch's threads went away under it. It stops at the next layer now."""
    monkeypatch.setenv("MOECHAT_QUANT_DIR", str(tmp_path))
    path, inbox = checkpoint("olmoe", seed=11), Inbox()

    def post(message) -> bool:
        inbox(message)
        if isinstance(message, EngineLoading) and "quantizing" in message.label:
            bridge.close()  # as the app's quit does, here while the first layer is quantized
        return True

    bridge = EngineBridge(post, lambda: EngineConfig(str(path), quant="int8"))
    bridge.start()
    bridge._thread.join(TIMEOUT)
    assert not bridge._thread.is_alive() and not inbox.of(EngineReady)
    assert list(tmp_path.iterdir()) == []  # neither a cache nor a private build folder


def test_the_status_names_a_pre_quantized_checkpoints_format_and_a_quant_that_does_not_apply(checkpoint, tmp_path):
    """A GPTQ checkpoint's status said '0/16 int4 experts' as for moechat's own int4, and the settings' quant int8 on it
    reached the load's notice only; the status names GPTQ, the notice says int8 does not apply."""
    from tests.quant.gptq_pack import make_gptq_checkpoint

    gptq = make_gptq_checkpoint(checkpoint("qwen3_moe"), tmp_path / "gptq", group_size=32)
    bridge, inbox = started(lambda: EngineConfig(str(gptq), quant="int8"))
    try:
        ready = inbox.wait(EngineReady)
        assert "int4 (GPTQ) experts" in ready.summary and "int4 (GPTQ) experts" in ready.brief
        assert "quant int8 does not apply: the checkpoint is quantized in int4" in ready.notice
    finally:
        bridge.close()


def test_a_load_that_outlasts_close_says_it_still_runs():
    """close() waits a moment for a load; one still running (inside PyTorch's ops, which nothing can cut short) must not
    be left to the interpreter's exit, which aborts the process under it: run_tui ends with os._exit when it says so."""
    entered, release = threading.Event(), threading.Event()

    def slow_config():  # a load that takes longer than close() waits
        entered.set()
        release.wait(60)
        raise RuntimeError("never loads")

    bridge, _ = started(slow_config)
    assert entered.wait(30)
    bridge.close()
    assert bridge.still_running
    release.set()
    bridge._thread.join(30)
    assert not bridge.still_running


def test_load_stream_stats_and_spac_frames(checkpoint):
    path = checkpoint("qwen3_moe")
    bridge, inbox = started(lambda: EngineConfig(str(path), expert_cache_ratio=0.5, spec=SpecConfig("self", 3)),
                            interval=0.0)  # every step: enough frames to check
    try:
        ready = inbox.wait(EngineReady)
        loading = inbox.of(EngineLoading)
        assert [m.fraction for m in loading] == sorted(m.fraction for m in loading) and loading[-1].fraction == 1.0
        assert ready.model == path.name and "\n" not in ready.summary
        assert ready.summary.startswith("on cpu in float32 · ") and path.name not in ready.summary  # the line names it first
        assert "8/16 experts" in ready.summary and "self" in ready.summary and "spac" in ready.summary
        assert ready.brief == "cpu fp32 · 8/16 on fast tier · drafter self γ3 · policy spac"  # the status line's short form

        bridge.generate(7, CHAT, SamplingParams(max_new_tokens=24))
        assert bridge.busy
        fin = inbox.ending(7)
        assert not bridge.busy
        assert isinstance(fin, ReplyFinished) and fin.reason == "length" and fin.text
        assert "".join(m.text for m in inbox.of(ReplyDelta, request_id=7)) == fin.text
        s = fin.stats
        assert s.new_tokens == 24 and s.tokens_per_s > 0 and 0 <= s.acceptance <= 1 and 0 <= s.hit_rate <= 1
        assert s.vram_used is None and s.ram_used > 0 and s.ram_budget > 0 and s.cpu_busy_s >= 0
        stats = inbox.of(ReplyStats, request_id=7)
        assert stats and stats[-1].stats == s  # the final ReplyStats is the reply's own

        frames = [m.frame for m in inbox.of(ExpertFrame)]
        assert len(frames) >= 2
        L, E, K = 2, 8, 4  # sparse layers and experts of the tiny qwen3_moe; the default K
        for f in frames:
            assert f.policy == "spac" and f.utility_bound == K and len(f.tau) == L and f.layer_names == ["0", "2"]
            assert len(f.utility) == L and all(len(row) == E and all(0 <= u <= K for u in row) for row in f.utility)
            assert len(f.resident) == L and all(len(row) == E and all(type(r) is bool for r in row) for row in f.resident)
            assert sum(map(sum, f.resident)) <= 8 and all(0 <= t <= K for t in f.tau)
        assert any(u > 0 for f in frames for row in f.utility for u in row)  # the utilities learned something
        assert [f.step for f in frames] == sorted(f.step for f in frames)
    finally:
        bridge.close()


def test_the_live_hit_rate_counts_the_prompt_as_the_replys_summary_does(checkpoint):
    """The status line's hit rate while a reply streamed left out the prompt's pass, which the reply's Summary counts: on
    the demo it read 0.71 all reply long and 0.50 at its end. After the last step the running figure is the final one."""
    path = checkpoint("qwen3_moe")
    bridge, inbox = started(lambda: EngineConfig(str(path), expert_cache_ratio=0.5, spec=SpecConfig("self", 3)),
                            interval=0.0)  # a ReplyStats after every step, the last one too
    try:
        inbox.wait(EngineReady)
        bridge.generate(1, CHAT, SamplingParams(max_new_tokens=24))
        assert isinstance(inbox.ending(1), ReplyFinished)
        assert sum(bridge._engine.prompt_counts) > 0  # the prompt's activations, which the Summary counts
        *running, final = [m.stats for m in inbox.of(ReplyStats, request_id=1)]
        assert running and running[-1].hit_rate == pytest.approx(final.hit_rate)
    finally:
        bridge.close()


def test_demand_frames_without_fast_tier_and_stop(checkpoint):
    """No fast tier, no drafter: the status says every expert runs on the CPU, and its short form leaves out the count,
    which read "0/16 experts" (as if none were used); frames show demand (each layer's top-k experts), acceptance and hit
    rate are None; stop() from this thread cancels mid-reply and the next reply runs."""
    path = checkpoint("olmoe")
    bridge, inbox = started(lambda: EngineConfig(str(path), scheduler=SchedulerConfig(policy="lru")), interval=0.0)
    try:
        ready = inbox.wait(EngineReady)
        assert ready.summary == "on cpu in float32 · all 16 experts on the CPU · drafter none · policy lru"
        assert ready.brief == "cpu fp32 · no drafter · policy lru"
        bridge.generate(1, CHAT, SamplingParams(max_new_tokens=480))
        inbox.wait(ReplyDelta, 3, request_id=1)
        bridge.stop()
        fin = inbox.ending(1)
        assert isinstance(fin, ReplyFinished) and fin.reason == "cancelled" and fin.stats.new_tokens < 480
        assert "".join(m.text for m in inbox.of(ReplyDelta, request_id=1)) == fin.text
        assert fin.stats.acceptance is None and fin.stats.hit_rate is None
        for f in (m.frame for m in inbox.of(ExpertFrame)):
            assert f.policy == "lru" and f.tau == [0, 0] and not any(map(any, f.resident))
            # one verified position per step, top-2 routing: every layer shows 2..(2 per position) experts in use
            assert all(2 <= sum(u > 0 for u in row) and all(0 <= u <= 4 for u in row) for row in f.utility)

        bridge.generate(2, CHAT, SamplingParams(max_new_tokens=5))
        fin2 = inbox.ending(2)
        assert isinstance(fin2, ReplyFinished) and fin2.reason == "length" and fin2.stats.new_tokens == 5

        # stop() also cancels replies queued behind the running one; they end with no text
        bridge.generate(3, CHAT, SamplingParams(max_new_tokens=480))
        bridge.generate(4, CHAT, SamplingParams(max_new_tokens=480))
        bridge.stop()
        assert [inbox.ending(r).reason for r in (3, 4)] == ["cancelled", "cancelled"]
        assert inbox.ending(4).text == "" and not inbox.of(ReplyDelta, request_id=4)
        bridge.generate(5, CHAT, SamplingParams(max_new_tokens=3))
        assert inbox.ending(5).reason == "length"
    finally:
        bridge.close()


def test_a_long_prompt_reports_progress_and_stops_between_passes(checkpoint, monkeypatch):
    """The prompt read in passes of 3 tokens: ReplyProgress per pass, in order; a stop after the first ends the reply
    before its first token, and the next reply reuses what was read."""
    from moechat.engine import config

    monkeypatch.setattr(config, "PREFILL_CHUNK", 3)
    bridge, inbox = started(lambda: EngineConfig(str(checkpoint("qwen3_moe"))))
    try:
        inbox.wait(EngineReady)
        bridge.generate(1, CHAT, SamplingParams(max_new_tokens=4))
        assert inbox.ending(1).reason == "length"
        progress = inbox.of(ReplyProgress, request_id=1)
        total = progress[0].total
        assert [(m.done, m.total) for m in progress] == [(d, total) for d in range(3, total, 3)]

        gate, go = threading.Event(), threading.Event()
        post = bridge._post

        def hold_at_first_progress(message):  # stop while the engine thread waits at its first ReplyProgress
            post(message)
            if isinstance(message, ReplyProgress) and message.request_id == 2 and not gate.is_set():
                gate.set()
                go.wait(TIMEOUT)
            return True

        bridge._post = hold_at_first_progress
        bridge.generate(2, CHAT + [{"role": "user", "content": "And why is it fast?"}], SamplingParams(max_new_tokens=4))
        assert gate.wait(TIMEOUT)
        bridge.stop()
        go.set()
        fin = inbox.ending(2)
        assert isinstance(fin, ReplyFinished) and fin.reason == "cancelled" and fin.text == ""
        assert len(inbox.of(ReplyProgress, request_id=2)) == 1 and not inbox.of(ReplyDelta, request_id=2)
    finally:
        bridge.close()


def test_bad_model_then_reload(checkpoint, tmp_path):
    configs = [lambda: EngineConfig(str(tmp_path / "no-such-model"))]  # the factory's config, as the settings say now
    bridge, inbox = started(lambda: configs[-1]())
    try:
        failed = inbox.wait(EngineFailed)
        assert failed.request_id is None and "\n" not in failed.message and "no-such-model" in failed.message
        assert not inbox.of(EngineReady)
        bridge.generate(1, CHAT, SamplingParams(max_new_tokens=3))  # no engine: the request fails, one line
        end = inbox.ending(1)
        assert isinstance(end, EngineFailed) and "no model is loaded" in end.message and not bridge.busy
        assert failed.message in end.message  # why, again: the load's notice may have gone by unread

        configs.append(lambda: EngineConfig(str(checkpoint("mixtral")), dtype="float64"))  # bad config: its own message
        bridge.reload()
        assert "dtype must be one of" in inbox.wait(EngineFailed, 3).message

        configs.append(lambda: EngineConfig(str(checkpoint("mixtral"))))
        bridge.reload()
        inbox.wait(EngineReady)
        bridge.generate(2, CHAT, SamplingParams(max_new_tokens=4))
        end = inbox.ending(2)
        assert isinstance(end, ReplyFinished) and end.reason == "length"
        # an error inside a request ends it with EngineFailed (no ReplyFinished); the engine stays ready
        bridge.generate(3, [{"role": "user", "content": "hello " * 600}], SamplingParams(max_new_tokens=4))
        end = inbox.ending(3)
        assert isinstance(end, EngineFailed) and "context" in end.message and not inbox.of(ReplyFinished, request_id=3)
        bridge.generate(4, CHAT, SamplingParams(max_new_tokens=4))
        assert inbox.ending(4).reason == "length"
    finally:
        bridge.close()


def test_coalescing_sends_only_the_final_stats_and_frame(checkpoint):
    bridge, inbox = started(lambda: EngineConfig(str(checkpoint("olmoe"))), interval=10.0)
    try:
        inbox.wait(EngineReady)
        bridge.generate(1, CHAT, SamplingParams(max_new_tokens=30))
        fin = inbox.ending(1)
        assert fin.reason == "length"
        assert len(inbox.of(ReplyStats)) == 1 and len(inbox.of(ExpertFrame)) == 1
        assert len(inbox.of(ReplyDelta)) > 1  # text is never coalesced
    finally:
        bridge.close()


def test_close_stops_the_reply_and_joins_fast(checkpoint):
    bridge, inbox = started(lambda: EngineConfig(str(checkpoint("olmoe"))))
    inbox.wait(EngineReady)
    bridge.generate(1, CHAT, SamplingParams(max_new_tokens=480))
    inbox.wait(ReplyDelta, 2, request_id=1)
    thread = bridge._thread
    bridge.close()
    assert not thread.is_alive() and thread.daemon  # joined, not given up on after JOIN_S
    assert inbox.ending(1).reason == "cancelled" and len(inbox.of(ReplyDelta, request_id=1)) < 480  # stopped mid-reply
    bridge.close()  # idempotent


def test_close_during_a_load_does_not_hang(checkpoint):
    """Quitting while the model loads: close() gives up after JOIN_S; the queued reload never runs."""
    loaded = []
    release = threading.Event()

    def slow():  # a load that takes longer than close() waits
        release.wait(30)
        loaded.append(1)
        return EngineConfig(str(checkpoint("olmoe")))

    bridge, inbox = started(slow)
    inbox.wait(EngineLoading)  # the first load is under way
    bridge.reload()
    bridge.generate(1, CHAT, SamplingParams(max_new_tokens=3))
    bridge.close()  # returns while the load still blocks: it gave up waiting (after JOIN_S)
    assert bridge._thread.daemon and bridge._thread.is_alive() and not loaded and not release.is_set()
    release.set()
    bridge._thread.join(TIMEOUT)
    assert loaded == [1] and inbox.ending(1).reason == "cancelled"  # the second load was skipped


def test_unload_frees_the_model_for_the_wizard_and_reload_brings_it_back(checkpoint):
    """The setup wizard from the palette measures this machine's free VRAM and RAM: the bridge drops the model first
    (a reply asked meanwhile is one line), and a reload loads it again."""
    bridge, inbox = started(lambda: EngineConfig(str(checkpoint("qwen3_moe"))))
    try:
        inbox.wait(EngineReady)
        freed = bridge.unload()
        assert freed.wait(TIMEOUT) and bridge._engine is None  # the wizard probes the memory after this
        inbox.wait(EngineLoading, label="model unloaded for the setup wizard")
        bridge.generate(1, CHAT, SamplingParams(max_new_tokens=3))
        failed = inbox.wait(EngineFailed, request_id=1)
        assert "unloaded while the setup wizard" in failed.message and "\n" not in failed.message
        bridge.reload()
        inbox.wait(EngineReady, count=2)
        bridge.generate(2, CHAT, SamplingParams(max_new_tokens=3))
        assert inbox.ending(2).reason == "length"
    finally:
        bridge.close()


def test_messages_arrive_on_a_textual_app(checkpoint):
    from textual.app import App

    class Probe(App):
        def __init__(self):
            super().__init__()
            self.ready, self.finished, self.frames = [], [], []

        def on_engine_ready(self, message: EngineReady) -> None:
            self.ready.append(message.model)

        def on_expert_frame(self, message: ExpertFrame) -> None:
            self.frames.append(message.frame)

        def on_reply_finished(self, message: ReplyFinished) -> None:
            self.finished.append(message.text)

    path = checkpoint("olmoe")

    async def run() -> Probe:
        app = Probe()
        async with app.run_test() as pilot:
            bridge = EngineBridge(app.post_message, lambda: EngineConfig(str(path)))
            bridge.start()
            try:
                for wait in ("ready", "finished"):
                    deadline = time.monotonic() + TIMEOUT
                    if wait == "finished":
                        bridge.generate(1, CHAT, SamplingParams(max_new_tokens=6))
                    while not getattr(app, wait) and time.monotonic() < deadline:
                        await pilot.pause(0.05)
            finally:
                bridge.close()
        return app

    app = asyncio.run(run())
    assert app.ready == [path.name] and len(app.finished) == 1 and app.finished[0] and app.frames


@pytest.mark.gpu
def test_cuda_stats_and_reload_frees_the_fast_tier(checkpoint):
    """On CUDA: VRAM figures, spac frames while the transfer thread runs, and a reload that frees the
    old engine's fast tier and its worker threads before the new one loads."""
    import torch

    path = checkpoint("qwen3_moe")
    def factory():
        return EngineConfig(str(path), device="cuda", expert_cache_ratio=0.5, spec=SpecConfig("self", 3))

    bridge, inbox = started(factory, interval=0.0)
    try:
        ready = inbox.wait(EngineReady)
        assert "8/16 experts on the GPU" in ready.summary and " · 8/16 on GPU · " in ready.brief  # the short form says where
        bridge.generate(1, CHAT, SamplingParams(max_new_tokens=16))
        fin = inbox.ending(1)
        assert isinstance(fin, ReplyFinished) and fin.reason == "length"
        assert 0 < fin.stats.vram_used <= fin.stats.vram_budget and fin.stats.hit_rate is not None
        assert all(f.frame.policy == "spac" for f in inbox.of(ExpertFrame)) and inbox.of(ExpertFrame)
        before = torch.cuda.memory_allocated()
        bridge.reload()
        inbox.wait(EngineReady, 2)
        assert torch.cuda.memory_allocated() <= before * 1.05  # the first engine's memory went back
        assert sum(t.name == "moechat-prefetch" for t in threading.enumerate()) == 1
        bridge.generate(2, CHAT, SamplingParams(max_new_tokens=4))
        assert inbox.ending(2).reason == "length"
    finally:
        bridge.close()


def test_the_vram_figure_is_held_to_the_budget_the_user_set(checkpoint, monkeypatch):
    """On CUDA the stats panel's VRAM line sets PyTorch's allocated memory against the user's VRAM budget (the loader's
    hard limit) where one is set: with 4 GiB set on a 141 GiB card it showed 3 of 141 GiB used, a bar nearly empty for a
    budget nearly spent. Here on the CPU with the model's device and CUDA's two figures stood in."""
    import dataclasses

    import torch

    from moechat.app.bridge_meter import ReplyMeter
    from moechat.engine import Engine

    engine = Engine(EngineConfig(str(checkpoint("qwen3_moe")), vram_budget_bytes=4 << 30))
    try:
        monkeypatch.setattr(engine.model, "device", torch.device("cuda"))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 << 30)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 << 30, 141 << 30))
        stats = ReplyMeter(engine, 1.0)._stats(10.0, 0.0, 0.0, 0.0, 0.0)
        assert (stats.vram_used, stats.vram_budget) == (3 << 30, 4 << 30)
        engine.config = dataclasses.replace(engine.config, vram_budget_bytes=None)  # none set: the device's memory
        assert ReplyMeter(engine, 1.0)._stats(10.0, 0.0, 0.0, 0.0, 0.0).vram_budget == 141 << 30
    finally:
        engine.close()


def test_a_long_conversation_is_trimmed_with_one_notice_and_the_stats_report_reuse(checkpoint):
    path = checkpoint("qwen3_moe")
    bridge, inbox = started(lambda: EngineConfig(str(path), context_len=256))
    try:
        inbox.wait(EngineReady)
        messages = [{"role": "system", "content": "Be brief."}]
        for i in range(12):
            messages += [{"role": "user", "content": f"Question {i} about the sea?"},
                         {"role": "assistant", "content": f"Answer {i}: the sea is wide."}]
        messages.append({"role": "user", "content": "And the lighthouse?"})
        bridge.generate(1, messages, SamplingParams(max_new_tokens=8))
        first = inbox.ending(1)
        notices = inbox.of(ReplyNotice, request_id=1)
        assert isinstance(first, ReplyFinished) and len(notices) == 1  # it fits, with a line that says so
        assert "oldest messages no longer fit the 256-token context" in notices[0].text
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Thanks."}]
        bridge.generate(2, messages, SamplingParams(max_new_tokens=8))
        second = inbox.ending(2)
        assert isinstance(second, ReplyFinished) and not inbox.of(ReplyNotice, request_id=2)  # the same cut: said once
        s = second.stats
        assert first.stats.prompt_tokens > 100 and 0 < s.reused_tokens < s.prompt_tokens  # the trimmed start reused
        assert s.reused_tokens >= first.stats.prompt_tokens - 1 and s.kept_conversations == 1
        assert 0 < s.kept_bytes <= s.kept_budget
    finally:
        bridge.close()


def test_esc_ends_a_remote_reply_whose_server_sends_nothing():
    """Esc while the server has not even answered: the reply ends at once (the stop reached the engine before its
    generate began and was lost, and no event came to look again: the app stayed busy up to the 600 s read timeout)."""
    from fake_openai import FakeServer

    from moechat.app.remote import RemoteConfig

    server = FakeServer()
    server.modes = ["stall_first", "ok"]
    bridge, inbox = started(lambda: RemoteConfig(server.url))
    try:
        inbox.wait(EngineReady)
        bridge.generate(1, CHAT, SamplingParams(max_new_tokens=8))
        bridge.stop()  # at once: while the engine thread starts the reply
        t0 = time.monotonic()
        end = inbox.ending(1)
        assert isinstance(end, ReplyFinished) and end.reason == "cancelled" and time.monotonic() - t0 < 2
        time.sleep(0.3)
        bridge.generate(2, CHAT, SamplingParams(max_new_tokens=8))
        time.sleep(0.5)  # the request is out and the server holds it
        t0 = time.monotonic()
        bridge.stop()
        end = inbox.ending(2)
        assert isinstance(end, ReplyFinished) and end.reason == "cancelled" and time.monotonic() - t0 < 1
        bridge.generate(3, CHAT, SamplingParams(max_new_tokens=8))
        assert inbox.ending(3).text == "AB" and not bridge.busy  # the next message works
    finally:
        bridge.close()
        server.close()


def test_a_remote_reply_updates_the_stats_panel_while_it_streams():
    """The panel's tokens/s for a remote reply came only at its end: RemoteMeter.stats_now was called on StepStats,
    which no server sends."""
    from fake_openai import FakeServer

    from moechat.app.remote import RemoteConfig

    server = FakeServer()
    server.modes = ["trickle"]
    bridge, inbox = started(lambda: RemoteConfig(server.url), interval=0.1)
    try:
        inbox.wait(EngineReady)
        bridge.generate(1, CHAT, SamplingParams(max_new_tokens=64))
        assert inbox.ending(1).text == "A" + "x" * 50 + "B"
        with inbox.cond:
            kinds = [type(m) for m in inbox.messages if getattr(m, "request_id", None) == 1]
        live = kinds[:kinds.index(ReplyFinished)][:-1]  # before the final stats
        assert live.count(ReplyStats) >= 3, kinds
        assert inbox.of(ReplyStats, request_id=1)[-2].stats.tokens_per_s > 0  # the last live one: tokens came
    finally:
        bridge.close()
        server.close()
