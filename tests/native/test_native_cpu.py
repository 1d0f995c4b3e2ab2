"""The native CPU expert FFN (csrc/cpu) against its pure-PyTorch twin, on every path this CPU has."""
from __future__ import annotations

import ctypes
import os
import shutil
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moechat.engine import native
from moechat.engine.errors import MoechatError
from moechat.engine.experts import cpu_ffn

pytestmark = pytest.mark.native
needs_native = pytest.mark.skipif(not cpu_ffn.available(), reason=f"native CPU kernels not built: {native.notice('cpu')}")
ISAS = [isa for isa in ("scalar", "avx2", "avx512", "avx512_bf16", "amx_bf16") if cpu_ffn.isa_supported(isa)]
# paths that round activations and the hidden product to bf16 before their dot products (as torch bf16 does)
ROUNDS_TO_BF16 = {"avx512_bf16", "amx_bf16"}


def case(H, I, sizes, w_dtype, x_dtype, E=6, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(w_dtype)  # [E, 2I, H]
    down = (torch.randn(E, H, I, generator=g) * 0.1).to(w_dtype)  # [E, H, I]
    x = torch.randn(N, H, generator=g).to(x_dtype)  # [N, H]
    experts = torch.randperm(E, generator=g)[:len(sizes)]
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int64)
    S = int(offsets[-1])
    rows = torch.randint(0, N, (S,), generator=g)
    weights = torch.rand(S, generator=g)
    return x, gate_up, down, experts, offsets, rows, weights


def reference(x, gate_up, down, experts, offsets, rows, weights):
    """The twin in float32 on the same (rounded) weights and activations."""
    out = torch.zeros(x.shape[0], x.shape[1])
    return cpu_ffn.moe_ffn_torch(x.float(), gate_up.float(), down.float(), experts, offsets, rows, weights, out)


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


