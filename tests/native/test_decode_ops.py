"""The native decode ops (csrc/cpu/decode_ops.cpp) against their PyTorch twins (engine/model/decode_ops.py), and the
property the engine relies on: a position's bits do not depend on how many positions share its call."""
from __future__ import annotations

import pytest
import torch

from moechat.engine.experts import cpu_ffn
from moechat.engine.model import decode_ops
from moechat.engine.model.kv_cache import GrowingLayer

pytestmark = pytest.mark.native


@pytest.fixture(autouse=True, params=decode_ops.ISAS)
def _library(request):
    """Every test on each build of the kernels this CPU runs (AVX-512, AVX2, portable), the widest restored after."""
    if not decode_ops.available():
        pytest.skip(cpu_ffn.notice())
    if decode_ops.isa(request.param) != request.param:
        decode_ops.isa("avx512")
        pytest.skip(f"this CPU has no {request.param}")
    yield
    decode_ops.isa("avx512")


def _layer(past: torch.Tensor, values: torch.Tensor) -> GrowingLayer:
    layer = GrowingLayer(torch.float32)
    layer.update(past.clone(), values.clone())
    return layer


def _tables(start: int, T: int, D: int):
    pos = torch.arange(start, start + T, dtype=torch.float32)[:, None]  # [T, 1]
    freq = 10000.0 ** (-(torch.arange(D) % (D // 2)).float() / (D // 2))  # [D], halves repeated as transformers'
    return (pos * freq).cos(), (pos * freq).sin()  # [T, D] each


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 4, 128), (4, 4, 8), (6, 2, 20), (8, 1, 64)])
@pytest.mark.parametrize("norms", [True, False])
@pytest.mark.parametrize("T,past", [(1, 1), (1, 70), (5, 13), (40, 250)])  # 250 + 40 grows the 256-slot buffer
def test_attention_step_equals_its_twin(heads, kv_heads, head_dim, norms, T, past):
    gen = torch.Generator().manual_seed(T * 1000 + past)
    D, nq, nk = head_dim, heads * head_dim, kv_heads * head_dim
    keys, values = torch.randn(1, kv_heads, past, D, generator=gen), torch.randn(1, kv_heads, past, D, generator=gen)
    y = torch.randn(T, nq + 2 * nk, generator=gen)  # one fused projection's output: q, k, v side by side
    cos, sin = _tables(past, T, D)
    q_norm, k_norm = (torch.rand(D, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5) if norms else (None, None)
    args = (q_norm, k_norm, 1e-6, D ** -0.5, D)
    native, twin = _layer(keys, values), _layer(keys, values)
    a, b = y.clone(), y.clone()
    got = decode_ops.attention_step(a[:, :nq], a[:, nq:nq + nk], a[:, nq + nk:], native, cos, sin, *args)
    want = decode_ops.attention_step_torch(b[:, :nq], b[:, nq:nq + nk], b[:, nq + nk:], twin, cos, sin, *args)
    assert got.shape == want.shape == (T, nq)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert native.get_seq_length() == twin.get_seq_length() == past + T
    torch.testing.assert_close(native.keys, twin.keys, rtol=1e-5, atol=1e-5)  # normed and rotated
    assert torch.equal(native.values, twin.values)  # copied as they are


# one chunk of keys; six; five with D % 16; 55 chunks, which the pass's 160 rows fold in two waves and a step's 32 in one
@pytest.mark.parametrize("H,G,D,past", [(8, 2, 32, 20), (32, 4, 128, 700), (6, 2, 20, 515), (32, 4, 128, 7000)])
def test_attention_rows_do_not_depend_on_the_pass(H, G, D, past):
    """A verification of 5 positions gives the bits of the 5 decode steps it stands for (rows of one KV head go in
    blocks of 4 where they can, positions reach different chunks of keys, partial sums are folded in waves whose size
    depends on the rows: a row's path never changes its bits)."""
    gen = torch.Generator().manual_seed(1)
    T = 5
    keys, values = torch.randn(1, G, past, D, generator=gen), torch.randn(1, G, past, D, generator=gen)
    y = torch.randn(T, (H + 2 * G) * D, generator=gen)
    cos, sin = _tables(past, T, D)
    norm = torch.rand(D, generator=gen) + 0.5
    one_pass, steps = _layer(keys, values), _layer(keys, values)
    nq, nk = H * D, G * D
    a = y.clone()
    whole = decode_ops.attention_step(a[:, :nq], a[:, nq:nq + nk], a[:, nq + nk:], one_pass, cos, sin, norm, norm, 1e-6, 0.2, D)
    rows = []
    for t in range(T):
        b = y[t:t + 1].clone()
        rows.append(decode_ops.attention_step(b[:, :nq], b[:, nq:nq + nk], b[:, nq + nk:], steps, cos[t:t + 1], sin[t:t + 1],
                                              norm, norm, 1e-6, 0.2, D))
    assert torch.equal(whole, torch.cat(rows))
    assert torch.equal(one_pass.keys, steps.keys) and torch.equal(one_pass.values, steps.values)


def test_attention_bits_do_not_depend_on_the_wave_size():
    """Where few rows share a key (3 positions of 4 query heads per KV head), threads take chunks of 128 keys and their
    partial sums are folded after each wave; one chunk per wave, 3 or all 6 give the same bits, and those of the 3 decode
    steps (one wave each)."""
    gen = torch.Generator().manual_seed(5)
    H, G, D, past, T = 8, 2, 32, 700, 3
    keys, values = torch.randn(1, G, past, D, generator=gen), torch.randn(1, G, past, D, generator=gen)
    y = torch.randn(T, (H + 2 * G) * D, generator=gen)
    cos, sin = _tables(past, T, D)
    nq, nk = H * D, G * D
    default = decode_ops.attention_wave_bytes()
    outs = []
    try:
        for wave in (1.0, 3 * 4 * T * H * (D + 2), default):  # bytes: 1 chunk per wave, 3, all (4 MB)
            decode_ops.attention_wave_bytes(wave)
            a = y.clone()
            outs.append(decode_ops.attention_step(a[:, :nq], a[:, nq:nq + nk], a[:, nq + nk:], _layer(keys, values), cos, sin,
                                                  None, None, 1e-6, D ** -0.5, D))
    finally:
        decode_ops.attention_wave_bytes(default)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    steps, layer = [], _layer(keys, values)
    for t in range(T):
        b = y[t:t + 1].clone()
        steps.append(decode_ops.attention_step(b[:, :nq], b[:, nq:nq + nk], b[:, nq + nk:], layer, cos[t:t + 1], sin[t:t + 1],
                                               None, None, 1e-6, D ** -0.5, D))
    assert torch.equal(torch.cat(steps), outs[0])


@pytest.mark.parametrize("past", [600, 120])  # 5 chunks of keys; one, whose 2 tasks (one per KV head) more threads split in parts
def test_attention_bits_do_not_depend_on_the_thread_count(monkeypatch, past):
    """Threads take a chunk of keys of a KV head, or parts of its query heads where threads outnumber those tasks: 1, 2,
    3 or 5 threads give the same bits."""
    gen = torch.Generator().manual_seed(2)
    H, G, D, T = 16, 2, 128, 5
    keys, values = torch.randn(1, G, past, D, generator=gen), torch.randn(1, G, past, D, generator=gen)
    y = torch.randn(T, (H + 2 * G) * D, generator=gen)
    cos, sin = _tables(past, T, D)
    nq, nk = H * D, G * D
    outs = []
    for threads in (1, 2, 3, 5):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
        a = y.clone()
        outs.append(decode_ops.attention_step(a[:, :nq], a[:, nq:nq + nk], a[:, nq + nk:], _layer(keys, values), cos, sin,
                                              None, None, 1e-6, D ** -0.5, D))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


# (heads, KV heads, T, past, window): a decode step whose window starts inside the second chunk of keys (its tasks: one
# chunk each, folded after); a verification of 40 query rows per KV head (a task: heads over every chunk); its 20-row
# form (chunks as tasks); a window of 1 key; one ending on a chunk's edge; one wider than the keys; a pass longer than it
@pytest.mark.parametrize("H,G,T,past,window", [(8, 2, 1, 300, 64), (32, 4, 5, 700, 200), (8, 2, 5, 700, 200), (8, 2, 5, 300, 1),
                                               (8, 2, 3, 253, 128), (8, 2, 5, 20, 4096), (8, 2, 40, 250, 6)])
def test_sliding_window_attention_equals_its_twin_and_rows_stand_alone(H, G, T, past, window, monkeypatch):
    """With a sliding window the position p attends to keys (p - window, p] only (transformers' sliding_window_overlay):
    the native core gives its twin's outputs within rounding, a pass the bits of its rows computed alone, and the same
    bits whatever the threads and the waves; without the window the outputs differ (the window cuts keys)."""
    gen = torch.Generator().manual_seed(past + window)
    D = 32
    keys, values = torch.randn(1, G, past, D, generator=gen), torch.randn(1, G, past, D, generator=gen)
    y = torch.randn(T, (H + 2 * G) * D, generator=gen)
    cos, sin = _tables(past, T, D)
    nq, nk = H * D, G * D

    def step(rows, layer, c, s, w=window):
        return decode_ops.attention_step(rows[:, :nq], rows[:, nq:nq + nk], rows[:, nq + nk:], layer, c, s, None, None,
                                         1e-6, D ** -0.5, D, w)

    got = step(y.clone(), _layer(keys, values), cos, sin)
    b, twin = y.clone(), _layer(keys, values)
    want = decode_ops.attention_step_torch(b[:, :nq], b[:, nq:nq + nk], b[:, nq + nk:], twin, cos, sin, None, None, 1e-6,
                                           D ** -0.5, D, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (window >= past + T) == torch.allclose(step(y.clone(), _layer(keys, values), cos, sin, 0), got, atol=1e-5)
    layer = _layer(keys, values)
    alone = [step(y[t:t + 1].clone(), layer, cos[t:t + 1], sin[t:t + 1]) for t in range(T)]
    assert torch.equal(torch.cat(alone), got)
    default = decode_ops.attention_wave_bytes()
    try:
        for threads, wave in ((1, default), (3, 1.0), (5, default)):
            monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
            decode_ops.attention_wave_bytes(wave)
            assert torch.equal(step(y.clone(), _layer(keys, values), cos, sin), got), (threads, wave)
    finally:
        decode_ops.attention_wave_bytes(default)


@pytest.mark.parametrize("rows,n", [(1, 2048), (5, 64), (3, 19)])
@pytest.mark.parametrize("residual", [True, False])
def test_add_rms_norm_equals_its_twin(rows, n, residual):
    gen = torch.Generator().manual_seed(rows * n)
    x, r, w = torch.randn(rows, n, generator=gen), torch.randn(rows, n, generator=gen), torch.rand(n, generator=gen) + 0.5
    a, b = x.clone(), x.clone()
    got = decode_ops.add_rms_norm(a, r if residual else None, w, 1e-6)
    want = decode_ops.add_rms_norm(b, r if residual else None, w, 1e-6, native=False)
    assert torch.equal(a, b)  # the residual stream, added in place on both sides
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(a, x) if residual else torch.equal(a, x)


@pytest.mark.parametrize("T,E,H,k", [(1, 128, 2048, 8), (3, 64, 96, 6), (16, 8, 32, 2)])
@pytest.mark.parametrize("normalize", [True, False])
def test_router_topk_equals_its_twin(T, E, H, k, normalize):
    gen = torch.Generator().manual_seed(T + E)
    x, w = torch.randn(T, H, generator=gen), torch.randn(E, H, generator=gen) / H ** 0.5
    weights, experts = decode_ops.router_topk(x, w, k, normalize)
    want_w, want_e = decode_ops.router_topk_torch(x, w, k, normalize)
    assert experts.dtype == torch.int64 and experts.shape == (T, k)
    assert torch.equal(experts, want_e)  # same experts, in the same (descending) order
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-7)
    if normalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(T))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_router_topk_on_a_non_finite_row_names_real_experts_with_nan_weights(bad):
    """A NaN or infinite hidden state makes the row's probabilities NaN: the twin (torch.topk) still names k experts, with
    NaN weights, which the engine's non-finite logits check then reports. The kernel took no expert (-1) and read and wrote
    before the row (the first row: before the buffer, a heap corruption); here the second row, so that it fails cleanly."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 32, generator=gen), torch.randn(16, 32, generator=gen) / 32 ** 0.5
    x[1, 5] = bad
    weights, experts = decode_ops.router_topk(x, w, 4, True)
    want_w, want_e = decode_ops.router_topk_torch(x, w, 4, True)
    assert bool(((experts >= 0) & (experts < 16)).all()) and all(len(set(row)) == 4 for row in experts.tolist())
    assert bool(weights[1].isnan().all()) and bool(want_w[1].isnan().all())
    for t in (0, 2):  # the finite rows as before
        assert torch.equal(experts[t], want_e[t])
        torch.testing.assert_close(weights[t], want_w[t], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: widened once for T > 1 rows, as read for 1
@pytest.mark.parametrize("T,R,K", [(1, 384, 192), (5, 96, 37), (9, 4096, 64), (3, 2048, 2048)])  # 37: a tail past 16 lanes
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_its_twin_and_rows_stand_alone(T, R, K, bias, dtype):
    gen = torch.Generator().manual_seed(R + K)
    x, w = torch.randn(T, K, generator=gen), torch.randn(R, K, generator=gen).to(dtype)
    b = torch.randn(R, generator=gen) if bias else None
    y = decode_ops.linear(x, w, b)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w.float(), b), rtol=1e-5, atol=1e-5 * K ** 0.5)
    for t in range(T):  # the row computed alone: the same bits (the head of a verification pass equals its decode steps')
        assert torch.equal(decode_ops.linear(x[t:t + 1].clone(), w, b), y[t:t + 1])


def test_bad_shapes_are_refused_by_the_kernel():
    lib = decode_ops.library()
    assert lib.moe_router_topk(0, 0, 1, 4, 8, 5, 1, 0, 0, 0, 1) == 1  # k > E
    assert lib.moe_linear_f32(0, 0, 0, 1, 8, 4, 0, 7, 1) == 1  # output rows closer than R
    assert lib.moe_attention_step(0, 0, 0, 0, 0, 0, 1, 6, 4, 8, 0, 0, 1e-6, 0, 0, 0, 0, 16, 0, 0, 1.0, 0, 0, 1) == 1  # 6 % 4
    assert lib.moe_attention_step(0, 0, 0, 0, 0, 0, 2, 4, 4, 8, 0, 0, 1e-6, 0, 0, 0, 0, 16, 15, 0, 1.0, 0, 0, 1) == 1  # no room
    assert lib.moe_attention_step(0, 0, 0, 0, 0, 0, 1, 4, 4, 8, 0, 0, 1e-6, 0, 0, 0, 0, 16, 0, -1, 1.0, 0, 0, 1) == 1  # window


def test_linear_refuses_what_it_cannot_read():
    """linear() hands the kernel x [T, K], weight [R, K] and bias [R] as laid out: a narrower x or a shorter bias was read
    past its end (heap overflow under ASan), a column slice read across rows; refused before the call."""
    x, w = torch.randn(3, 24), torch.randn(8, 32)
    for args in ((x, w), (torch.randn(3, 64)[:, :32], w), (torch.randn(3, 32), torch.randn(32, 8).T),
                 (torch.randn(3, 32), w, torch.randn(4))):
        with pytest.raises(ValueError, match="native linear"):
            decode_ops.linear(*args)


def test_thread_pool_hands_every_call_over_whatever_the_thread_count():
    """The kernels' shared pool (csrc/cpu/pool.h: workers spin, then sleep): calls with 1 to 6 threads, the count
    growing (new workers start after many calls) and two Python threads calling at once, each give the bits of a
    one-thread call; a lost hand-off would hang here, a worker on another call's job would change a result."""
    import threading

    lib = decode_ops.library()
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 256, generator=gen), torch.randn(512, 256, generator=gen)  # 1.5 MB of weights: every thread used

    def run(threads: int) -> torch.Tensor:
        y = torch.empty(3, 512)
        assert lib.moe_linear_f32(x.data_ptr(), w.data_ptr(), None, 3, 512, 256, y.data_ptr(), 512, threads) == 0
        return y

    one = run(1)
    failures = []

    def caller(counts: list[int]) -> None:
        for threads in counts:
            if not torch.equal(run(threads), one):
                failures.append(threads)

    caller([2] * 50 + [1, 3, 2, 4, 6, 5, 2] * 10)
    threads = [threading.Thread(target=caller, args=([2, 3, 4, 1, 6, 5] * 60,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a call never returned: the pool lost a hand-off"
    assert not failures, f"calls with {sorted(set(failures))} threads differ from one thread's"


@pytest.mark.parametrize("K", [16, 200, 7])
def test_linear_on_bf16_weights_equals_their_fp32_widening(K):
    """A bf16 checkpoint computed in fp32 reads its weights as bf16 (half the bytes): the products are bit for bit those
    of the same values stored in fp32, the vector body and the scalar tail alike."""
    gen = torch.Generator().manual_seed(K)
    x, w = torch.randn(3, K, generator=gen), torch.randn(40, K, generator=gen).to(torch.bfloat16)
    b = torch.randn(40, generator=gen)
    assert torch.equal(decode_ops.linear(x, w, b), decode_ops.linear(x, w.float(), b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_bits_do_not_depend_on_the_thread_count(monkeypatch, dtype):
    """Threads take runs of row blocks (pool.h's Items; on AMD's CPUs 32-row tiles, elsewhere row quads): which thread
    computes a row never shows in its bits."""
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(2, 512, generator=gen), torch.randn(4104, 512, generator=gen).to(dtype)  # 4104: a short last block
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = decode_ops.linear(x, w)
    for threads in (2, 3, 5):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
        assert torch.equal(decode_ops.linear(x, w), one), threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_in_fours_equal_rows_alone(dtype):
    """The linear layer dots four weight rows at a time (one activation load for four rows) and the last R % 4 alone:
    either way a row's bits are those of the row alone, so which path a row takes never shows."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 211, generator=gen), torch.randn(11, 211, generator=gen).to(dtype)
    y = decode_ops.linear(x, w)
    for r in range(11):
        assert torch.equal(decode_ops.linear(x, w[r:r + 1].contiguous()), y[:, r:r + 1]), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,G,R,K", [(1, 16, 512, 128), (5, 3, 130, 37), (9, 2, 6, 200)])  # tails: R % 64, K % 16
@pytest.mark.parametrize("transposed", [True, False])
def test_per_head_products_equal_their_twins_on_strided_views(transposed, dtype, T, G, R, K):
    """MLA's per-head products read views: the queries' nope part of [T, H, nope + rope], W_uk and W_uv inside
    kv_b_proj's weight. Each equals its batched-matmul twin; each (t, head) row equals that row and head computed alone,
    so its bits depend on neither T nor the other heads; bf16 weights give their fp32 widening's bits."""
    gen = torch.Generator().manual_seed(T * R + K)
    x = torch.randn(T, G, K + 3, generator=gen).transpose(0, 1)[..., :K]  # [G, T, K], strides (K + 3, G·(K + 3), 1)
    if transposed:
        w = torch.randn(G, R + 2, K, generator=gen).to(dtype)[:, 1:R + 1]  # [G, R, K], head stride (R + 2)·K
        fn, twin = decode_ops.head_linear, decode_ops.head_linear_torch
    else:
        w = torch.randn(G, K + 2, R, generator=gen).to(dtype)[:, 1:K + 1]  # [G, K, R], head stride (K + 2)·R
        fn, twin = decode_ops.head_matmul, decode_ops.head_matmul_torch
    y = fn(x, w)
    assert y.shape == (T, G, R) and y.is_contiguous()
    torch.testing.assert_close(y, twin(x, w), rtol=1e-5, atol=1e-5 * K ** 0.5)
    assert torch.equal(y, fn(x, w.float()))
    for t in range(T):
        for g in range(G):
            assert torch.equal(fn(x[g:g + 1, t:t + 1], w[g:g + 1]), y[t:t + 1, g:g + 1]), (t, g)


def _latent_case(H, T, R, Dr, past, seed):
    """MLA's inputs as mla.py hands them over: q_latent [H, T, R] (a transposed view), q_pe a view inside the queries
    [H, T, nope + rope], the latent and rotary caches as row views of larger buffers."""
    gen = torch.Generator().manual_seed(seed)
    q_latent = torch.randn(T, H, R, generator=gen).transpose(0, 1)
    q_pe = torch.randn(H, T, 16 + Dr, generator=gen)[..., 16:]
    S = past + T
    latents = torch.randn(S + 3, R + 4, generator=gen)[:S, :R]
    rope_keys = torch.randn(S, Dr + 2, generator=gen)[:, 2:]
    return q_latent, q_pe, latents, rope_keys


@pytest.mark.parametrize("H,T,R,Dr,past", [(16, 1, 512, 64, 1500), (16, 5, 512, 64, 30), (3, 4, 72, 20, 515), (2, 1, 12, 6, 0)])
def test_latent_attention_equals_its_twin(H, T, R, Dr, past):
    """DeepSeek-V2's attention over its latent cache (keys [c | k_pe], values c, every head on one cache): the native
    core equals torch's matmuls and softmax, causal within the pass, on strided views; many tiles of keys, R % 32."""
    args = _latent_case(H, T, R, Dr, past, seed=H * T + past)
    got = decode_ops.latent_attention(*args, past, 0.07)
    want = decode_ops.latent_attention_torch(*args, past, 0.07)
    assert got.shape == (T, H, R) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_latent_attention_rows_do_not_depend_on_the_pass_or_the_threads(monkeypatch):
    """A 5-position verification gives the bits of its 5 decode steps, and 1, 2 or 3 threads the same bits (threads
    split the chunks of keys of the one cache, and its heads where chunks are few)."""
    H, T, R, Dr, past = 16, 5, 512, 64, 700
    q_latent, q_pe, latents, rope_keys = _latent_case(H, T, R, Dr, past, seed=3)
    whole = decode_ops.latent_attention(q_latent, q_pe, latents, rope_keys, past, 0.07)
    for t in range(T):
        step = decode_ops.latent_attention(q_latent[:, t:t + 1], q_pe[:, t:t + 1], latents[:past + t + 1],
                                           rope_keys[:past + t + 1], past + t, 0.07)
        assert torch.equal(step, whole[t:t + 1]), t
    for threads in (1, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
        assert torch.equal(decode_ops.latent_attention(q_latent, q_pe, latents, rope_keys, past, 0.07), whole), threads


def test_latent_attention_refuses_shapes_that_do_not_agree():
    q_latent, q_pe, latents, rope_keys = _latent_case(2, 3, 8, 4, 5, seed=4)
    with pytest.raises(ValueError, match="do not agree"):
        decode_ops.latent_attention(q_latent, q_pe, latents, rope_keys, 4, 0.1)  # 8 cached positions are not 4 + 3
    with pytest.raises(ValueError, match="do not agree"):
        decode_ops.latent_attention(q_latent, q_pe[:1], latents, rope_keys, 5, 0.1)


def test_per_head_products_refuse_what_they_cannot_read():
    x, w = torch.randn(2, 3, 8), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="not"):
        decode_ops.head_linear(x, w.transpose(1, 2).contiguous().transpose(1, 2))  # rows not K apart
    with pytest.raises(ValueError, match="not"):
        decode_ops.head_linear(x, torch.randn(3, 4, 8))  # 3 weight heads for 2 input heads
    with pytest.raises(ValueError, match="not"):
        decode_ops.head_matmul(x, w)  # [G, R, K] where [G, K, R] is read
    assert decode_ops.library().moe_head_f32(1, 0, 0, 0, 0, 0, 1, 2, 0, 8, 0, 1) == 1  # no rows

