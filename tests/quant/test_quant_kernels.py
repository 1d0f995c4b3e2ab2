"""The quantized formats (engine/quant/formats.py) and the native int8/int6/int4 CPU kernel
(csrc/cpu/quant_ffn.cpp) against their pure-PyTorch twins, on every path this CPU has."""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from moechat.engine import native
from moechat.engine.experts import cpu_ffn
from moechat.engine.quant import formats

_built = pytest.mark.skipif(not cpu_ffn.available(), reason=f"native CPU kernels not built: {native.notice('cpu')}")


def needs_native(test):
    return pytest.mark.native(_built(test))
ISAS = [isa for isa in cpu_ffn.Q_ISAS if cpu_ffn.q_isa_supported(isa)]
FORMATS = formats.LAYOUTS  # the experts' two and the head's int6


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def case(H, I, sizes, fmt, E=6, N=5, seed=0, x_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    gate_up = formats.quantize(torch.randn(E, 2 * I, H, generator=g) * 0.1, fmt)
    down = formats.quantize(torch.randn(E, H, I, generator=g) * 0.1, fmt)
    x = torch.randn(N, H, generator=g).to(x_dtype)
    experts = torch.randperm(E, generator=g)[:len(sizes)]
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int64)
    S = int(offsets[-1])
    return x, gate_up, down, experts, offsets, torch.randint(0, N, (S,), generator=g), torch.rand(S, generator=g)


# ---- formats ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [32, 40, 64, 100, 768])
def test_quantize_round_trip_is_within_half_a_step(fmt, k):
    """Every weight within half a step of its code, except (int4) where the fitted range clips it: then within its step
    plus the distance the block's range was narrowed by."""
    w = torch.randn(32, k) * 0.05
    qm = formats.quantize(w, fmt)
    assert qm.shape == (32, k) and qm.nbytes == formats.matrix_bytes(fmt, 32, k)
    step = formats.deinterleave_scales(qm.scale).float().repeat_interleave(formats.BLOCK, -1)[:, :k]  # d per weight
    err = (formats.dequantize(qm) - w).abs()
    inside = torch.ones_like(w, dtype=torch.bool)
    if fmt == "int4":  # the weights the codes' range [m, m + 15 d] holds
        m = formats.deinterleave_scales(qm.minimum).float().repeat_interleave(formats.BLOCK, -1)[:, :k]
        inside = (w >= m - 0.5 * step) & (w <= m + 15.5 * step)
        assert float(inside.float().mean()) > 0.95  # the fit clips a few outliers, not the bulk
    tol = 0.5 * step + 1e-3 * step.clamp_min(1e-8) + 2e-5
    assert bool((err[inside] <= tol[inside]).all()), float((err / step)[inside].max())


@pytest.mark.parametrize("k", [32, 100, 768])
def test_int4_fits_scale_and_minimum_closer_than_rounding_on_the_range(k):
    """int4's fitted d and m (least squares over candidate ranges, as llama.cpp's Q4_K) against round-to-nearest on each
    block's min/max, which it replaced: about 19 % less squared error on Gaussian weights."""
    w = torch.randn(64, k, generator=torch.Generator().manual_seed(k)) * 0.05
    fitted = formats.dequantize(formats.quantize(w, "int4"))
    b = formats._blocks(w)  # [R, nb, 32]
    lo, hi = b.amin(-1), b.amax(-1)
    d, m = ((hi - lo) / 15).half().float()[..., None], lo.half().float()[..., None]
    plain = (torch.round((b - m) / d).clamp(0, 15) * d + m).flatten(-2)[:, :k]
    assert float(((fitted - w) ** 2).sum()) < 0.9 * float(((plain - w) ** 2).sum())