SHAPES = [  # H, I, tokens per group: odd shapes (vector tails), 32-multiples (AMX), empty groups, one token
    (67, 45, [9, 0, 3, 1]),
    (128, 96, [1, 2, 4, 8, 9, 16]),
    (33, 17, [1]),
    (256, 64, [0, 5, 0]),
]
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
          (torch.float16, torch.float16), (torch.float16, torch.float32), (torch.float32, torch.bfloat16)]


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("w_dtype,x_dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_native_equals_reference(isa, w_dtype, x_dtype):
    path = cpu_ffn.resolved_isa(isa, w_dtype, x_dtype)
    tol = 1e-2 if path in ROUNDS_TO_BF16 else 2e-5
    for H, I, sizes in SHAPES:
        args = case(H, I, sizes, w_dtype, x_dtype)
        ref = reference(*args)
        got = cpu_ffn.moe_ffn_native(*args, out=torch.full_like(ref, 0.5), isa=isa) - 0.5  # accumulates into out
        assert rel_err(got, ref) < tol, (isa, path, H, I, sizes)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("w_dtype,x_dtype", DTYPES[:3], ids=lambda d: str(d).replace("torch.", ""))
def test_experts_by_address_equal_the_stacked_layer(isa, w_dtype, x_dtype):
    """moe_ffn_native_ptrs (the disk tier: each expert's gate, up and down wherever the mapped file holds them) gives
    the stacked layer's bits, with the matrices copied apart in another order."""
    for H, I, sizes in SHAPES:
        x, gate_up, down, experts, offsets, rows, weights = case(H, I, sizes, w_dtype, x_dtype)
        want = cpu_ffn.moe_ffn_native(x, gate_up, down, experts, offsets, rows, weights, torch.zeros(5, H), isa=isa)
        apart = [(gate_up[e, I:].clone(), down[e].clone(), gate_up[e, :I].clone()) for e in experts.tolist()]
        ptrs = torch.tensor([[g.data_ptr(), u.data_ptr(), d.data_ptr()] for u, d, g in apart])
        got = cpu_ffn.moe_ffn_native_ptrs(x, ptrs, w_dtype, I, offsets, rows, weights, torch.zeros(5, H), isa=isa)
        assert torch.equal(got, want), (isa, H, I, sizes)


@needs_native
def test_bf16_paths_match_torch_bf16_rounding():
    """Where activations are rounded to bf16, the result is as close to torch's own bf16 twin as
    torch bf16 is to float32: no path adds error beyond the format's."""
    args = case(128, 96, [1, 3, 9], torch.bfloat16, torch.bfloat16)
    ref = reference(*args)
    torch_bf16 = cpu_ffn.moe_ffn_torch(*args, out=torch.zeros_like(ref))
    for isa in ISAS:
        got = cpu_ffn.moe_ffn_native(*args, out=torch.zeros_like(ref), isa=isa)
        assert rel_err(got, ref) <= 2 * rel_err(torch_bf16, ref) + 1e-6, isa


@needs_native
def test_fp16_subnormal_and_extreme_weights_are_widened_exactly():
    """fp16 weights of every kind (subnormals, both zeros, the largest finite values), widened branch-free by the portable
    path (csrc/cpu/common.h f16_bits): equal to the float32 reference, whose widening is torch's exact one. The weights
    are mostly subnormal, so a subnormal flushed or misread would dominate the result."""
    g = torch.Generator().manual_seed(5)
    E, H, I = 3, 67, 45
    bits = torch.randint(1, 0x400, (E * 3 * I * H,), generator=g) | (torch.randint(0, 2, (E * 3 * I * H,), generator=g) << 15)
    bits[::97], bits[1::97], bits[2::389] = 0, 0x8000, 0x7BFF  # +0, -0 and 65504 among them
    w = (bits.to(torch.int16)).view(torch.float16).view(E, 3 * I, H)
    gate_up, down = w[:, :2 * I].contiguous(), w[:, 2 * I:].reshape(E, H, I).contiguous()
    x = torch.randn(4, H, generator=g)
    args = (x, gate_up, down, torch.tensor([2, 0]), torch.tensor([0, 3, 4]), torch.tensor([0, 1, 2, 3]),
            torch.rand(4, generator=g))
    ref = reference(*args)
    assert bool(ref.isfinite().all()) and float(ref.abs().max()) > 0
    for isa in ISAS:
        assert rel_err(cpu_ffn.moe_ffn_native(*args, out=torch.zeros(4, H), isa=isa), ref) < 2e-5, isa


@needs_native
@pytest.mark.parametrize("isa", [i for i in ISAS if i not in ROUNDS_TO_BF16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d).replace("torch.", ""))
def test_a_tokens_result_does_not_depend_on_its_batch(isa, w_dtype):
    """Speculative verification needs it: a token's bits are the same alone and among 1-9 others of its expert."""
    x, gate_up, down, *_ = case(67, 45, [9], w_dtype, torch.float32, N=9)
    one = torch.ones(9)
    batch = cpu_ffn.moe_ffn_native(x, gate_up, down, torch.tensor([1]), torch.tensor([0, 9]), torch.arange(9), one,
                                   torch.zeros(9, 67), isa=isa)
    for t in range(9):
        alone = cpu_ffn.moe_ffn_native(x[t:t + 1].contiguous(), gate_up, down, torch.tensor([1]), torch.tensor([0, 1]),
                                       torch.tensor([0]), one[:1], torch.zeros(1, 67), isa=isa)
        assert torch.equal(alone[0], batch[t]), t


@needs_native
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,I", [(256, 128), (1024, 512)])
def test_threads_do_not_change_the_result(w_dtype, H, I):
    """Each output element sums its experts in one order whatever the thread count: bitwise equal (at 1024 x 512 the
    threads take runs of several blocks (pool.h's Items), of one expert's rows in phase 1, of every expert's in phase 2)."""
    args = case(H, I, [3, 1, 0, 7, 2], w_dtype, torch.float32, E=8)
    one = cpu_ffn.moe_ffn_native(*args, out=torch.zeros(5, H), threads=1)
    for threads in (2, 3):
        assert torch.equal(one, cpu_ffn.moe_ffn_native(*args, out=torch.zeros(5, H), threads=threads)), threads


@needs_native
def test_no_groups_and_no_activations_leave_out_untouched():
    x, gate_up, down, *_ = case(64, 32, [1], torch.float32, torch.float32)
    out = torch.ones(5, 64)
    empty = torch.zeros(0, dtype=torch.int64)
    cpu_ffn.moe_ffn_native(x, gate_up, down, empty, torch.zeros(1, dtype=torch.int64), empty, torch.zeros(0), out)
    two_empty = torch.tensor([0, 0, 0])
    cpu_ffn.moe_ffn_native(x, gate_up, down, torch.tensor([1, 2]), two_empty, empty, torch.zeros(0), out)
    assert torch.equal(out, torch.ones(5, 64))


@needs_native
def test_the_call_releases_the_gil(monkeypatch):
    """Another Python thread runs while a native call computes (so the device path runs meanwhile).

    The switch interval is set longer than the test, so the interpreter never takes the GIL from
    the calling thread: the other thread can tick between the two reads around the library call
    only if the call itself released the GIL."""
    args = case(1024, 512, [9] * 16, torch.float32, torch.float32, E=16)
    lib = cpu_ffn.library()
    go, stop, ticks, during = threading.Event(), threading.Event(), [0], []

    def ticker():  # one tick per `go`, each taking the GIL
        while go.wait() and not stop.is_set():
            go.clear()
            ticks[0] += 1

    def moe_expert_ffn(*call_args):
        go.set()
        before = ticks[0]
        code = lib.moe_expert_ffn(*call_args)
        during.append(ticks[0] - before)
        return code

    monkeypatch.setattr(cpu_ffn, "library", lambda: SimpleNamespace(moe_expert_ffn=moe_expert_ffn))
    thread = threading.Thread(target=ticker, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    thread.start()
    try:
        while len(during) < 20 and not any(during):  # the ticker must be scheduled during one call at least
            cpu_ffn.moe_ffn_native(*args, out=torch.zeros(5, 1024), threads=1)
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        go.set()
        thread.join()
    assert any(during), f"no other thread ran during {len(during)} native calls: the call holds the GIL"


@needs_native
def test_dispatcher_takes_native_for_decode_and_torch_for_prefill(monkeypatch):
    calls = []
    real = cpu_ffn.moe_ffn_native
    monkeypatch.setattr(cpu_ffn, "moe_ffn_native", lambda *a, **k: calls.append(1) or real(*a, **k))
    small = case(64, 32, [2, 3], torch.float32, torch.float32)
    cpu_ffn.moe_ffn(*small, out=torch.zeros(5, 64))
    assert calls == [1]
    big = case(64, 32, [cpu_ffn.NATIVE_MAX_TOKENS + 1], torch.float32, torch.float32)
    got = cpu_ffn.moe_ffn(*big, out=torch.zeros(5, 64))
    assert calls == [1] and rel_err(got, reference(*big)) < 1e-5


def test_missing_compiler_gives_a_notice_and_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(tmp_path / "cache"))  # nothing cached there
    native.reset()
    try:
        assert cpu_ffn.library() is None
        msg = native.notice("cpu")
        assert "\n" not in msg and "pure-PyTorch" in msg and "could not run" in msg
        args = case(64, 32, [2, 1], torch.float32, torch.float32)
        assert rel_err(cpu_ffn.moe_ffn(*args, out=torch.zeros(5, 64)), reference(*args)) < 1e-6
    finally:
        native.reset()


def test_no_compiler_on_windows_names_one_to_install(monkeypatch, tmp_path):
    """On Windows the line said `install g++ or clang++`: no package manager there has a package by either name."""
    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "compiler", lambda: None)
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(native.NativeBuildError, match=r"^no C\+\+ compiler found \(install MinGW-w64's g\+\+: winget install "
                       r"BrechtSanders\.WinLibs\.POSIX\.UCRT, then open a new terminal, or set CXX\)$"):
        native.build("none", [tmp_path / "s.cpp"])


