"""The engine thread: one long-lived daemon thread owns the `Engine`, takes commands from a queue
(load, generate, unload, quit) and posts the Message classes of `app/tui/messages.py` back with
`post` (the Textual App's thread-safe `post_message`). The UI thread never waits on the engine.

Every `generate` ends with exactly one of:
- ReplyFinished(request_id, text, reason, stats): reason "stop" (end of sequence or a stop string),
  "length" or "cancelled" (`stop()`, also for a reply stopped before it started: text "");
- EngineFailed(message, request_id): the request failed (no model loaded, a prompt too long for the
  context, an internal error); text already streamed stays as ReplyDelta posted it. No ReplyFinished.
A ReplyNotice may come first: the oldest turns of a long conversation left out of the request (app/history.py);
ReplyProgress(request_id, done, total) while a long prompt is read, between its prefill passes.
A load that fails posts EngineFailed(message) with request_id None; the thread stays
alive for the next `reload`. A factory that returns a `RemoteConfig` (app/remote.py) gets a
`RemoteEngine` instead: replies stream from an OpenAI-compatible server, with the same messages.

Commands run in the order given: a `reload` waits for the replies queued before it
(call `stop()` first to cut them short). `stop()` cancels the running reply and every reply queued
before the call (a sequence number, so a late stop never hits the next reply) and calls the running reply's
`Engine.stop()` at once, so the reply ends after the step in progress (the engine checks its flag between
steps and between a long prompt's prefill passes) with Finished
"cancelled" and its summary, which gives the final stats (closing the iterator, as Ctrl-C does in
`moechat chat`, would lose it); the engine stays ready. ReplyStats and ExpertFrame are capped in
time, see `app/bridge_meter.py`. `close()` is for app exit: it cancels, skips queued loads, and joins
for at most JOIN_S (a load in progress cannot be cut short; the daemon
thread never keeps the process alive); a first quantization stops at its next layer (its half-written cache removed)
and is waited for up to LAYER_JOIN_S: a daemon thread still in PyTorch's ops at exit aborts the process.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from textual.message import Message

from ..engine import EngineConfig, MoechatError, RequestError, SamplingParams, out_of_vram
from .chat_text import finish_of
from .models import draft_model_name, model_name
from .remote import RemoteConfig, RemoteEngine, RemoteMeter
from .tui.messages import (
    EngineFailed,
    EngineLoading,
    EngineReady,
    ExpertFrame,
    ReplyDelta,
    ReplyFinished,
    ReplyNotice,
    ReplyProgress,
    ReplyStats,
    Stats,
)

# close() waits this long: a reply stops within a step, but a load in progress cannot be
# cut short, and quitting must not hang on it (the thread is a daemon: it ends with the process)
JOIN_S = 2.0
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # the status line's short form
LAYER_JOIN_S = 30.0  # a first quantization's layer (seconds on a large model) ends before the process does


def one_line(text: str) -> str:
    return " ".join(str(text).split()) or "unknown error"


def _experts_words(m) -> tuple[str, str]:
    """Where the routed experts run, long and short: the fast tier's share where there is one; without one every expert runs
    on the CPU, and a CPU run's short form leaves the count out ("0/256 experts" read as none used)."""
    kind = "" if m.store.quant == "none" else f"{m.store.quant} "
    kind += f"({m.store.prequant.label}) " if m.store.prequant is not None else ""  # as the checkpoint came
    total, on_gpu = m.cache.slot_of.numel(), m.device.type == "cuda"
    if m.cache.capacity:
        share, tier = f"{m.cache.capacity}/{total} {kind}", "GPU" if on_gpu else "fast tier"
        return f"{share}experts on the {tier}", f"{share}on {tier}"
    short = f"{kind}experts on CPU" if on_gpu else f"{kind}experts" if kind else ""  # a CPU run's device says where
    return f"all {total} {kind}experts on the CPU", short