@pytest.mark.parametrize("fmt", FORMATS)
def test_interleaving_puts_four_columns_of_sixteen_rows_in_one_vector(fmt):
    """The kernel's layout: per group of 16 rows and block, vector i lane r holds row r's columns 4i..4i+3
    (int4: 8v..8v+3 in the low nibbles, 8v+4..8v+7 in the high ones; int6: those nibbles, then vector 4 + h byte j
    holds bits 4-5 of columns 4i + j, i = 4h..4h+3, two bits per i)."""
    u = torch.randint(0, 1 << formats.BITS[fmt], (32, 64), dtype=torch.uint8)
    q = formats.interleave(u, fmt)
    assert torch.equal(formats.deinterleave(q, fmt), u)
    group1_block1 = q[16:32].reshape(-1)[64 * formats.BITS[fmt]:]  # second group, second block
    r, i = 5, 2
    if fmt == "int8":
        assert group1_block1[64 * i + 4 * r:64 * i + 4 * r + 4].tolist() == u[16 + r, 32 + 4 * i:32 + 4 * i + 4].tolist()
    else:
        byte = group1_block1[64 * i + 4 * r + 1]
        assert [int(byte & 0xF), int(byte >> 4)] == [int(u[16 + r, 32 + 8 * i + 1]) & 0xF, int(u[16 + r, 32 + 8 * i + 5]) & 0xF]
    if fmt == "int6":  # column 32 + 4·6 + 3 = step 6 (h = 1, its third), byte 3
        byte = group1_block1[64 * 5 + 4 * r + 3]
        assert int(byte >> 4) & 3 == int(u[16 + r, 32 + 4 * 6 + 3]) >> 4
    d = torch.randn(32, 2).half()
    assert torch.equal(formats.deinterleave_scales(formats.interleave_scales(d)), d)
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        formats.quantize(torch.randn(24, 32), fmt)


def test_bytes_per_weight_counts_the_scales():
    weights = 16 * 2048  # whole blocks: no padding
    assert formats.matrix_bytes("int8", 16, 2048) / weights == pytest.approx(8.5 / 8)
    assert formats.matrix_bytes("int6", 16, 2048) / weights == pytest.approx(6.5 / 8)  # Q6_K: 6.5625
    assert formats.matrix_bytes("int4", 16, 2048) / weights == pytest.approx(5 / 8)
    assert formats.matrix_bytes("int4", 16, 2048) == 16 * 2048 * 5 // 8


def test_activation_quantization_is_per_token_and_block():
    x = torch.randn(3, 70)
    qx, dx = formats.quantize_activations(x)
    assert qx.shape == (3, 96) and dx.shape == (3, 3) and qx.dtype == torch.int8
    assert bool((qx[:, 70:] == 0).all())  # padding
    assert torch.allclose(formats.fake_quantize_activations(x), x, atol=float(dx.max()) / 2 + 1e-6)
    one, _ = formats.quantize_activations(x[1:2])
    assert torch.equal(one[0], qx[1])  # a token's codes do not depend on the others


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_native_activation_quantization_is_the_twin_bit_for_bit(isa):
    """The kernels' own quantization of their inputs (whole blocks vectorised, the rest and "scalar" by the portable
    loop): the twin's codes and scales exactly, ties rounded to even, a block of zeros and a padded tail included."""
    x = torch.randn(5, 200) * 3  # 6 whole blocks and a tail of 8 columns
    x[1, 32:64] = 0
    x[2, :32] = torch.tensor([127.0] + [k + 0.5 for k in range(-15, 16)])  # dx = 1: every other value a tie
    x[3, 96:128] *= 1e-30
    q, d, ds = cpu_ffn.quantize_activations(x, isa)
    tq, td = formats.quantize_activations(x)
    assert torch.equal(q, tq) and torch.equal(d, td)
    assert torch.equal(ds, td * tq.view(5, -1, formats.BLOCK).sum(-1).float())
    assert q[2, 1:5].tolist() == [-14, -14, -12, -12]  # -14.5, -13.5, -12.5, -11.5 to even


def test_bad_format_is_refused_in_one_line():
    with pytest.raises(ValueError, match="int8, int6, int4"):
        formats.quantize(torch.randn(2, 32), "int3")


# ---- the native kernel --------------------------------------------------------------------------

