"""The server's engine thread: one long-lived thread owns the `Engine` and serves jobs one at a time in
arrival order from a bounded FIFO; events go back to the asyncio side with `loop.call_soon_threadsafe`.

A job's event queue receives the engine's TokenDelta events, then one Finished or one Error, then None (the
end). A job cancelled while it waits is skipped; one cancelled while it runs is cut at the engine's next event
(closing `Engine.generate` at a yield leaves a consistent KV cache), so the engine serves the next job.
"""
from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from dataclasses import dataclass, field

from ...engine import MoechatError


class QueueFull(MoechatError):
    """Every waiting place is taken: the route answers 429, with `retry_after` (whole seconds) as its Retry-After."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(MoechatError):
    """The server is stopping: the route answers 503."""


STOPPING = "the server is shutting down: send the request again once it is back"
RETRY_AFTER_MAX_S = 60  # a place may free sooner (a reply ends early, a client leaves); the openai SDK gives up past 120

@dataclass
class Job:
    request: object  # engine Request
    params: object  # engine SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrival: int  # 1, 2, ... in the order requests reached the server
    t_submit: float = field(default_factory=time.perf_counter)
    served: int = 0  # 1, 2, ... in the order the engine started them (equal order: FIFO)
    queued_s: float = 0.0
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """The client is gone (thread-safe; a finished job ignores it)."""
        self.cancelled.set()

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop closed (server shutting down): nobody is listening
            pass


class EngineWorker:
    def __init__(self, engine, queue_size: int = 16):
        if queue_size < 1:
            raise MoechatError(f"--queue-size must be at least 1, got {queue_size}")
        self.engine, self.queue_size = engine, queue_size
        self._jobs: queue.Queue = queue.Queue()  # at most queue_size waiting: a job whose client left is pruned
        self._lock = threading.Lock()
        self.arrived = self.served = self.cancelled = 0
        self.running = False
        self._spent_s, self._ended, self._since = 0.0, 0, 0.0  # the engine's time on the jobs it ended; the running one's start
        self._current: Job | None = None  # the job in progress: close() cancels it
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="moechat-serve-engine", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Jobs waiting whose client is still there."""
        return self._prune()

    def _prune(self) -> int:
        """Jobs whose client left leave the FIFO (their routes have answered), so they hold neither a place nor their
        request's memory -> the jobs left waiting."""
        with self._jobs.mutex:
            waiting = self._jobs.queue
            gone = [job for job in waiting if job is not None and job.cancelled.is_set()]
            for job in gone:
                waiting.remove(job)
                job.post(None)
            self.cancelled += len(gone)
            return sum(job is not None for job in waiting)

    def submit(self, request, params, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a request; QueueFull when every waiting place is taken."""
        with self._lock:
            if self._closing:
                raise ShuttingDown(STOPPING)
            if self._prune() >= self.queue_size:
                wait = self._retry_after()
                raise QueueFull(f"the server is busy ({self.queue_size} requests already waiting): retry in {wait} s", wait)
            job = Job(request, params, loop, asyncio.Queue(), self.arrived + 1)
            self._jobs.put_nowait(job)
            self.arrived += 1
        return job

    def _retry_after(self) -> int:
        """Whole seconds until a waiting place is likely free: one frees as the running request ends, estimated by the
        engine's mean time per request (the running one's time so far counted), 1 to RETRY_AFTER_MAX_S."""
        spent, count = self._spent_s, self._ended
        if self.running:
            spent, count = spent + time.perf_counter() - self._since, count + 1
        return min(RETRY_AFTER_MAX_S, max(1, math.ceil(spent / count))) if count else 1

    @property
    def closing(self) -> bool:
        return self._closing

    def stop_jobs(self) -> None:
        """The server is going away: refuse new jobs and cancel the one in progress (it stops at its next token); the
        thread cancels each waiting one as it takes it (no engine work), so every request in flight ends before the HTTP
        server's graceful wait does."""
        with self._lock:  # either this sees the job taken, or the thread sees closing before it starts it
            self._closing, job = True, self._current
        if job is not None:
            job.cancel()

    def close(self) -> None:
        """stop_jobs, stop the thread, then the engine's own threads: only once this thread is out of the engine, which
        closing frees."""
        self.stop_jobs()
        self._jobs.put(None)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():  # else it is still inside a step: the process's exit ends it
            self.engine.close()

    def _run(self) -> None:
        from ...engine import Error, PrefillProgress, StepStats

        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._current = job
                if self._closing:
                    job.cancel()
            if job.cancelled.is_set():
                self.cancelled += 1
                job.post(None)
                continue
            self.served += 1
            with self._lock:  # submit's Retry-After reads the three together
                self._since = time.perf_counter()
                job.served, job.queued_s, self.running = self.served, self._since - job.t_submit, True
            events = self.engine.generate(job.request, job.params)
            try:
                for ev in events:
                    if job.cancelled.is_set():  # at a yield: the engine keeps what is consistent
                        self.cancelled += 1
                        break
                    if not isinstance(ev, (StepStats, PrefillProgress)):  # per-step figures stay on the server
                        job.post(ev)
            except Exception as err:  # the engine turns its own failures into Error; this is a last resort
                job.post(Error(f"internal error ({type(err).__name__}: {err}); the server is ready for the next request"))
            finally:
                events.close()
                with self._lock:
                    self._spent_s, self._ended = self._spent_s + time.perf_counter() - self._since, self._ended + 1
                    self.running, self._current = False, None
                job.post(None)