def test_native_off_by_environment(monkeypatch):
    monkeypatch.setenv("MOECHAT_NATIVE", "0")
    native.reset()
    try:
        assert cpu_ffn.library() is None and "MOECHAT_NATIVE=0" in native.notice("cpu")
    finally:
        native.reset()


@needs_native
@pytest.mark.parametrize("forced", ["foo", *[i for i in native.CPU_ISA if not cpu_ffn.isa_supported(i)]])
def test_a_forced_path_this_cpu_cannot_run_is_one_line(forced, monkeypatch):
    monkeypatch.setenv("MOECHAT_CPU_ISA", forced)
    with pytest.raises(MoechatError, match=f"MOECHAT_CPU_ISA={forced} is not a path this CPU runs: unset it"):
        cpu_ffn.default_isa()


@needs_native
@pytest.mark.parametrize("forced", [i for i in ("avx_vnni", "avx512_vnni", "amx_int8") if cpu_ffn.isa_supported(i)] or
                         [pytest.param("avx512_vnni", marks=pytest.mark.skip(reason="no quantized-only path on this CPU"))])
def test_a_forced_quantized_path_leaves_the_float_kernel_its_best(forced, monkeypatch):
    monkeypatch.setenv("MOECHAT_CPU_ISA", forced)
    best = cpu_ffn.resolved_isa("auto", torch.bfloat16, torch.float32)
    assert cpu_ffn.resolved_isa(cpu_ffn._float_isa(None), torch.bfloat16, torch.float32) == best
    args = case(128, 96, [1, 2, 4], torch.bfloat16, torch.float32)
    out = cpu_ffn.moe_ffn_native(*args, out=torch.zeros(5, 128))
    assert rel_err(out, reference(*args)) < 2e-5

@needs_native
@pytest.mark.parametrize("forced, decode", [("scalar", "portable"), ("avx2", "avx2"), ("", None)])
def test_a_forced_narrow_path_takes_the_decode_ops_with_it(forced, decode):
    """MOECHAT_CPU_ISA=scalar emulated an ARM CPU's expert kernels but left attention, norms and the dense products on
    AVX-512: now the decode ops take no wider a path (a fresh process: the library reads it once)."""
    import subprocess

    from moechat.engine.model import decode_ops

    if forced and not cpu_ffn.isa_supported(forced):
        pytest.skip(f"this CPU has no {forced}")
    if not forced and os.environ.get("MOECHAT_CPU_ISA"):
        pytest.skip("this run forces MOECHAT_CPU_ISA, so this process has no unforced path to compare with")
    env = {k: v for k, v in os.environ.items() if k != "MOECHAT_CPU_ISA"} | ({"MOECHAT_CPU_ISA": forced} if forced else {})
    code = "from moechat.engine.model import decode_ops; print(decode_ops.isa())"
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    widest = decode_ops.isa()  # this process: never forced
    assert got.stdout.strip() == (decode or widest)