SHAPES = [(64, 32, [1, 0, 3]), (48, 16, [9, 1]), (256, 192, [1, 2, 4, 5]), (144, 80, [16, 2, 11])]  # K padded: 48, 80, 144


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_equals_the_twin(isa, fmt):
    """One matrix: both quantize the same activations to the same codes, so only fp32 order differs."""
    for rows, k, t in ((32, 64, 1), (80, 200, 5), (128, 2048, 9), (48, 96, 20)):
        w = formats.quantize(torch.randn(rows, k) * 0.05, fmt)
        x = torch.randn(t, k)
        assert rel_err(cpu_ffn.q_linear(x, w, isa=isa), formats.linear(x, w)) < 2e-6


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_expert_ffn_equals_the_twin(isa, fmt, x_dtype):
    """Whole FFNs: the hidden product is quantized again, where an fp32 difference of 1e-7 can move a
    value across a rounding boundary (one code, dx/127 of its block): hence 1e-2, not 1e-6."""
    for H, I, sizes in SHAPES:
        x, gu, dn, experts, offsets, rows, w = case(H, I, sizes, fmt, x_dtype=x_dtype)
        ref = cpu_ffn.moe_ffn_torch(x.float(), gu, dn, experts, offsets, rows, w, torch.zeros(5, H))
        out = cpu_ffn.moe_ffn_q_native(x, gu, dn, experts, offsets, rows, w, torch.zeros(5, H), isa=isa)
        assert rel_err(out, ref) < 1e-2, (H, I, sizes)


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_nan_activation_gives_nan_outputs_as_in_the_twin(isa, fmt):
    """A NaN in a token's activations makes its block's dx NaN in the twin (amax keeps it), so every product of that token
    is NaN and the engine's check of the logits reports it. The kernels' max dropped the NaN: a finite scale, made-up
    codes, finite garbage for the token (phase 2 dropped the NaN of silu(NaN) again)."""
    x, gu, dn, experts, offsets, rows, w = case(64, 32, [2, 1], fmt)
    x[rows[0], 40] = float("nan")
    ref = cpu_ffn.moe_ffn_torch(x, gu, dn, experts, offsets, rows, w, torch.zeros(5, 64))
    out = cpu_ffn.moe_ffn_q_native(x, gu, dn, experts, offsets, rows, w, torch.zeros(5, 64), isa=isa)
    assert bool(ref[rows[0]].isnan().all()) and torch.equal(out.isnan(), ref.isnan())
    y, want = cpu_ffn.q_linear(x, gu[0], isa=isa), formats.linear(x, gu[0])
    assert bool(want[rows[0]].isnan().all()) and torch.equal(y.isnan(), want.isnan())
    _, d, _ = cpu_ffn.quantize_activations(x, isa)
    assert torch.equal(d.isnan(), formats.quantize_activations(x)[1].isnan())  # that block's scale alone


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tokens_result_does_not_depend_on_its_batch(isa, fmt):
    """Lossless speculative decoding needs this: verifying γ+1 tokens gives each the bits it gets alone, whether the
    kernel takes them in one pass (VNNI: up to 10), in even passes (11 = 6 + 5) or on AMX tiles (int8 11+, int4 28+)."""
    H, I = 256, 96
    for n in (9, 10, 11, 29, 40):
        x, gu, dn, *_ = case(H, I, [1], fmt, N=n)
        batch = torch.zeros(n, H)
        cpu_ffn.moe_ffn_q_native(x, gu, dn, torch.tensor([2]), torch.tensor([0, n]), torch.arange(n), torch.ones(n), batch,
                                 isa=isa)
        for t in (0, 4, n - 1):
            alone = torch.zeros(1, H)
            cpu_ffn.moe_ffn_q_native(x[t:t + 1].contiguous(), gu, dn, torch.tensor([2]), torch.tensor([0, 1]),
                                     torch.tensor([0]), torch.ones(1), alone, isa=isa)
            assert torch.equal(alone[0], batch[t]), (n, t)


