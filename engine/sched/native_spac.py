"""MoE-SpAc's scheduling in native code (csrc/sched/spac.cpp): the build, the ctypes binding, and
the policy and prefetcher that run on it. Their Python twins are SpacPolicy and Prefetcher
(engine/sched/spac.py, prefetch.py), which run where the library cannot be built (or with
MOECHAT_NATIVE=0); tests/sched/test_spac_twin.py holds both to the tensor reference.

Why native: a layer's scheduling is a few passes over its E experts and the K+1 thresholds, in
small steps. On the engine's thread between two layers' compute, each Python or PyTorch step runs
with cold caches (measured on the demo: a Python step ~1-3 µs, a small tensor op 3-30 µs), which
put the list-based twin at 150-200 µs per MoE layer per step; one native call does all of it.

What stays in Python: the slot table and its copies (a plan comes back as actions, evict a victim
and load an expert at a level, which `apply` makes through the table in order, as the twin's
drain would have), the freezes of experts in use (a dictionary write per layer and pass; a plan
made while layers are frozen gets them as a mask), and cancelling queued copies (the native CUDA
copier): a step that may cancel stops before its update (NEED_CANCEL), the table cancels, the step
resumes. The library is loaded with ctypes.PyDLL: a call holds the GIL (no thread switch in it).
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from .. import native
from ..experts.cache import SlotTable
from .balancer import SMOOTHING
from .prefetch import FROZEN, ZERO, Prefetcher
from .spac import RATE_SMOOTHING, SpacPolicy
from .utility import LEVEL_STEP

SOURCE = native.CSRC / "sched" / "spac.cpp"
NEED_CANCEL, BAD_LEVEL = -2, -3
PARAMS = ("lam", "level_up", "level_down", "variant_level", "draft_len", "cpu_s", "device_s", "io_s", "draft_s",
          "cpu_activations", "alpha", "demote_zero", "lookahead", "top_k", "rate_smoothing")  # the order of struct Params
READ = {"levels": 0, "fines": 1, "taus": 2, "queued": 3, "demoted": 4, "s": 5, "prev": 6, "up": 7, "down": 8,
        "cpu": 9, "dev": 10, "btau": 11, "seen": 12, "lookahead": 13, "queues": 14}


def build():
    # no fused multiply-adds: the same double roundings as the twin's arithmetic
    return native.build("sched", [SOURCE], ["-ffp-contract=off", "-Wall", "-Wextra"], headers=[SOURCE.parent / "prefetch.h"])


native.register("sched", build)
_pydlls: dict[str, ctypes.PyDLL] = {}


def library() -> ctypes.PyDLL | None:
    """The scheduler library, loaded to hold the GIL in its calls; None (native.notice("sched")) without it."""
    lib = native.load("sched")
    if lib is None:
        return None
    if lib._name not in _pydlls:
        _pydlls[lib._name] = _declare(ctypes.PyDLL(lib._name))
    return _pydlls[lib._name]


def _declare(lib: ctypes.PyDLL) -> ctypes.PyDLL:
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for name, res, args in (
        ("create", p, [i, i, i, p]), ("destroy", None, [p]), ("bind", None, [p, p]), ("actions", p, [p]),
        ("step", i, [p, i, p, i, i64, i, p, i, i]), ("draft", i, [p, i, p, i64, i, p, i, i]),
        ("resume", i, [p, p, i, i64, i, p, i]), ("held_tau", i, [p]),
        ("held_s", p, [p]), ("update", i, [p, i, p, i, p, i64, i, p]), ("plan", i, [p, i64, i, p, i]),
        ("demote", None, [p, i, p]), ("forget", None, [p, i, i]), ("forward_end", None, [p]), ("read", i, [p, i, p]),
    ):
        fn = getattr(lib, f"spac_{name}")
        fn.restype, fn.argtypes = res, args
    lib.spac_expected.restype, lib.spac_expected.argtypes = i64, [ctypes.c_double, i64, i64, i]
    return lib


class NativePrefetcher(Prefetcher):
    """Prefetcher whose queues and ranking live in a native core (shared with NativeSpacPolicy);
    freezes, the table and the transfer thread are the Python class's."""

    def __init__(self, core: NativeCore, table: SlotTable, num_layers: int, num_experts: int, utility_bound: int,
                 demote: str):
        self.core, self.table, self.K, self.demote = core, table, utility_bound, demote
        self.L, self.E = num_layers, num_experts
        self._frozen: dict[int, object] = {}  # as Prefetcher: layer -> experts in use
        self._late: dict[int, set[int]] = {}
        self._mask = np.zeros(num_layers * num_experts, dtype=np.uint8)  # experts in use, for a plan
        self.lock = table.lock
        self.wake = threading.Condition(self.lock)
        self._thread: threading.Thread | None = None
        self._stop = False

    # state for readers outside the hot path
    utility = property(lambda self: torch.from_numpy(self.core.read("levels")).view(self.L, self.E))
    tau = property(lambda self: torch.from_numpy(self.core.read("taus").astype(np.int64)))
    queued = property(lambda self: self.core.read("queued").reshape(self.L, self.E).tolist())
    demoted = property(lambda self: {divmod(k, self.E) for k in np.flatnonzero(self.core.read("demoted")).tolist()})

    @property
    def queues(self) -> list[list[tuple[int, int]]]:
        flat, out, i = self.core.read("queues").tolist(), [], 0
        while i < len(flat):
            n = flat[i]
            out.append([divmod(k, self.E) for k in flat[i + 1:i + 1 + n]])
            i += 1 + n
        return out

    @property
    def score(self) -> dict[tuple[int, int], tuple[int, float]]:
        with self.lock:
            levels, fines, taus = self.core.read("levels"), self.core.read("fines"), self.core.read("taus")
            demoted = self.core.read("demoted")
            out = {}
            for li in range(self.L):
                for e, slot in enumerate(self.table.slot_rows[li]):
                    if slot < 0:
                        continue
                    k = li * self.E + e
                    out[(li, e)] = FROZEN if self._is_frozen(li, e) else ZERO if demoted[k] else \
                        (int(levels[k] >= taus[li]), float(levels[k]) + float(fines[k]))
            return out

    def _check(self) -> None:  # the core resynchronises itself from the table's version
        pass

    def frozen_mask(self) -> int | None:
        """Address of a mask of the experts in use (None when no layer is frozen): the core skips
        them as victims and clears an expert's bit when it loads one (loaded after the freeze)."""
        if not self._frozen:
            return None
        m = self._mask
        m[:] = 0
        for li in self._frozen:
            late = self._late.get(li, ())
            for e in self._used(li):
                if e not in late:
                    m[li * self.E + e] = 1
        return m.ctypes.data

    def apply(self, n: int) -> int:
        """Make the core's plan of n actions through the table, in order; returns n."""
        if n < 0:
            raise ValueError("a utility above the bound K (or below 0) cannot be queued" if n == BAD_LEVEL else f"error {n}")
        if n:
            table, frozen = self.table, self._frozen
            acts = iter(self.core.actions[:5 * n].tolist())
            for li, e, level, vl, ve in zip(acts, acts, acts, acts, acts):
                if vl >= 0:
                    table.evict(vl, ve)
                table.load(li, e, level)
                if frozen and li in frozen:
                    self._late.setdefault(li, set()).add(e)
        return n

    def update_row(self, li: int, s: list[int], tau: int, fine: list[float] | None = None) -> None:
        with self.lock:
            table, core = self.table, self.core
            if table.pending:  # copies may still be queued: those of experts now below τ go
                fallen = [e for e, slot in enumerate(table.slot_rows[li]) if slot >= 0 and s[e] < tau]
                for e in table.cancel(li, tau, fallen):
                    core.lib.spac_forget(core.handle, li, e)
            s_arr = np.asarray(s, dtype=np.int64)
            f_arr = None if fine is None else np.asarray(fine, dtype=np.float64)
            rc = core.lib.spac_update(core.handle, li, s_arr.ctypes.data, tau, None if f_arr is None else f_arr.ctypes.data,
                                      table.version, len(table.free), self.frozen_mask())
            if rc < 0:
                self.apply(rc)
            if self._thread is not None:
                self.wake.notify()

    def drain(self, budget: int | None = None) -> int:
        with self.lock:
            return self.plan(-1 if budget is None else budget)

    def plan(self, budget: int) -> int:
        core, table = self.core, self.table
        return self.apply(core.lib.spac_plan(core.handle, table.version, len(table.free), self.frozen_mask(), budget))

    def _serve_one(self) -> bool:  # the transfer thread: one transfer per hold of the lock
        return self.plan(1) > 0

    def _demote(self, li: int, experts) -> None:
        if self.demote == "zero":
            counts = np.zeros(self.E, dtype=np.int64)
            counts[list(experts)] = 1
            self.core.lib.spac_demote(self.core.handle, li, counts.ctypes.data)
        if self._thread is not None:
            self.wake.notify()

    def below_elsewhere(self, li: int) -> int:
        raise NotImplementedError("the native core counts reclaimable residents itself")


