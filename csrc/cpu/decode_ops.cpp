// Decode-step pieces of a llama-like decoder layer on the CPU, for a few positions after a past
// (engine/model/decode_ops.py: their PyTorch twins and the dispatch): the residual add fused with the
// next RMSNorm, the MoE router's softmax top-k, attention's core (Qwen3's q/k norm, rotary, the KV cache append, causal
// softmax attention with grouped KV heads, within the layer's sliding window where it has one) and the per-head products
// of DeepSeek's absorbed latent attention. Each query row is computed alone, in one fixed order, so a position's bits do
// not depend on the call's other positions: a verification pass and the decode steps it stands for agree bit for bit.
// fp32 throughout. Plain C ABI for ctypes.

#include "common.h"
#include "pool.h"
#include "x86_tiles.h"

#define API extern "C" __attribute__((visibility("default")))

namespace {

// Bytes of attention's chunk partials held at once before they are folded (decode_body.h); a wave's size never changes
// the bits, and tests shrink it to show that (moe_attention_wave_bytes)
std::atomic<double> g_wave_bytes{4 << 20};

struct AttentionStep {
    float *q, *k;           // [T, *] rows q_stride / k_stride floats apart: H_q (H_kv) heads of D, normed and rotated in place
    const float* v;         // [T, *] rows v_stride apart: H_kv heads of D
    int64_t q_stride, k_stride, v_stride, T, Hq, Hkv, D;
    const float *q_norm, *k_norm;  // [D] per-head norm weights, or null
    float eps;
    const float *cos, *sin;        // [T, D]: the rotary tables at positions past..past+T-1
    float *k_cache, *v_cache;      // [H_kv, capacity, D]; entries past..past+T-1 are written
    int64_t capacity, past;
    float scale;
    float* out;                    // [T, *] rows out_stride apart: H_q heads of D
    int64_t out_stride;
    int64_t window;                // > 0: position p attends to keys (p - window, p] only (a sliding window); 0: all
};

// query rows (t, h) at q + t·q_t + h·q_h (q2: a second part of each, or null); outputs at out + t·out_t + h·out_h
struct HeadRows {
    const float *q, *q2;
    float* out;
    int64_t q_t, q_h, q2_t, q2_h, out_t, out_h, T, Hq, Hkv, past;
    float scale;
    int64_t window;  // > 0: row (t, h) attends to the last `window` keys up to past + t only; 0: all of them
};

// one KV head's cache: key s = K[s·k_stride..] (D) and K2[s·k2_stride..] (D2; K2 may be null), value V[s·v_stride..] (Dv)
struct KeyRows {
    const float *K, *K2, *V;
    int64_t k_stride, k2_stride, v_stride, D, D2, Dv;
};

// Rows per block of attention's weighted sums where a position has that many heads (8 accumulators: 4 rows × 16 columns
// or 2 × 32; same bits either way): 4 × 16 measured 1.5-1.8× faster on an AVX2 Zen 3, 2 × 32 10-15 % faster in the
// AVX-512 build on a Zen 4
namespace portable {
constexpr int SUM_ROWS = 2;
#include "decode_body.h"
}  // namespace portable

#ifdef MOE_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
#define MOE_BODY_AVX2 1
namespace avx2 {
constexpr int SUM_ROWS = 4;
#include "decode_body.h"
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
// the same 8-lane code with AVX-512VL's 32 vector registers: the blocks spill nothing (attention 20-30 % faster)
#pragma clang attribute push(__attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512dq"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512vl,avx512bw,avx512dq")
#endif
namespace avx512 {
constexpr int SUM_ROWS = 2;
#define MOE_BODY_AVX512 1
#include "decode_body.h"
#undef MOE_BODY_AVX512
}  // namespace avx512
#undef MOE_BODY_AVX2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

enum DecodeIsa { DECODE_PORTABLE = 0, DECODE_AVX2 = 1, DECODE_AVX512 = 2 };
std::atomic<int> g_decode_cap{DECODE_AVX512};  // the widest path calls may take (tests lower it: moe_decode_isa)

int decode_isa() {
#ifdef MOE_X86
    static const int best = cpu_has(AVX512) ? DECODE_AVX512 : cpu_has(AVX2) ? DECODE_AVX2 : DECODE_PORTABLE;
    return std::min(best, g_decode_cap.load(std::memory_order_relaxed));
#else
    return DECODE_PORTABLE;
#endif
}

// fn(args) in the body built for the path this CPU takes (each body is the same source: decode_body.h)
#ifdef MOE_X86
#define ISA_CALL(fn, ...)                                                                                 \
    (decode_isa() == DECODE_AVX512 ? avx512::fn(__VA_ARGS__)                                            \
                                   : decode_isa() == DECODE_AVX2 ? avx2::fn(__VA_ARGS__) : portable::fn(__VA_ARGS__))
#else
#define ISA_CALL(fn, ...) portable::fn(__VA_ARGS__)
#endif

}  // namespace

API int moe_add_rms_norm(float* x, const float* r, const float* w, float eps, int64_t rows, int64_t n, float* y) {
    if (rows < 0 || n <= 0) return 1;
    return ISA_CALL(add_rms_norm, x, r, w, eps, rows, n, y), 0;
}

API int moe_attention_step(float* q, int64_t q_stride, float* k, int64_t k_stride, const float* v, int64_t v_stride,
                           int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float* q_norm, const float* k_norm,
                           float eps, const float* cos, const float* sin, float* k_cache, float* v_cache,
                           int64_t capacity, int64_t past, int64_t window, float scale, float* out, int64_t out_stride,
                           int threads) {
    if (T <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || D % 2 || past < 0 || past + T > capacity || window < 0) return 1;
    const AttentionStep a{q, k, v, q_stride, k_stride, v_stride, T, Hq, Hkv, D, q_norm, k_norm, eps, cos, sin,
                          k_cache, v_cache, capacity, past, scale, out, out_stride, window};
    return ISA_CALL(attention_step, a, std::max(1, threads)), 0;
}

// DeepSeek-V2's absorbed attention over the latent cache (engine/model/mla.py): rows (t, h) of q_latent [R] and q_pe [Dr]
// at their strides, latents [S, R] and rope_keys [S, Dr] (rows at their strides, S = past + T), out [T, H, R] contiguous
API int moe_latent_attention(const float* q, int64_t q_t, int64_t q_h, const float* q_pe, int64_t pe_t, int64_t pe_h,
                             const float* latents, int64_t latent_stride, const float* rope_keys, int64_t rope_stride,
                             int64_t T, int64_t H, int64_t R, int64_t Dr, int64_t past, float scale, float* out, int threads) {
    if (T <= 0 || H <= 0 || R <= 0 || Dr <= 0 || past < 0 || latent_stride < R || rope_stride < Dr) return 1;
    const HeadRows rows{q, q_pe, out, q_t, q_h, pe_t, pe_h, H * R, R, T, H, 1, past, scale, 0};
    return ISA_CALL(latent_attention, rows, latents, latent_stride, rope_keys, rope_stride, R, Dr, std::max(1, threads)), 0;
}

API int moe_router_topk(const float* x, const float* w, int64_t T, int64_t E, int64_t H, int64_t k, int normalize,
                        float* logits, float* weights, int64_t* experts, int threads) {
    if (T <= 0 || E <= 0 || H <= 0 || k <= 0 || k > E) return 1;
    return ISA_CALL(router_topk, x, w, T, E, H, k, normalize, logits, weights, experts, std::max(1, threads)), 0;
}

namespace {
// the linear layer's checks and dispatch, for fp32 or bf16 weights
template <typename W>
int linear_any(const float* x, const W* w, const float* b, int64_t T, int64_t R, int64_t K, float* y, int64_t y_stride,
               int threads) {
    if (T < 0 || R <= 0 || K <= 0 || y_stride < R) return 1;
    return ISA_CALL(linear, x, w, b, T, R, K, y, y_stride, std::max(1, threads)), 0;
}
}  // namespace

API int moe_linear_f32(const float* x, const float* w, const float* b, int64_t T, int64_t R, int64_t K, float* y,
                       int64_t y_stride, int threads) {
    return linear_any(x, w, b, T, R, K, y, y_stride, threads);
}

// moe_linear_f32 with bf16 weights w [R, K] (a bf16 checkpoint computed in fp32): the same bits as its fp32 widening
API int moe_linear_bf16w(const float* x, const uint16_t* w, const float* b, int64_t T, int64_t R, int64_t K, float* y,
                         int64_t y_stride, int threads) {
    return linear_any(x, w, b, T, R, K, y, y_stride, threads);
}

namespace {
// per-head products (decode_body.h): transposed, x · Wᵀ (head_linear), or not, x · W (head_matmul)
template <typename W>
int head_any(int transposed, const float* x, int64_t x_g, int64_t x_t, const W* w, int64_t w_g, int64_t T, int64_t G,
             int64_t R, int64_t K, float* y, int threads) {
    if (T <= 0 || G <= 0 || R <= 0 || K <= 0) return 1;
    threads = std::max(1, threads);
    return (transposed ? ISA_CALL(head_linear, x, x_g, x_t, w, w_g, T, G, R, K, y, threads)
                       : ISA_CALL(head_matmul, x, x_g, x_t, w, w_g, T, G, R, K, y, threads)), 0;
}
}  // namespace

API int moe_head_f32(int transposed, const float* x, int64_t x_g, int64_t x_t, const float* w, int64_t w_g, int64_t T,
                     int64_t G, int64_t R, int64_t K, float* y, int threads) {
    return head_any(transposed, x, x_g, x_t, w, w_g, T, G, R, K, y, threads);
}

API int moe_head_bf16w(int transposed, const float* x, int64_t x_g, int64_t x_t, const uint16_t* w, int64_t w_g,
                       int64_t T, int64_t G, int64_t R, int64_t K, float* y, int threads) {
    return head_any(transposed, x, x_g, x_t, w, w_g, T, G, R, K, y, threads);
}


// Bytes of chunk partials attention holds at once (> 0: set it, for tests); returns the value calls take now
API double moe_attention_wave_bytes(double bytes) {
    if (bytes > 0) g_wave_bytes = bytes;
    return g_wave_bytes.load();
}

// The widest path the decode ops may take, 0 portable, 1 AVX2, 2 AVX-512 (tests run each the CPU has); -1 asks without
// setting -> the path calls take now
API int moe_decode_isa(int cap) {
    if (cap >= DECODE_PORTABLE && cap <= DECODE_AVX512) g_decode_cap = cap;
    return decode_isa();
}