@needs_native
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_engine_runs_cpu_experts_natively_and_stays_lossless(family, checkpoint, tokenizer, monkeypatch):
    """The CPU tier goes through the native kernel (hybrid, with a self drafter) and greedy output
    still equals transformers'."""
    from helpers import PROMPT, hf_greedy, run_engine

    calls = []
    real = cpu_ffn.moe_ffn_native
    monkeypatch.setattr(cpu_ffn, "moe_ffn_native", lambda *a, **k: calls.append(1) or real(*a, **k))
    model_dir = checkpoint(family, 2)
    prompt = tokenizer(PROMPT)["input_ids"]
    fin = run_engine(model_dir, prompt, expert_cache_ratio=0.25, policy="spac", drafter="self", draft_len=3)
    assert fin.token_ids == hf_greedy(model_dir, prompt)
    assert calls and fin.summary.misses > 0, "the CPU tier never reached the native kernel"


def test_generate_without_a_compiler_says_so_once_and_answers(checkpoint, monkeypatch, tmp_path, capsys):
    from moechat.app.cli import main

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(tmp_path / "cache"))
    native.reset()
    try:
        code = main(["generate", "--model", str(checkpoint("qwen3_moe")), "--prompt-ids", "5,6,7", "--max-new-tokens", "4",
                     "--raw", "--json"])
    finally:
        native.reset()
    out, err = capsys.readouterr()
    assert code == 0 and len(__import__("json").loads(out)["token_ids"]) == 4
    notes = [line for line in err.splitlines() if line.startswith("note: native cpu kernels unavailable")]
    assert len(notes) == 1 and "pure-PyTorch" in notes[0]


@needs_native
def test_a_damaged_cached_build_is_rebuilt(monkeypatch, tmp_path):
    """A cached library that does not load (a write cut short, a disk error) is built again, once, and loaded; a small
    library of its own, as load() treats every library alike (the CPU library's build takes 20 s)."""
    source = tmp_path / "probe.cpp"
    source.write_text('#ifdef _WIN32\n#define API __declspec(dllexport)\n#else\n'
                      '#define API __attribute__((visibility("default")))\n#endif\nextern "C" API int moe_probe() {return 7;}\n')
    monkeypatch.setitem(native._builders, "probe", lambda: native.build("probe", [source]))
    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(tmp_path))
    native.reset()
    try:
        path = native._builders["probe"]()  # built, not loaded (overwriting a loaded library would crash this process)
        path.write_bytes(b"not a shared library")
        lib = native.load("probe")
        assert lib is not None and lib.moe_probe() == 7 and native.notice("probe") == ""
        assert path.read_bytes()[:4] == b"\x7fELF" or sys.platform != "linux"
    finally:
        native.reset()


@needs_native
@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64",
                    reason="reads the x86 CPU's flags from Linux's /proc/cpuinfo")