class NativeCore:
    """One native scheduler object: its handle, its action buffer, and reads of its state."""

    def __init__(self, lib: ctypes.PyDLL, L: int, E: int, K: int, params: dict[str, float], table: SlotTable):
        self.lib, self.L, self.E, self.K = lib, L, E, K
        packed = np.array([float(params[k]) for k in PARAMS], dtype=np.float64)
        self.handle = lib.spac_create(L, E, K, packed.ctypes.data)
        self._table = table  # the core reads its slot_of (through the NumPy view's memory)
        lib.spac_bind(self.handle, table.slots.ctypes.data)
        n = 5 * (L * E + 1)  # the core's action buffer, read as a memoryview (cheaper than NumPy for a few ints)
        self.actions = memoryview((ctypes.c_int32 * n).from_address(lib.spac_actions(self.handle))).cast("B").cast("i")

    def read(self, what: str) -> np.ndarray:
        L, E, K = self.L, self.E, self.K
        dtype, size = {"levels": (np.int64, L * E), "fines": (np.float64, L * E), "taus": (np.int32, L),
                       "queued": (np.int32, L * E), "demoted": (np.uint8, L * E), "s": (np.int64, L * E),
                       "prev": (np.int64, L * E), "up": (np.int64, L * E), "down": (np.int64, L * E),
                       "cpu": (np.float64, L * (K + 1)), "dev": (np.float64, L * (K + 1)), "btau": (np.int32, L),
                       "seen": (np.int64, L), "lookahead": (np.int64, 2),
                       "queues": (np.int32, self.lib.spac_read(self.handle, 15, None))}[what]
        out = np.zeros(size, dtype=dtype)
        n = self.lib.spac_read(self.handle, READ[what], out.ctypes.data)
        return out[:n]

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self.lib.spac_destroy(self.handle)
            self.handle = None