@needs_native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_outputs_written_at_their_rows_equal_outputs_in_group_order(fmt, x_dtype):
    """routed_ffn_q (the kernel reads x's rows and writes activation i's output to row i) against the per-activation
    mode over gathered rows (what the grouped path runs), bit for bit, groups of 1 to 40 activations."""
    g = torch.Generator().manual_seed(3)
    E, H, I, N, k = 8, 256, 96, 23, 4
    gu = formats.quantize(torch.randn(E, 2 * I, H, generator=g) * 0.1, fmt)
    dn = formats.quantize(torch.randn(E, H, I, generator=g) * 0.1, fmt)
    x = torch.randn(N, H, generator=g).to(x_dtype)
    flat = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).reshape(-1)  # [S] router order
    flat[flat == 7] = 6  # expert 7 unused; 6 takes 40 activations or so
    pos = torch.sort(flat, stable=True).indices  # activation ids grouped by expert
    sizes = torch.bincount(flat, minlength=E)
    routed = cpu_ffn.routed_ffn_q(x, gu, dn, pos, sizes, k)
    grouped = cpu_ffn.moe_ffn_q_native(x[pos // k].contiguous(), gu, dn, sizes.nonzero().flatten(),
                                       torch.tensor([0, *sizes[sizes > 0].cumsum(0)]), torch.arange(len(pos)), None,
                                       torch.empty(len(pos), H))  # [S, H] in pos order
    expected = torch.empty_like(routed)
    expected[pos] = grouped
    assert torch.equal(routed, expected) and not torch.equal(routed, grouped)
    with pytest.raises(AssertionError):  # a row past out would be written past its end: refused before the kernel
        cpu_ffn.moe_ffn_q_native(x, gu, dn, torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([0]), None,
                                 torch.empty(1, H), out_rows=torch.tensor([1]))


@needs_native
@pytest.mark.parametrize("fmt", FORMATS)
def test_threads_do_not_change_the_result(fmt):
    x, gu, dn, experts, offsets, rows, w = case(256, 192, [1, 2, 4, 5], fmt)
    one = cpu_ffn.moe_ffn_q_native(x, gu, dn, experts, offsets, rows, w, torch.zeros(5, 256), threads=1)
    two = cpu_ffn.moe_ffn_q_native(x, gu, dn, experts, offsets, rows, w, torch.zeros(5, 256), threads=2)
    assert torch.equal(one, two)


@needs_native
def test_the_vector_paths_agree_with_the_portable_one_on_integer_dots():
    """Weights and activations that are exact in int8 codes: every path must give the same sums."""
    for fmt in FORMATS:
        w = formats.quantize(torch.randint(-7, 8, (32, 128)).float(), fmt)  # two row groups
        x = torch.randint(-127, 128, (3, 128)).float()
        ys = [cpu_ffn.q_linear(x, w, isa=isa) for isa in ISAS]
        for y in ys[1:]:
            assert rel_err(y, ys[0]) < 1e-6


@needs_native
@pytest.mark.skipif(not cpu_ffn.q_isa_supported("amx_int8"), reason="this CPU (or its kernel) offers no AMX-INT8 tiles")
@pytest.mark.parametrize("fmt, first", [("int8", 11), ("int4", 28)])
def test_amx_tiles_give_the_vnni_paths_bits(fmt, first):
    """The tiles make the same integer sums (int4's nibbles unpacked into int8's layout) and scale them in the same
    order: equal, not close, around the token count where AMX takes over, past one and two 16-token tiles (a last tile
    of every size, 1-16 rows), in odd and even numbers of row groups and blocks, linear and FFN; int6 (the head) stays on VNNI."""
    assert cpu_ffn.resolved_q_isa("amx_int8", fmt) == "amx_int8" and cpu_ffn.resolved_q_isa("amx_int8", "int6") == "avx512_vnni"
    assert cpu_ffn.resolved_q_isa("avx512_vnni", fmt) == "avx512_vnni"  # MOECHAT_CPU_ISA=avx512_vnni still forces VNNI
    for rows, k, t in ((48, 96, first), (96, 2048, first + 1), (32, 160, first - 1), (16, 64, 16), (48, 352, 2 * first + 3),
                       (32, 64, 128)):
        w = formats.quantize(torch.randn(rows, k) * 0.05, fmt)
        x = torch.randn(t, k)
        assert torch.equal(cpu_ffn.q_linear(x, w, isa="amx_int8"), cpu_ffn.q_linear(x, w, isa="avx512_vnni")), (rows, k, t)
    for H, I, sizes in ((144, 80, [16, 2, first]), (256, 192, [9, 8, 1, first + 9]), (96, 48, [first - 1, 2 * first + 1])):
        x, gu, dn, experts, offsets, rows, w = case(H, I, sizes, fmt, N=24)
        amx, vnni = (cpu_ffn.moe_ffn_q_native(x, gu, dn, experts, offsets, rows, w, torch.zeros(24, H), isa=isa)
                     for isa in ("amx_int8", "avx512_vnni"))
        assert torch.equal(amx, vnni), (H, I, sizes)
    w = formats.quantize(torch.randn(32, 96) * 0.05, fmt)  # each last tile's own code (amxq_tokens<BITS, TT>): 1-16 rows
    for t in range(max(first, 17), max(first, 17) + 16):
        x = torch.randn(t, 96)
        assert torch.equal(cpu_ffn.q_linear(x, w, isa="amx_int8"), cpu_ffn.q_linear(x, w, isa="avx512_vnni")), t


@needs_native
@pytest.mark.skipif(not (cpu_ffn.q_isa_supported("avx_vnni") and cpu_ffn.q_isa_supported("avx512_vnni")),
                    reason="this CPU lacks AVX-VNNI or AVX-512 VNNI to compare")
def test_avx_vnni_gives_the_avx512_vnni_paths_bits():
    """The ymm path (Intel Core without AVX-512) makes each lane's integer sums and scales them as the zmm path does:
    equal, not close, at 1 to 12 tokens (one pass holds 5), both formats, linear and FFN."""
    for fmt in FORMATS:
        for rows, k, t in ((48, 96, 1), (96, 2048, 2), (32, 160, 5), (16, 64, 7), (48, 352, 12)):
            w = formats.quantize(torch.randn(rows, k) * 0.05, fmt)
            x = torch.randn(t, k)
            ymm, zmm = (cpu_ffn.q_linear(x, w, isa=isa) for isa in ("avx_vnni", "avx512_vnni"))
            assert torch.equal(ymm, zmm), (fmt, rows, k, t)
        x, gu, dn, experts, offsets, rows, w = case(256, 192, [9, 1, 3, 5], fmt, N=24)
        ymm, zmm = (cpu_ffn.moe_ffn_q_native(x, gu, dn, experts, offsets, rows, w, torch.zeros(24, 256), isa=isa)
                    for isa in ("avx_vnni", "avx512_vnni"))
        assert torch.equal(ymm, zmm), fmt


@needs_native
def test_dispatcher_takes_the_quantized_kernel(monkeypatch):
    x, gu, dn, experts, offsets, rows, w = case(64, 32, [1, 3], "int4")
    calls = []
    monkeypatch.setattr(cpu_ffn, "moe_ffn_q_native", lambda *a, **k: calls.append(1) or a[-1])
    cpu_ffn.moe_ffn(x, gu, dn, experts, offsets, rows, w, torch.zeros(5, 64))
    assert calls == [1]


def test_twin_grouped_ffn_matches_one_expert_at_a_time(monkeypatch):
    monkeypatch.setattr(cpu_ffn, "library", lambda: None)  # the twin path, as on a GPU
    x, gu, dn, *_ = case(64, 32, [1], "int8", N=6)
    ids = torch.tensor([0, 0, 3, 3, 3, 5])
    y = cpu_ffn.grouped_ffn_q(x, gu, dn, ids, F.silu)
    for i, e in enumerate(ids.tolist()):
        assert torch.allclose(y[i], formats.expert_ffn(x[i:i + 1], gu[e], dn[e], F.silu)[0], atol=1e-6)


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """The quantized kernels and the quantizer as they build on ARM: the portable paths alone."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOECHAT_NATIVE_DIR", str(tmp_path_factory.mktemp("native")))
        path = native.build("cpu_portable_q", [cpu_ffn.SOURCE, cpu_ffn.Q_SOURCE], ["-DMOE_PORTABLE_ONLY"],
                            headers=sorted(cpu_ffn.SOURCE.parent.glob("*.h")))
    lib = ctypes.CDLL(str(path))
    lib.moe_q_linear.argtypes, lib.moe_quantize.argtypes = cpu_ffn._QL_ARGTYPES, cpu_ffn._QZ_ARGTYPES
    lib.moe_quantize.restype = ctypes.c_int
    return lib


@needs_native
def test_portable_build_runs_the_quantized_kernel(portable):
    """As the library builds on ARM: only the scalar path, equal to the twin."""
    lib = portable
    assert [lib.moe_q_isa_supported(cpu_ffn.ISA[i]) for i in cpu_ffn.Q_ISAS] == [1, 0, 0, 0, 0]
    w = formats.quantize(torch.randn(48, 96) * 0.05, "int4")
    x = torch.randn(3, 96)
    out = torch.empty(3, 48)
    code = lib.moe_q_linear(w.q.data_ptr(), w.scale.data_ptr(), w.minimum.data_ptr(), 4, 48, 96, x.data_ptr(), 3,
                            out.data_ptr(), 1, 0)
    assert code == 0 and rel_err(out, formats.linear(x, w)) < 2e-6
    # the x86 build quantizes activations with AVX-512 where it can, the portable build in plain C++: the same bytes,
    # so the scalar path's sums agree bit for bit (ties included: x on the code grid's half-steps)
    x = torch.cat([torch.randn(2, 96), (torch.randint(-254, 255, (2, 96)) / 2).float()]) * 0.37
    mine = torch.empty(4, 48)
    assert lib.moe_q_linear(w.q.data_ptr(), w.scale.data_ptr(), w.minimum.data_ptr(), 4, 48, 96, x.data_ptr(), 4,
                            mine.data_ptr(), 1, 0) == 0
    assert torch.equal(mine, cpu_ffn.q_linear(x, w, threads=1, isa="scalar"))


@needs_native
def test_bad_arguments_return_codes_not_crashes():
    lib = cpu_ffn.library()
    w = formats.quantize(torch.randn(16, 64), "int8")
    x, out = torch.randn(1, 64), torch.empty(1, 16)
    args = (w.q.data_ptr(), w.scale.data_ptr(), 0)
    assert lib.moe_q_linear(*args, 3, 16, 64, x.data_ptr(), 1, out.data_ptr(), 1, 0) == -1  # bits
    assert lib.moe_q_linear(*args, 4, 16, 64, x.data_ptr(), 1, out.data_ptr(), 1, 0) == -1  # int4 without minimums
    assert lib.moe_q_linear(*args, 8, 8, 64, x.data_ptr(), 1, out.data_ptr(), 1, 0) == -3  # not whole row groups
    assert lib.moe_q_linear(*args, 8, 16, 64, x.data_ptr(), 1, out.data_ptr(), 1, cpu_ffn.ISA["avx512"]) == -2  # not a q path


@needs_native
def test_a_quantized_linear_refuses_inputs_of_another_width():
    """The kernel reads x as [T, w.k]: a narrower x was read past its end (heap overflow under ASan) and a wider one
    misread, where the twin raises; refused before the call."""
    w = formats.quantize(torch.randn(32, 64), "int8")
    for x in (torch.randn(2, 40), torch.randn(2, 96), torch.randn(1, 2, 64)):
        with pytest.raises(ValueError, match="not \\[T, 64\\]"):
            cpu_ffn.q_linear(x, w)


@needs_native
@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_native_quantize_is_the_twin_bit_for_bit(fmt, dtype, build, request, monkeypatch):
    """The cache is written by the native quantizer: its codes, scales and minimums must be formats.quantize's, on this
    CPU's path (AVX2 where it has it) and on the portable one (ARM's). int4's fit runs 4 blocks of a row at once (2 and
    2 in the portable vectors), the rest of the row block by block: rows of 4, 64, 6 (4 + 2) and 2 blocks."""
    if build == "portable":
        lib = request.getfixturevalue("portable")
        monkeypatch.setattr(cpu_ffn, "library", lambda: lib)
    g = torch.Generator().manual_seed(1)
    for shape in ((2, 32, 100), (48, 2048), (32, 180), (16, 40)):
        w = (torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 0.05).to(dtype)
        w[..., 0, :5] = 0
        w[..., 1, :] = 0 if dtype == torch.bfloat16 else 1e-6  # a row whose scales are fp16 subnormals
        w[..., 2, 32:64] = 0.01  # a block of one value beside fitted ones: no range, min/max
        w[..., 3, :32], w[..., 3, 24] = 0.0, -0.0  # zeros of both signs: which one is the minimum shows in m's sign
        w[..., 4, :32] = w[..., 4, :32].abs()
        w[..., 4, 5], w[..., 4, 9] = -0.0, 0.0
        w[..., 5, :32] = (torch.arange(32) - 16.5) / 128  # ties between int8's codes (d = 1/128)...
        w[..., 6, :32] = (torch.arange(32) - 16.5) / 32  # ... and int6's (d = 1/32): to even
        w[..., 5:7, 0] = torch.tensor([127 / 128, 31 / 32])
        if dtype != torch.float16:  # int4's minimum beyond fp16's range (-inf): codes clamped to 15, not INT_MIN's 0
            w[..., 7, :32] = -1e5 - 1024 * torch.arange(32)
        twin, native_q = formats.quantize(w, fmt), cpu_ffn.quantize(w, fmt)
        for a, b in zip(twin.tensors(), native_q.tensors(), strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), shape  # bytes: torch.equal(-0., 0.) holds


@needs_native
@pytest.mark.parametrize("k", [1, 33, 257])
def test_native_int4_fit_is_the_twin_bit_for_bit_on_blocks_of_one_value(k):
    """A block of one weight and zeros (the padded tail of a width that is not a multiple of 32, or a pruned block) fits
    every candidate with an error of about 1e-20: which one wins is decided by the sums' last bits, so the twin must add
    in fit_q4's order (torch's sum(-1) did not: other scales and codes in 11 of 16 rows at k = 1)."""
    w = torch.randn(48, k, generator=torch.Generator().manual_seed(k)) * 0.1
    twin, native_q = formats.quantize(w, "int4"), cpu_ffn.quantize(w, "int4")
    for a, b in zip(twin.tensors(), native_q.tensors(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("native", [True, False], ids=["native", "twin"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_into_rows_of_a_larger_matrix_is_quantizing_the_whole(fmt, native, monkeypatch):
    """The cache's builder quantizes gate and up, each straight from the checkpoint, into their halves of gate_up."""
    if not native:
        monkeypatch.setattr(cpu_ffn, "library", lambda: None)
    g = torch.Generator().manual_seed(4)
    gate, up = ((torch.randn(48, 70, generator=g) * 0.05).to(torch.bfloat16) for _ in range(2))
    whole = formats.quantize(torch.cat([gate, up]), fmt)
    into = formats.empty_matrix(fmt, (), 96, 70)
    assert cpu_ffn.quantize(gate, fmt, out=into.rows_slice(0, 48)).q.data_ptr() == into.q.data_ptr()
    cpu_ffn.quantize(up, fmt, out=into.rows_slice(48, 96))
    for a, b in zip(whole.tensors(), into.tensors(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(ValueError, match="out holds"):
        cpu_ffn.quantize(gate, fmt, out=into)  # 96 rows for 48


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_batched_twin_is_one_expert_at_a_time_whatever_the_chunks(fmt):
    """The GPU's fast tier dequantizes chunks of experts at once: the same bits as expert by expert."""
    g = torch.Generator().manual_seed(3)
    gu = formats.quantize(torch.randn(6, 64, 48, generator=g) * 0.1, fmt)
    dn = formats.quantize(torch.randn(6, 48, 32, generator=g) * 0.1, fmt)
    x = torch.randn(7, 48, generator=g)
    experts, sizes, starts = [0, 3, 5], [2, 4, 1], [0, 2, 6]
    one_by_one = torch.cat([formats.expert_ffn(x[s:s + n], gu[e], dn[e], F.silu) for e, s, n in zip(experts, starts, sizes)])
    for max_weights in (1, 1 << 26):  # a chunk per expert; all in one chunk
        assert torch.equal(formats.grouped_expert_ffn(x, gu, dn, experts, sizes, F.silu, max_weights), one_by_one)