def test_the_paths_the_library_offers_are_the_cpus_flags():
    """The library asks the CPU once per process and answers every call from that (CPUID is a VM exit under a
    hypervisor, several microseconds each): its answers are /proc/cpuinfo's flags, path by path, and stay so."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    flags = set(next(line for line in cpuinfo if line.startswith("flags")).split(":", 1)[1].split())
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl"} <= flags
    expected = {"scalar": True, "avx2": avx2, "avx512": avx512, "avx512_bf16": avx512 and "avx512_bf16" in flags,
                "avx512_vnni": avx512 and "avx512_vnni" in flags, "avx_vnni": avx2 and "avx_vnni" in flags}
    for _ in range(2):  # asked again: the same answers
        assert {isa: cpu_ffn.isa_supported(isa) for isa in expected} == expected
        assert {isa: cpu_ffn.q_isa_supported(isa) for isa in ("scalar", "avx2", "avx_vnni", "avx512_vnni")} == \
            {isa: expected[isa] for isa in ("scalar", "avx2", "avx_vnni", "avx512_vnni")}
    if "amx_tile" not in flags:  # AMX also needs Linux's permission, which only the library asks for
        assert not cpu_ffn.isa_supported("amx_bf16") and not cpu_ffn.q_isa_supported("amx_int8")


@needs_native
def test_portable_build_without_x86_paths(tmp_path, monkeypatch):
    """The library as it builds on a non-x86 CPU (ARM: Apple silicon, Linux ARM): only the portable
    path, and it equals the reference."""
    import ctypes

    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(tmp_path))
    path = native.build("cpu_portable", [cpu_ffn.SOURCE], ["-DMOE_PORTABLE_ONLY"],
                        headers=sorted(cpu_ffn.SOURCE.parent.glob("*.h")))
    lib = ctypes.CDLL(str(path))
    lib.moe_expert_ffn.argtypes = cpu_ffn._ARGTYPES
    assert [lib.moe_cpu_isa_supported(cpu_ffn.ISA[i]) for i in ("scalar", "avx2", "avx512", "amx_bf16")] == [1, 0, 0, 0]
    x, gate_up, down, experts, offsets, rows, weights = case(67, 45, [9, 0, 3, 1], torch.bfloat16, torch.bfloat16)
    out = torch.zeros(5, 67)
    code = lib.moe_expert_ffn(len(experts), experts.data_ptr(), offsets.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
                              1, 67, 45, x.data_ptr(), 1, rows.data_ptr(), weights.data_ptr(), out.data_ptr(), 2, 0)
    assert code == 0 and rel_err(out, reference(x, gate_up, down, experts, offsets, rows, weights)) < 2e-5


@pytest.mark.native
@pytest.mark.skipif(shutil.which("clang++") is None, reason="no clang++ on PATH")
def test_the_library_builds_with_clang_and_finds_the_same_paths(tmp_path, monkeypatch):
    """clang (CXX=clang++, macOS's only compiler) builds the whole CPU library: clang 14's __builtin_cpu_supports knows
    neither f16c nor avxvnni, which failed the build there, so those two are read from CPUID; it finds the paths gcc's
    build finds, and its kernel equals the reference."""
    import ctypes

    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "clang++")
    sources = [cpu_ffn.SOURCE, cpu_ffn.Q_SOURCE, cpu_ffn.DECODE_SOURCE, cpu_ffn.STACK_SOURCE, cpu_ffn.BUS_SOURCE]
    lib = ctypes.CDLL(str(native.build("cpu_clang", sources, headers=sorted(cpu_ffn.SOURCE.parent.glob("*.h")))))
    lib.moe_expert_ffn.argtypes = cpu_ffn._ARGTYPES
    code = cpu_ffn.ISA
    isas = [i for i in code if i != "auto"]
    if cpu_ffn.available():  # the paths gcc's build finds on this CPU
        gcc = cpu_ffn.library()
        assert [lib.moe_cpu_isa_supported(code[i]) for i in isas] == [gcc.moe_cpu_isa_supported(code[i]) for i in isas]
    x, gate_up, down, experts, offsets, rows, weights = case(67, 45, [9, 0, 3, 1], torch.bfloat16, torch.float32)
    want = reference(x, gate_up, down, experts, offsets, rows, weights)
    for isa in [i for i in isas if i not in ROUNDS_TO_BF16 and lib.moe_cpu_isa_supported(code[i])]:
        out = torch.zeros(5, 67)
        rc = lib.moe_expert_ffn(len(experts), experts.data_ptr(), offsets.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
                                1, 67, 45, x.data_ptr(), 0, rows.data_ptr(), weights.data_ptr(), out.data_ptr(), 2, code[isa])
        assert rc == 0 and rel_err(out, want) < 2e-5, isa


def test_a_failing_source_among_several_gives_one_line_and_a_log(monkeypatch, tmp_path):
    """Sources compile side by side, then link: one that does not compile fails the build in one line, its log kept."""
    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(tmp_path / "cache"))
    good, bad = tmp_path / "good.cpp", tmp_path / "bad.cpp"
    good.write_text('extern "C" __attribute__((visibility("default"))) int answer() { return 42; }\n')
    bad.write_text("int broken( { return; }\n")
    with pytest.raises(native.NativeBuildError) as err:
        native.build("two", [good, bad])
    msg = str(err.value)
    assert "\n" not in msg and "the build failed" in msg and "error" in msg
    log = tmp_path / "cache" / "libmoechat_two.log"
    assert "bad.cpp" in log.read_text()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no temporary files left
    other = tmp_path / "other.cpp"
    other.write_text('extern "C" __attribute__((visibility("default"))) int twice(int x) { return 2 * x; }\n')
    import ctypes

    lib = ctypes.CDLL(str(native.build("two_ok", [good, other])))
    assert lib.answer() == 42 and lib.twice(21) == 42


def test_a_library_another_process_built_and_holds_open_is_used(monkeypatch, tmp_path):
    """Windows refuses to replace a DLL a process has loaded: two first starts building at once, the second's rename over
    the first's (loaded) library failed, and it ran on the PyTorch paths. The same library is there: it is used."""
    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "one.cpp"
    source.write_text('extern "C" __attribute__((visibility("default"))) int answer() { return 42; }\n')
    replace = os.replace

    def loaded_elsewhere(src, dst):
        replace(src, dst)  # the other process's build landed first, and it has the file open
        raise PermissionError(13, "Access is denied", str(dst))

    monkeypatch.setattr(native.os, "replace", loaded_elsewhere)
    path = native.build("held", [source])
    monkeypatch.setattr(native.os, "replace", replace)
    assert ctypes.CDLL(str(path)).answer() == 42
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no temporary files left


def test_flags_from_the_environment_come_after_moechats_and_build_a_library_of_their_own(monkeypatch, tmp_path):
    """MOECHAT_NATIVE_CFLAGS (the sanitizer builds: tools/native_sanitizers.py) reaches the compiler after moechat's own
    flags (its -O0 wins over -O3) and the cache's key (a library beside the plain one, not the plain one reused)."""
    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "one.cpp"
    source.write_text("#ifndef ANSWER\n#define ANSWER 4\n#endif\n"
                      "#ifdef __OPTIMIZE__\n#define OPT 1\n#else\n#define OPT 0\n#endif\n"
                      'extern "C" __attribute__((visibility("default"))) int answer() { return ANSWER * 10 + OPT; }\n')
    monkeypatch.delenv("MOECHAT_NATIVE_CFLAGS", raising=False)
    plain = native.build("flags", [source])
    monkeypatch.setenv("MOECHAT_NATIVE_CFLAGS", "-DANSWER=5 -O0")
    flagged = native.build("flags", [source])
    assert flagged != plain
    assert (ctypes.CDLL(str(plain)).answer(), ctypes.CDLL(str(flagged)).answer()) == (41, 50)


def test_an_assembler_failure_is_one_line_that_names_it(monkeypatch, tmp_path):
    """GNU as says `Error:` (capitalized; GCC 12's AMX macros on Windows met one): the notice was the first 200 characters
    of the output, lines and all, starting with `Assembler messages:`."""
    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "asm.cpp"
    source.write_text('void f() { asm volatile("no_such_instruction %eax"); }\n')
    with pytest.raises(native.NativeBuildError) as err:
        native.build("asm", [source])
    msg = str(err.value)
    assert "\n" not in msg and "no_such_instruction" in msg and "full log in" in msg, msg


def test_a_compiler_that_fails_without_a_word_says_its_exit_status(monkeypatch, tmp_path):
    """CXX=/bin/false, or a wrapper that exits 1 silently: the notice said `the build failed ()`."""
    silent = tmp_path / "cxx"
    silent.write_text('#!/bin/sh\n[ "$1" = --version ] && exit 0\nexit 3\n')
    silent.chmod(0o755)
    monkeypatch.setenv("CXX", str(silent))
    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "s.cpp"
    source.write_text("int f() { return 1; }\n")
    with pytest.raises(native.NativeBuildError, match=r"the build failed \(cxx exited with status 3\); full log in"):
        native.build("silent", [source])


@pytest.fixture
def hanging_compiler(monkeypatch, tmp_path):
    """A C++ compiler that hangs (its version read from a file the test may change), builds timed out after 2 s, and
    start(): a build as a new process makes it -> (compilers started, the error's line)."""
    starts, version, source = tmp_path / "starts", tmp_path / "version", tmp_path / "s.cpp"
    version.write_text("1.0")
    hangs = tmp_path / "cxx"
    hangs.write_text(f'#!/bin/sh\n[ "$1" = --version ] && cat "{version}" && exit 0\necho x >> "{starts}"\nexec sleep 30\n')
    hangs.chmod(0o755)
    monkeypatch.setenv("CXX", str(hangs))
    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "BUILD_TIMEOUT_S", 2, raising=False)
    source.write_text("int f() { return 1; }\n")

    def start() -> tuple[int, str]:
        native.reset()  # what a new process starts with
        before = len(starts.read_text().split()) if starts.exists() else 0
        with pytest.raises(native.NativeBuildError) as err:
            native.build("hangs", [source])
        return len(starts.read_text().split()) - before, str(err.value)

    try:
        yield SimpleNamespace(start=start, version=version, cache=tmp_path / "cache", starts=starts)
    finally:
        native.reset()