class EngineBridge:
    def __init__(self, post: Callable[[Message], object], config_factory: Callable[[], EngineConfig],
                 frame_interval_s: float = 0.1):
        if frame_interval_s < 0:
            raise ValueError(f"frame interval must be >= 0 seconds, got {frame_interval_s}")
        self._post, self._factory, self.frame_interval_s = post, config_factory, frame_interval_s
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._engine = None  # touched only on the engine thread
        self._load_error = ""  # why there is no engine, for replies asked of none
        self._notice = ""  # the last request's notice (engine thread)
        self._lock = threading.Lock()  # guards the counters below (UI thread and engine thread)
        self._next_seq = 0  # sequence number of the next generate
        self._cancel_below = 0  # generates numbered below this are cancelled
        self._pending = 0  # generates queued or running
        self._running: tuple[int, object] | None = None  # the reply in progress: (its sequence number, its engine)
        self._closed = False
        self._quantizing = False  # a load reports layers: close() waits for the one in progress

    # --- the UI thread's side -------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread, which loads the engine: EngineLoading..., then EngineReady or EngineFailed."""
        if self._thread is not None or self._closed:
            return
        self._thread = threading.Thread(target=self._run, name="moechat-engine", daemon=True)
        self._thread.start()
        self._queue.put(("load",))

    def generate(self, request_id: int, messages: list[dict], params: SamplingParams, thinking: bool | None = None) -> None:
        """thinking: the chat template's `enable_thinking` (None: its default)."""
        if self._closed:  # nothing would ever answer it
            return
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            self._pending += 1
        self._queue.put(("generate", seq, request_id, [dict(m) for m in messages], params, thinking))

    def stop(self) -> None:
        with self._lock:  # held while stopping: the engine thread cannot start the next reply in between
            self._cancel_below = self._next_seq
            if self._running is not None and self._running[1] is not None:
                self._running[1].stop()  # at once (thread-safe): the engine ends at its next check

    def reload(self) -> None:
        """Load the model again, from the config the factory gives now."""
        self._queue.put(("load",))

    def unload(self) -> threading.Event:
        """Stop any reply and free the model: the setup wizard measures this machine's free VRAM and RAM, which the
        loaded model would hold. -> an event set once it is freed. A reload brings it back."""
        freed = threading.Event()
        self.stop()
        self._queue.put(("unload", freed))
        return freed

    def close(self) -> None:
        """Stop any reply (its ReplyFinished "cancelled" is still posted), skip queued loads, end the thread and join
        it; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        self._queue.put(("quit",))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(LAYER_JOIN_S if self._quantizing else JOIN_S)

    @property
    def still_running(self) -> bool:
        """After close(): the engine thread is still at work (a load that cannot be cut short, inside PyTorch)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def busy(self) -> bool:
        """A reply is queued or running (until its ReplyFinished or EngineFailed is posted)."""
        return self._pending > 0

    # --- the engine thread ----------------------------------------------------------------------
    def _send(self, message: Message) -> None:
        try:
            self._post(message)
        except Exception:  # the app is gone (its loop closed): nobody is left to tell
            pass

    def _run(self) -> None:
        while True:
            cmd, *args = self._queue.get()
            if cmd == "quit":
                break
            if self._closed and cmd != "generate":  # closing: queued loads are moot
                if cmd == "unload":
                    args[0].set()  # nobody waits long on a closing bridge
                continue
            if cmd == "generate":
                request_id = args[1]
                with self._lock:
                    self._running = (args[0], self._engine)
                try:
                    end = self._reply(*args)
                except Exception as err:  # the bridge's own bug: still one line, still one ending
                    end = EngineFailed(one_line(f"internal error ({type(err).__name__}: {err})"), request_id)
                with self._lock:
                    self._pending -= 1  # before the post: whoever receives the reply's end sees busy False
                    self._running = None
                self._send(end)
                continue
            if cmd == "unload":
                self._drop_engine()
                self._load_error = "the model is unloaded while the setup wizard measures this machine"
                self._send(EngineLoading(0.0, "model unloaded for the setup wizard"))
                args[0].set()
                continue
            try:
                self._load()
            except MoechatError as err:  # already says what to do
                self._load_failed(one_line(err))
            except Exception as err:  # never a traceback in the UI; the thread waits for the next command
                self._load_failed(one_line(out_of_vram(err) or f"cannot load the model ({type(err).__name__}: {err})"))
        self._drop_engine(collect=False)  # closing: end its worker threads; the memory goes with the process

    def _drop_engine(self, collect: bool = True) -> None:
        """Free the model (its worker threads, VRAM and RAM) before another one loads."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        engine.close()
        del engine
        if not collect:
            return
        from ..engine import release_cached_memory

        release_cached_memory()

    def _load(self) -> None:
        self._drop_engine()
        self._load_error = "the model is loading"
        self._send(EngineLoading(0.0, "reading the settings"))
        try:
            config = self._factory()
            if isinstance(config, RemoteConfig):
                self._send(EngineLoading(0.1, f"connecting to {config.url}"))
                engine = RemoteEngine(config)
            else:
                name = model_name(config.model_dir)
                self._send(EngineLoading(0.1, f"loading {name}"))
                from ..engine import Cancelled, Engine, rising_fraction  # torch and transformers load here, not at UI start

                fraction = rising_fraction(0.1, 0.9)

                def progress(what: str, done: int, total: int) -> None:  # minutes on a large model, layer by layer
                    if self._closed:  # the app quit: unwind now, the half-written cache removed
                        raise Cancelled("the app closed while the model loaded")
                    self._quantizing = done < total
                    self._send(EngineLoading(fraction(done, total), f"{name}: {what}, layer {done} of {total}"))

                engine = Engine(config, progress)
        finally:
            self._quantizing = False
        self._engine, self._load_error = engine, ""
        self._send(EngineLoading(1.0, "ready"))
        if isinstance(engine, RemoteEngine):
            self._send(EngineReady(engine.model, engine.where, f"remote {engine.config.url}", remote=True))
            return
        placement = config.placement.notice if config.placement else ""
        notices = (placement, *config.notices, *engine.notices)
        self._send(EngineReady(name, *self._summary(engine), "; ".join(n for n in notices if n)))

    def _load_failed(self, why: str) -> None:
        """Said now, and again to each message sent before the next load: the notice may have gone by unread."""
        self._load_error = (f"it failed to load: {why}; fix it in the settings, whose Save loads it again, or pick another "
                            "model with Ctrl+P's Setup wizard")
        self._send(EngineFailed(why))

    @staticmethod
    def _summary(engine) -> tuple[str, str]:
        """(the status line's summary of what runs, its short form for a narrow terminal: no reasons); neither names the
        model, which the status line says first."""
        m, cfg = engine.model, engine.config
        drafter = short_drafter = engine.drafter.name
        if drafter == "model":
            drafter = short_drafter = draft_model_name(cfg.spec.drafter)
        elif drafter != "none":
            drafter, short_drafter = f"{drafter} (γ {cfg.spec.draft_len})", f"{drafter} γ{cfg.spec.draft_len}"
        where = str(cfg.placement) if cfg.placement else f"{m.device} in {cfg.dtype}"
        profiled = " · calibration profile" if cfg.scheduler.measured is not None else ""  # what it did not fix came from it
        experts, short_experts = _experts_words(m)
        summary = f"on {where} · {experts} · drafter {drafter} · policy {cfg.scheduler.policy}{profiled}"
        brief = " · ".join(p for p in (f"{m.device} {SHORT_DTYPES.get(cfg.dtype, cfg.dtype)}", short_experts,
                                       "no drafter" if drafter == "none" else "drafter " + short_drafter,
                                       f"policy {cfg.scheduler.policy}", "profile" if profiled else "") if p)
        return summary, brief

    def _reply(self, seq: int, request_id: int, messages: list[dict], params: SamplingParams,
               thinking: bool | None) -> Message:
        """Stream one reply; return the message that ends it (posted by the caller)."""
        if seq < self._cancel_below:
            return ReplyFinished(request_id, "", "cancelled", Stats())
        engine = self._engine
        if engine is None:
            return EngineFailed(f"no model is loaded ({self._load_error or 'the engine has not started'})", request_id)
        from ..engine import Error, Finished, PrefillProgress, Request, StepStats, TokenDelta
        from .history import fit_for_engine

        if isinstance(engine, RemoteEngine):  # the server fits the context; its figures, no expert frames
            meter = RemoteMeter(engine, self.frame_interval_s)
        else:
            from .bridge_meter import ReplyMeter  # torch: not for a remote backend's replies

            try:
                messages, notice = fit_for_engine(engine, messages, params.max_new_tokens)
            except MoechatError as err:
                return EngineFailed(one_line(err), request_id, isinstance(err, RequestError))
            if notice and notice != self._notice:  # said once per cut
                self._send(ReplyNotice(request_id, notice))
            self._notice = notice
            meter = ReplyMeter(engine, self.frame_interval_s)
        events = engine.generate(Request(messages=messages, thinking=thinking), params)
        if seq < self._cancel_below:  # a stop() while generate began went to the reply before; one that sends nothing
            engine.stop()  # (a stalled server) brings no event to look again at
        try:
            for ev in events:
                if seq < self._cancel_below:
                    engine.stop()  # again: a stop() before generate began was cleared by it; ends with Finished("cancelled")
                if isinstance(ev, TokenDelta):
                    meter.tokens(len(ev.token_ids))
                    if ev.text:
                        self._send(ReplyDelta(request_id, ev.text))
                    if isinstance(meter, RemoteMeter) and (stats := meter.stats_now()) is not None:  # a server sends no StepStats
                        self._send(ReplyStats(request_id, stats))
                elif isinstance(ev, PrefillProgress):
                    self._send(ReplyProgress(request_id, ev.done, ev.total))
                elif isinstance(ev, StepStats):
                    meter.step(ev)
                    if (stats := meter.stats_now()) is not None:
                        self._send(ReplyStats(request_id, stats))
                    if (frame := meter.frame_now()) is not None:
                        self._send(ExpertFrame(frame))
                elif isinstance(ev, Finished):
                    stats = meter.final_stats(ev.summary)
                    self._send(ReplyStats(request_id, stats))
                    if (frame := meter.final_frame()) is not None:
                        self._send(ExpertFrame(frame))
                    return ReplyFinished(request_id, ev.text, finish_of(ev.summary.finish_reason), stats)
                elif isinstance(ev, Error):
                    return EngineFailed(one_line(ev.message), request_id, ev.request_fault)
        finally:
            events.close()
        return EngineFailed("the engine ended the reply without a result: send the message again", request_id)