class _Estimator:
    """The estimator's state as UtilityEstimator shows it ([L, E] tensors, read from the core)."""

    def __init__(self, core: NativeCore):
        self.core = core

    def _t(self, what: str) -> torch.Tensor:
        return torch.from_numpy(self.core.read(what)).view(self.core.L, self.core.E)

    s = property(lambda self: self._t("s"))
    theta_up = property(lambda self: self._t("up"))
    theta_down = property(lambda self: self._t("down"))


class _Balancer:
    """The balancer's state as WorkloadBalancer shows it."""

    def __init__(self, core: NativeCore):
        self.core = core

    cpu_units = property(lambda self: torch.from_numpy(self.core.read("cpu")).view(self.core.L, -1))
    dev_units = property(lambda self: torch.from_numpy(self.core.read("dev")).view(self.core.L, -1))
    tau = property(lambda self: torch.from_numpy(self.core.read("btau").astype(np.int64)))


class NativeSpacPolicy(SpacPolicy):
    """SpacPolicy with its per-layer work in one native call: the same decisions (see the module)."""

    def bind(self, cache: SlotTable, top_k: int = 1) -> None:
        self.cache, self.top_k = cache, top_k
        c, (L, E) = self.config, cache.slot_of.shape
        self.window = self.draft_len + 1
        params = dict(lam=c.forgetting, level_up=LEVEL_STEP, level_down=LEVEL_STEP, variant_level=c.utility_variant == "level",
                      draft_len=self.draft_len, cpu_s=self.costs.cpu_s, device_s=self.costs.device_s,
                      io_s=self.costs.io_s, draft_s=self.costs.draft_s, cpu_activations=c.cpu_cost == "activations",
                      alpha=SMOOTHING, demote_zero=c.demote == "zero", lookahead=c.lookahead, top_k=top_k,
                      rate_smoothing=RATE_SMOOTHING)
        self.core = NativeCore(library(), L, E, c.utility_bound, params, cache)
        self.prefetch = NativePrefetcher(self.core, cache, L, E, c.utility_bound, c.demote)
        self.estimator, self.balancer = _Estimator(self.core), _Balancer(self.core)
        self._held = None

    lookahead_loads = property(lambda self: int(self.core.read("lookahead")[0]))
    lookahead_hits = property(lambda self: int(self.core.read("lookahead")[1]))

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        if not self.acts_on_layers(phase):
            return
        pre, table, core = self.prefetch, self.cache, self.core
        lib, h = core.lib, core.handle
        if counts.dtype is not torch.long or not counts.is_contiguous():
            counts = counts.long().contiguous()
        ptr = counts.data_ptr()  # [E] int64 on the host (Policy.on_layer)
        with table.lock:
            cancellable = bool(table.pending) and table.cancels
            budget = -1 if pre._thread is None else 0  # with a transfer thread it serves the queues
            mask = pre.frozen_mask() if pre._frozen else None
            if phase == "draft":
                n = lib.spac_draft(h, li, ptr, table.version, len(table.free), mask, cancellable, budget)
            else:
                n = lib.spac_step(h, li, ptr, phase == "verify", table.version, len(table.free), mask, cancellable, budget)
            if n == NEED_CANCEL:
                n = self._cancel_and_resume(li, budget)
            pre.apply(n)
            if budget == 0:
                pre.wake.notify()

    def _cancel_and_resume(self, li: int, budget: int) -> int:
        """The native copier's queued copies of experts below the new τ go before the update (as
        Prefetcher.update_row does), then the core resumes the step."""
        core, table = self.core, self.cache
        tau = core.lib.spac_held_tau(core.handle)
        s = np.ctypeslib.as_array(ctypes.cast(core.lib.spac_held_s(core.handle), ctypes.POINTER(ctypes.c_int64)),
                                  shape=(core.E,))
        fallen = [e for e, slot in enumerate(table.slot_rows[li]) if slot >= 0 and s[e] < tau]
        gone = np.asarray(table.cancel(li, tau, fallen), dtype=np.int32)
        mask = self.prefetch.frozen_mask()
        return core.lib.spac_resume(core.handle, gone.ctypes.data, len(gone), table.version, len(table.free), mask, budget)

    def on_forward_end(self, phase: str) -> None:
        if phase != "draft":
            self.core.lib.spac_forward_end(self.core.handle)