def test_a_compiler_that_hangs_costs_one_timeout_not_one_per_source_and_library(hanging_compiler, monkeypatch, tmp_path):
    """A compiler that never finishes: each source waited its own 600 s, as many at a time as the cores (the CPU library's
    five on 2 cores: 30 minutes), then the scheduler's library the same again, before the first answer. Now one build
    waits BUILD_TIMEOUT_S in all, and a later build in the process does not start that compiler again."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    sources = []
    for i in range(5):
        sources.append(tmp_path / f"s{i}.cpp")
        sources[-1].write_text(f"int f{i}() {{ return {i}; }}\n")
    native.reset()
    for name in ("first", "second"):
        with pytest.raises(native.NativeBuildError, match="did not finish within 2 s") as err:
            native.build(name, sources)
        assert "\n" not in str(err.value)
    assert len(hanging_compiler.starts.read_text().split()) == 2  # the first two sources only: none started after the time was up


def test_a_compiler_that_hung_is_refused_at_once_by_the_next_start_until_a_day_or_a_new_compiler(hanging_compiler):
    """`_hung` was per process: every start of moechat waited BUILD_TIMEOUT_S (600 s) for the same hanging compiler again.
    It is remembered on disk beside the libraries, by the compiler's path and version, for HUNG_RETRY_S."""
    import os
    import time

    def started_by_a_new_process() -> int:
        ran, said = hanging_compiler.start()
        assert "did not finish within 2 s" in said
        return ran

    assert started_by_a_new_process() == 1
    assert started_by_a_new_process() == 0  # refused at once, the same line
    marker, = hanging_compiler.cache.glob("hung-*")
    os.utime(marker, (time.time() - native.HUNG_RETRY_S - 1,) * 2)
    assert started_by_a_new_process() == 1  # a day later: tried again
    assert started_by_a_new_process() == 0
    hanging_compiler.version.write_text("2.0")  # the compiler updated
    assert started_by_a_new_process() == 1


def test_a_compiler_remembered_as_hung_says_so_and_how_to_try_it_again(hanging_compiler):
    """The next start refused at once with 'did not finish within 600 s' (false for that run, which ran nothing) and no
    way to try the compiler again but waiting a day; a marker dated a year ahead (a clock set wrong, a home shared with
    such a machine) held it for that year."""
    import os
    import time

    assert hanging_compiler.start()[0] == 1
    marker, = hanging_compiler.cache.glob("hung-*")
    ran, said = hanging_compiler.start()
    assert ran == 0 and "when moechat last built with it" in said and f"delete {marker} to try it again" in said
    marker.unlink()
    assert hanging_compiler.start()[0] == 1
    os.utime(marker, (time.time() + 365 * 86400,) * 2)
    assert hanging_compiler.start()[0] == 1


@pytest.mark.parametrize(("platform", "said", "static"), [
    ("win32", "g++.exe (Rev3, Built by MSYS2 project) 13.2.0\nCopyright (C) 2023 Free Software Foundation, Inc.", True),
    ("win32", "clang version 17.0.6\nTarget: x86_64-w64-windows-gnu", False),
    ("linux", "g++ (GCC) 13.2.0\nCopyright (C) 2023 Free Software Foundation, Inc.", False),
], ids=["mingw g++", "clang on windows", "g++ on linux"])
def test_a_windows_gcc_build_links_its_runtime_into_the_dll(monkeypatch, tmp_path, platform, said, static):
    """MinGW's g++ made a DLL that needs libstdc++-6.dll (and libgcc, libwinpthread) beside it, which Python's DLL search
    does not find: the kernels failed to load. Read from the commands of a compiler that records them."""
    calls = tmp_path / "calls"
    cxx = tmp_path / "cxx"
    cxx.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then printf "%s\\n" "{said}"; exit 0; fi\n'
                   f'echo "$@" >> "{calls}"\nwhile [ $# -gt 1 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "platform", platform)
    source = tmp_path / "s.cpp"
    source.write_text("int f() { return 1; }\n")
    native.build("runtime", [source])
    compile_line, link_line = calls.read_text().splitlines()
    assert "-shared" in link_line.split() and "-shared" not in compile_line.split()
    assert ("-static" in link_line.split()) == static and "-static" not in compile_line.split()


def test_a_build_killed_midway_leaves_nothing_the_next_build_keeps(monkeypatch, tmp_path):
    """A build killed while compiling (kill -9, a closed laptop) left its objects and an empty library file, about 300 KB
    for the CPU kernels, each time: the next build clears the leftovers of processes that are gone (untouched for
    ABANDONED_S, as a cache folder shared between machines sees other hosts' builds), and leaves a live build's alone."""
    import os
    import subprocess
    import time

    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    cache = tmp_path / "cache"
    good = tmp_path / "good.cpp"
    good.write_text('extern "C" __attribute__((visibility("default"))) int answer() { return 42; }\n')
    killer = tmp_path / "cxx"  # writes its object, then kills the build that started it
    killer.write_text('#!/bin/sh\n[ "$1" = --version ] && exit 0\nwhile [ "$1" != -o ]; do shift; done\n'
                      'head -c 300000 /dev/zero > "$2"\nkill -9 $PPID\n')
    killer.chmod(0o755)
    env = {**os.environ, "MOECHAT_NATIVE_DIR": str(cache), "CXX": str(killer)}
    code = f"from moechat.engine import native; native.build('k', [__import__('pathlib').Path({str(good)!r})])"
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == -9
    left = [p for p in cache.iterdir() if p.name.startswith(".")]
    assert left and sum(f.stat().st_size for p in left for f in [p, *p.rglob("*")] if f.is_file()) >= 300000
    live = cache / f".libmoechat_k-{'0' * 16}.{os.getpid()}-x.tmp"  # a build of this (live) process: kept
    live.mkdir()
    old = time.time() - 2 * 3600  # past ABANDONED_S
    for p in [*left, live]:
        os.utime(p, (old, old))
    monkeypatch.setenv("MOECHAT_NATIVE_DIR", str(cache))
    import ctypes

    assert ctypes.CDLL(str(native.build("k", [good]))).answer() == 42
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == [live.name]


@needs_native
def test_a_killed_build_of_a_pid_alive_here_is_removed_once_old(tmp_path):
    """A build killed in another container (its pid 1, alive here too) left its folder for good: the pid was alive. A pid
    alive here that started at another time is another process; this process's own build folder is kept."""
    import os
    import tempfile
    import time
    from pathlib import Path

    import psutil

    name, other = f".libmoechat_k-{'0' * 16}", int(psutil.Process(1).create_time()) - 100
    with tempfile.TemporaryDirectory(prefix=native.private_prefix(name[1:]), suffix=".tmp", dir=tmp_path) as work:
        mine = Path(work)  # named as native.build names its folder
        theirs, young = tmp_path / f"{name}.1-{other}.abcd_123.tmp", tmp_path / f"{name}.1-{other}.efgh_456.tmp"
        old = time.time() - 2 * native.ABANDONED_S
        for p in (theirs, young):  # young: another host's, building
            p.mkdir()
        for p in (theirs, mine):
            os.utime(p, (old, old))
        native._remove_abandoned(tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, young.name])


@pytest.mark.skipif(sys.platform == "win32", reason="no SIGBUS on Windows")
@pytest.mark.parametrize("send", ["os.kill(os.getpid(), signal.SIGBUS)", "signal.raise_signal(signal.SIGBUS)"])
def test_a_bus_error_no_file_caused_is_not_said_to_be_a_model_file(send):
    """The handler said "a model file changed or shrank on disk ... download the model again" for every SIGBUS: one sent
    by `kill -BUS` (or a machine-check memory error) too. It gives the terminal back for those and says nothing else."""
    import signal
    import subprocess

    code = ("import os, signal\nfrom moechat.engine import native\nfrom moechat.engine.experts import cpu_ffn\n"
            f"native.report_bus_errors(cpu_ffn.library(), before='<reset>')\n{send}\nprint('not reached')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGBUS and done.stdout == ""
    assert done.stderr == "<reset>", done.stderr[-500:]


@pytest.fixture
def one_row_tokens():
    """Sets up to how many tokens the AVX-512 products read one weight row at a time; the CPU's default restored after."""
    default = cpu_ffn.one_row_tokens()
    yield cpu_ffn.one_row_tokens
    cpu_ffn.one_row_tokens(default)


@needs_native
def test_the_products_read_one_row_at_a_time_at_1_and_2_tokens_on_amd_cpus(one_row_tokens):
    from moechat.engine.calibration.probe import cpu_vendor

    assert one_row_tokens() == (2 if "AuthenticAMD" in cpu_vendor() else 0)  # the native cpuid agrees with /proc/cpuinfo
    assert one_row_tokens(9) == 9 and one_row_tokens() == 9


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("w_dtype,x_dtype", DTYPES[:3], ids=lambda d: str(d).replace("torch.", ""))
def test_one_row_at_a_time_gives_the_four_rows_bits(isa, w_dtype, x_dtype, one_row_tokens):
    """Rows read one at a time or four side by side: each row's sum runs in one order, so the experts' outputs are the
    same bits at every token count (which the CPU takes is a speed choice, never a result)."""
    for H, I, sizes in SHAPES:
        args = case(H, I, sizes, w_dtype, x_dtype)
        outs = []
        for n in (0, 16):
            one_row_tokens(n)
            outs.append(cpu_ffn.moe_ffn_native(*args, out=torch.zeros(5, H), isa=isa))
        assert torch.equal(*outs), (isa, H, I, sizes)


@needs_native
@pytest.mark.parametrize("n", [0, 2, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_linears_bits_do_not_depend_on_t_either_way(n, dtype, one_row_tokens):
    """On AMD's CPUs the AVX-512 decode linears run the experts' tiles (one row a tile at 1-2 tokens), elsewhere dot4:
    under either, a token's outputs are the same bits alone and among 1-8 others (the head of a verification pass
    equals its decode steps'), and bf16 weights give their fp32 widening's bits."""
    from moechat.engine.model import decode_ops

    one_row_tokens(n)
    gen = torch.Generator().manual_seed(n)
    x, w, b = torch.randn(9, 203, generator=gen), torch.randn(70, 203, generator=gen).to(dtype), torch.randn(70, generator=gen)
    y = decode_ops.linear(x, w, b)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w.float(), b), rtol=1e-5, atol=1e-4)
    assert torch.equal(y, decode_ops.linear(x, w.float(), b))
    for T in (1, 2, 3, 5):
        for t in range(0, 9 - T + 1, T):
            assert torch.equal(decode_ops.linear(x[t:t + T].clone(), w, b), y[t:t + T]), (T, t)
    for r in (0, 33, 69):  # a row alone: its block's tail
        assert torch.equal(decode_ops.linear(x, w[r:r + 1].contiguous(), b[r:r + 1]), y[:, r:r + 1]), r
