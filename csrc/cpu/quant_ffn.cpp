// Fused SwiGLU expert FFN on quantized experts (int8 or int4, engine/quant/formats.py) for the CPU tier:
//   out[rows[s], :] += weights[s] · down_e(silu(gate_e x_s) ⊙ up_e x_s)      (s in group of expert e)
// as expert_ffn.cpp does for bf16/fp16/fp32, with llama.cpp's lesson: each token's activations are
// quantized to int8 per block of 32 (once per call), and every weight block is an integer dot
// product (quant_tiles.h). Phase 1 splits (expert, block of I rows), phase 2 blocks of H output
// columns, so no two threads write one element and each sums its experts in one fixed order.
// Also a plain quantized linear layer (dense layers on a CPU device). Plain C ABI for ctypes.

#include <memory>

#include "common.h"
#include "pool.h"
#include "quant_tiles.h"

#define API extern "C" __attribute__((visibility("default")))

namespace {

// The path a call on `bits`-bit weights takes; AUTO: the best this CPU has. AMX tiles serve int8 and int4 (its nibbles
// unpacked into B tiles once per row group; qmat keeps small groups on VNNI); int6, the head's alone, runs VNNI there.
Isa resolve_q(int isa, int bits) {
    if (isa == AUTO)
        isa = cpu_has(AMX_INT8)      ? AMX_INT8
              : cpu_has(AVX512_VNNI) ? AVX512_VNNI
              : cpu_has(AVX_VNNI)    ? AVX_VNNI
              : cpu_has(AVX2)        ? AVX2
                                     : SCALAR;
    return isa == AMX_INT8 && bits == 6 ? AVX512_VNNI : Isa(isa);
}

bool valid_bits(int bits) { return bits == 8 || bits == 6 || bits == 4; }  // formats.BITS

bool runnable_q(Isa isa) {
    return (isa == SCALAR || isa == AVX2 || isa == AVX_VNNI || isa == AVX512_VNNI || isa == AMX_INT8) && cpu_has(isa);
}

struct QStack {  // E experts' matrices of `rows` rows each, stacked: what the store and the slots hold
    const uint8_t* q;
    const uint16_t* s;
    const uint16_t* m;
    int64_t rows, row_bytes, nb;
    QMat expert(int64_t e) const {
        return {q + e * rows * row_bytes, s + e * rows * nb, m ? m + e * rows * nb : nullptr, row_bytes, nb};
    }
};

inline int64_t pad32(int64_t k) { return (k + 31) / 32 * 32; }

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

constexpr int64_t QRB = 32;  // weight rows per work item of the linear layer
constexpr int64_t Q1 = 64, Q2 = 128;  // rows per work item of the FFN's two phases

struct QBuf {  // quantized activations of S tokens over kp columns
    std::vector<int8_t> q;
    std::vector<float> d, ds;
    int64_t kp, nb;
    QBuf(int64_t S, int64_t kp_) : q(S * kp_), d(S * (kp_ / 32)), ds(S * (kp_ / 32)), kp(kp_), nb(kp_ / 32) {}
    QActs at(int64_t s0) const { return {q.data() + s0 * kp, d.data() + s0 * nb, ds.data() + s0 * nb, kp, nb}; }
    void fill(const float* x, int64_t ldx, int64_t K, int64_t s0, int T, Isa isa) {
        quantize_acts(x, ldx, K, T, kp, q.data() + s0 * kp, d.data() + s0 * nb, ds.data() + s0 * nb, isa);
    }
};

}  // namespace

API int moe_q_isa_supported(int isa) { return isa == AUTO || cpu_has(Isa(isa)); }

API int moe_q_resolve_isa(int isa, int bits) { return resolve_q(isa, bits); }

// x [T, k] fp32 -> q [T, kp] int8, d and ds [T, kp/32] as every kernel here quantizes its activations (kp: k padded to
// 32), whole blocks vectorised unless isa is SCALAR: formats.quantize_activations' codes and scales, bit for bit.
API int moe_quantize_acts(const float* x, int64_t n_tokens, int64_t k, int8_t* q, float* d, float* ds, int isa) {
    if (n_tokens < 0 || k <= 0) return -3;
    quantize_acts(x, k, k, int(n_tokens), pad32(k), q, d, ds, Isa(isa));
    return 0;
}

// Codes: 0 ok, -1 bad bits or dtype, -2 ISA not supported by this CPU, -3 bad shapes.
// gate_up: gu_q [E, 2I, Hp·bits/8], gu_s/gu_m [E, 2I, Hp/32]; down: dn_q [E, H, Ip·bits/8], dn_s/dn_m [E, H, Ip/32]
// (Hp, Ip: H, I padded to 32; H, I multiples of 16; m null but for int4); the rest as moe_expert_ffn: experts [G], offsets [G+1],
// x [N, H] (fp32, bf16 or fp16), rows [S] (activation s reads x[rows[s]]), and out fp32: with rows_out and row_weights
// [S], out [N, H] accumulated into, out[rows_out[s]] += w_s · y_s in order s; per activation, unweighted: with rows_out
// alone, out[rows_out[s]] = y_s (router order for the caller: no gather or scatter of its own); with neither, out [S, H].
API int moe_expert_ffn_q(int64_t n_groups, const int64_t* experts, const int64_t* offsets, const uint8_t* gu_q,
                         const uint16_t* gu_s, const uint16_t* gu_m, const uint8_t* dn_q, const uint16_t* dn_s,
                         const uint16_t* dn_m, int bits, int64_t hidden, int64_t inter, const void* x, int x_dtype,
                         const int64_t* rows, const int64_t* rows_out, const float* row_weights, float* out, int num_threads,
                         int isa_req) {
    if (!valid_bits(bits) || x_dtype < F32 || x_dtype > F16 || (bits == 4 ? !gu_m || !dn_m : gu_m || dn_m)) return -1;
    if (hidden <= 0 || inter <= 0 || n_groups < 0 || hidden % QROWS || inter % QROWS) return -3;  // whole row groups
    const Isa isa = resolve_q(isa_req, bits);
    if (!runnable_q(isa)) return -2;
    const int64_t S = n_groups ? offsets[n_groups] : 0, H = hidden, I = inter, Hp = pad32(H), Ip = pad32(I);
    if (S == 0) return 0;
    const QStack gate_up{gu_q, gu_s, gu_m, 2 * I, Hp * bits / 8, Hp / 32}, down{dn_q, dn_s, dn_m, H, Ip * bits / 8, Ip / 32};

    // Activations gathered per group and quantized: xq over Hp columns (each token once: its copies, one per expert
    // it routes to, are copied); h [S, I] fp32, then hq.
    QBuf xq(S, Hp), hq(S, Ip);
    {
        std::vector<float> row(H);
        std::vector<int64_t> first(*std::max_element(rows, rows + S) + 1, -1);  // token row -> its first activation
        for (int64_t s = 0; s < S; s++) {
            if (const int64_t f = first[rows[s]]; f >= 0) {
                std::memcpy(&xq.q[s * Hp], &xq.q[f * Hp], Hp);
                std::memcpy(&xq.d[s * xq.nb], &xq.d[f * xq.nb], xq.nb * sizeof(float));
                std::memcpy(&xq.ds[s * xq.nb], &xq.ds[f * xq.nb], xq.nb * sizeof(float));
                continue;
            }
            first[rows[s]] = s;
            const float* src;
            if (x_dtype == F32) {
                src = static_cast<const float*>(x) + rows[s] * H;
            } else {
                to_f32(x, x_dtype, rows[s] * H, H, row.data());
                src = row.data();
            }
            xq.fill(src, H, H, s, 1, isa);
        }
    }
    std::unique_ptr<float[]> h(new float[S * I]);  // every element written in phase 1
    int64_t max_t = 0;
    for (int64_t g = 0; g < n_groups; g++) max_t = std::max(max_t, offsets[g + 1] - offsets[g]);

    const int threads = threads_for(num_threads, double(n_groups) * 3 * H * I * bits / 8);
    const int64_t iblocks = (I + Q1 - 1) / Q1, hblocks = (H + Q2 - 1) / Q2;

    // Phase 1: h[s, i] = silu(gate_e x_s)_i · (up_e x_s)_i over items (group, block of I rows).
    Items items1(n_groups * iblocks, threads);
    g_pool->run(threads, [&](int) {
        std::vector<float> yg(max_t * Q1), yu(max_t * Q1);
        Items::Cursor cursor;
        for (int64_t item; (item = items1.next(cursor)) >= 0;) {
            const int64_t g = item / iblocks, i0 = (item % iblocks) * Q1, nr = std::min(Q1, I - i0);
            const int64_t s0 = offsets[g];
            const int T = int(offsets[g + 1] - s0);
            if (T == 0) continue;
            const QMat W = gate_up.expert(experts[g]);
            const QActs A = xq.at(s0);
            qmat(W, i0, nr, A, T, yg.data(), Q1, bits, isa);
            qmat(W, I + i0, nr, A, T, yu.data(), Q1, bits, isa);
            for (int t = 0; t < T; t++)
                for (int64_t r = 0; r < nr; r++) h[(s0 + t) * I + i0 + r] = silu(yg[t * Q1 + r]) * yu[t * Q1 + r];
        }
    });
    hq.fill(h.get(), I, I, 0, int(S), isa);

    // Phase 2: y[s, j] = (down_e h_s)_j over items (group, block of H rows): each activation's row of y
    // is written by one item. Weighted: then out[rows_out[s]] += w_s · y[s] for s in order, a fixed summation order.
    // Per activation y is out itself (the caller weighs and sums in router order), or each item's tile is copied to
    // the rows rows_out names while it is in L1.
    const bool weighted = rows_out && row_weights, scatter = rows_out && !row_weights;
    std::vector<float> ybuf(weighted ? S * H : 0);
    float* y = weighted ? ybuf.data() : out;
    Items items2(n_groups * hblocks, threads);
    g_pool->run(threads, [&](int) {
        std::vector<float> tile(scatter ? max_t * Q2 : 0);  // [T, Q2] one item's outputs
        Items::Cursor cursor;
        for (int64_t item; (item = items2.next(cursor)) >= 0;) {
            const int64_t g = item / hblocks, j0 = (item % hblocks) * Q2, nr = std::min(Q2, H - j0);
            const int64_t s0 = offsets[g];
            const int T = int(offsets[g + 1] - s0);
            if (T == 0) continue;
            if (!scatter) {
                qmat(down.expert(experts[g]), j0, nr, hq.at(s0), T, y + s0 * H + j0, H, bits, isa);
                continue;
            }
            qmat(down.expert(experts[g]), j0, nr, hq.at(s0), T, tile.data(), Q2, bits, isa);
            for (int t = 0; t < T; t++) std::memcpy(out + rows_out[s0 + t] * H + j0, &tile[t * Q2], nr * sizeof(float));
        }
    });
    if (!weighted) return 0;
    for (int64_t s = 0; s < S; s++) {
        float* o = out + rows_out[s] * H;
        const float w = row_weights[s];
        const float* ys = y + s * H;
        for (int64_t j = 0; j < H; j++) o[j] += w * ys[j];
    }
    return 0;
}

// A quantized linear layer: out [T, R] fp32 = Q8(x) · W^T, x [T, K] fp32; W q [R, Kp·bits/8], s/m [R, Kp/32].
API int moe_q_linear(const uint8_t* q, const uint16_t* s, const uint16_t* m, int bits, int64_t n_rows, int64_t k,
                     const float* x, int64_t n_tokens, float* out, int num_threads, int isa_req) {
    if (!valid_bits(bits) || (bits == 4) != bool(m)) return -1;  // minimums: int4's alone
    if (n_rows <= 0 || k <= 0 || n_tokens < 0 || n_rows % QROWS) return -3;
    const Isa isa = resolve_q(isa_req, bits);
    if (!runnable_q(isa)) return -2;
    if (n_tokens == 0) return 0;
    const int64_t kp = pad32(k), rb = kp * bits / 8, nb = kp / 32;
    QBuf xq(n_tokens, kp);
    xq.fill(x, k, k, 0, int(n_tokens), isa);
    const QMat W{q, s, m, rb, nb};
    const int64_t blocks = (n_rows + QRB - 1) / QRB;
    const int threads = threads_for(num_threads, double(n_rows) * k * bits / 8);
    Items items(blocks, threads);
    g_pool->run(threads, [&](int) {
        Items::Cursor cursor;
        for (int64_t item; (item = items.next(cursor)) >= 0;) {
            const int64_t r0 = item * QRB, nr = std::min(QRB, n_rows - r0);
            for (int64_t t0 = 0; t0 < n_tokens; t0 += 128)  // tokens in chunks: the AMX walk's sums stay in L1
                qmat(W, r0, nr, xq.at(t0), int(std::min<int64_t>(128, n_tokens - t0)), out + t0 * n_rows + r0, n_rows,
                     bits, isa);
        }
    });
    return 0;
}

// int4's scale d and minimum m for one block x[32] (formats._fit_int4, step for step in double): the codes of each
// candidate range (14 + 0.1 i) / (max - min), i < 21, then the d and m minimising sum w (d u + m - x)^2 for them by least
// squares, w = |x| + rms(x) (llama.cpp's make_qkx2_quants); the best candidate wins, min/max where none is valid.
#if defined(__clang__)
#define FIT_NO_CONTRACT _Pragma("clang fp contract(off)")
#define FIT_ATTR
#else  // no a*b+c fused into one rounding: the twin rounds each operation
#define FIT_NO_CONTRACT
#define FIT_ATTR __attribute__((optimize("fp-contract=off")))
#endif
static FIT_ATTR void fit_q4(const float* x, float lo, float hi, float& d_out, float& m_out) {
    FIT_NO_CONTRACT
    const double span = double(hi) - double(lo);
    double d = span / 15, m = lo, best = INFINITY, sq = 0, sw = 0, sx = 0, sxx = 0, w[32];
    for (int j = 0; j < 32; j++) sq += double(x[j]) * double(x[j]);
    const double rms = std::sqrt(sq / 32);
    for (int j = 0; j < 32; j++) {
        w[j] = std::fabs(double(x[j])) + rms;
        sw += w[j], sx += w[j] * double(x[j]), sxx += w[j] * double(x[j]) * double(x[j]);
    }
    uint8_t prev[32] = {255};  // the last candidate's codes: the same codes give the same fit, not a better one
    for (int i = 0; span > 0 && i < 21; i++) {
        const double iscale = (14.0 + 0.1 * i) / span;
        uint8_t u[32];
        int changed = 0;
        double sl = 0, sl2 = 0, sxl = 0;
        for (int j = 0; j < 32; j++) {
            // round half to even as nearbyint (v >= 0, far below 2^51), without a libm call per weight
            const double uj = std::min(15.0, ((double(x[j]) - double(lo)) * iscale + 0x1p52) - 0x1p52);
            u[j] = uint8_t(uj), changed |= u[j] != prev[j];
            sl += w[j] * uj, sl2 += w[j] * uj * uj, sxl += w[j] * double(x[j]) * uj;
        }
        if (!changed) continue;
        std::copy(u, u + 32, prev);
        const double D = sw * sl2 - sl * sl;
        const double dd = (sw * sxl - sx * sl) / D, mm = (sl2 * sx - sl * sxl) / D;
        // sum w (d u + m - x)^2 expanded: the sums above suffice (float64 keeps the cancellation far below the error)
        const double err = dd * dd * sl2 + 2 * dd * mm * sl + mm * mm * sw - 2 * dd * sxl - 2 * mm * sx + sxx;
        if (D > 0 && dd > 0 && err < best) best = err, d = dd, m = mm;
    }
    d_out = float(d), m_out = float(m);
}

// The quantizer's portable twins: lanes in vector types of one baseline register (common.h's f32x4 and these).
typedef double f64x2 __attribute__((vector_size(16)));
typedef int64_t i64x2 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

#ifdef MOE_X86
// fit_q4 for 4 blocks at once, one per lane: each lane runs fit_q4's operations in its order (no FMA in the target, so
// nothing is fused), so the same d and m. A candidate whose codes repeat the last one's is computed again rather than
// skipped: the same sums give the same err, which cannot beat the best. x: 4 blocks of 32; lo, hi: each block's range.
__attribute__((target("avx2"))) FIT_ATTR static void fit_q4_x4_avx2(const float* x, const float* lo, const float* hi,
                                                                     float* d_out, float* m_out) {
    FIT_NO_CONTRACT
    const __m256d zero = _mm256_setzero_pd(), sign = _mm256_set1_pd(-0.0);
    const __m256d vlo = _mm256_cvtps_pd(_mm_loadu_ps(lo)), span = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(hi)), vlo);
    __m256d X[32], XL[32], W[32], WX[32], sq = zero, sw = zero, sx = zero, sxx = zero;  // [32] weights of the 4 blocks
    for (int j = 0; j < 32; j++) {
        X[j] = _mm256_cvtps_pd(_mm_setr_ps(x[j], x[32 + j], x[64 + j], x[96 + j]));
        sq = _mm256_add_pd(sq, _mm256_mul_pd(X[j], X[j]));
    }
    const __m256d rms = _mm256_sqrt_pd(_mm256_div_pd(sq, _mm256_set1_pd(32)));
    for (int j = 0; j < 32; j++) {
        W[j] = _mm256_add_pd(_mm256_andnot_pd(sign, X[j]), rms), WX[j] = _mm256_mul_pd(W[j], X[j]);
        XL[j] = _mm256_sub_pd(X[j], vlo);
        sw = _mm256_add_pd(sw, W[j]), sx = _mm256_add_pd(sx, WX[j]), sxx = _mm256_add_pd(sxx, _mm256_mul_pd(WX[j], X[j]));
    }
    const __m256d valid = _mm256_cmp_pd(span, zero, _CMP_GT_OQ), two = _mm256_set1_pd(2), fifteen = _mm256_set1_pd(15);
    __m256d d = _mm256_div_pd(span, fifteen), m = vlo, best = _mm256_set1_pd(INFINITY);
    for (int i = 0; i < 21; i++) {
        const __m256d iscale = _mm256_div_pd(_mm256_set1_pd(14.0 + 0.1 * i), span);
        __m256d sl = zero, sl2 = zero, sxl = zero;
        for (int j = 0; j < 32; j++) {
            // x - lo >= 0: rounding to the nearest even integer is fit_q4's (v + 2^52) - 2^52
            const __m256d t = _mm256_round_pd(_mm256_mul_pd(XL[j], iscale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256d u = _mm256_min_pd(t, fifteen), wu = _mm256_mul_pd(W[j], u);
            sl = _mm256_add_pd(sl, wu), sl2 = _mm256_add_pd(sl2, _mm256_mul_pd(wu, u));
            sxl = _mm256_add_pd(sxl, _mm256_mul_pd(WX[j], u));
        }
        const __m256d D = _mm256_sub_pd(_mm256_mul_pd(sw, sl2), _mm256_mul_pd(sl, sl));
        const __m256d dd = _mm256_div_pd(_mm256_sub_pd(_mm256_mul_pd(sw, sxl), _mm256_mul_pd(sx, sl)), D);
        const __m256d mm = _mm256_div_pd(_mm256_sub_pd(_mm256_mul_pd(sl2, sx), _mm256_mul_pd(sl, sxl)), D);
        const __m256d dd2 = _mm256_mul_pd(two, dd), mm2 = _mm256_mul_pd(two, mm);
        __m256d err = _mm256_add_pd(_mm256_mul_pd(_mm256_mul_pd(dd, dd), sl2), _mm256_mul_pd(_mm256_mul_pd(dd2, mm), sl));
        err = _mm256_add_pd(err, _mm256_mul_pd(_mm256_mul_pd(mm, mm), sw));
        err = _mm256_sub_pd(_mm256_sub_pd(err, _mm256_mul_pd(dd2, sxl)), _mm256_mul_pd(mm2, sx));
        err = _mm256_add_pd(err, sxx);
        const __m256d ok = _mm256_and_pd(valid, _mm256_cmp_pd(D, zero, _CMP_GT_OQ));
        const __m256d lower = _mm256_and_pd(_mm256_cmp_pd(dd, zero, _CMP_GT_OQ), _mm256_cmp_pd(err, best, _CMP_LT_OQ));
        const __m256d better = _mm256_and_pd(ok, lower);
        best = _mm256_blendv_pd(best, err, better), d = _mm256_blendv_pd(d, dd, better), m = _mm256_blendv_pd(m, mm, better);
    }
    _mm_storeu_ps(d_out, _mm256_cvtpd_ps(d)), _mm_storeu_ps(m_out, _mm256_cvtpd_ps(m));
}
#endif

// fit_q4 for 2 blocks at once in portable vectors, as fit_q4_x4_avx2 for 4 (the same operations: rounding by fit_q4's
// 2^52, min and blends by comparisons, false for a NaN as there; no NaN reaches a code), so the same d and m.
static FIT_ATTR void fit_q4_x2(const float* x, const float* lo, const float* hi, float* d_out, float* m_out) {
    FIT_NO_CONTRACT
    const f64x2 vlo = {lo[0], lo[1]}, span = f64x2{hi[0], hi[1]} - vlo, zero = {}, fifteen = zero + 15.0, shift = zero + 0x1p52;
    f64x2 X[32], XL[32], W[32], WX[32], sq = zero, sw = zero, sx = zero, sxx = zero;  // [32] weights of the 2 blocks
    for (int j = 0; j < 32; j++) X[j] = f64x2{x[j], x[32 + j]}, sq += X[j] * X[j];
    const f64x2 rms = {std::sqrt(sq[0] / 32), std::sqrt(sq[1] / 32)};
    for (int j = 0; j < 32; j++) {
        W[j] = cast_bits<f64x2>(cast_bits<i64x2>(X[j]) & INT64_MAX) + rms, WX[j] = W[j] * X[j], XL[j] = X[j] - vlo;
        sw += W[j], sx += WX[j], sxx += WX[j] * X[j];
    }
    const i64x2 valid = span > zero;
    f64x2 d = span / fifteen, m = vlo, best = zero + double(INFINITY);
    for (int i = 0; i < 21; i++) {
        const f64x2 iscale = (zero + (14.0 + 0.1 * i)) / span;
        f64x2 sl = zero, sl2 = zero, sxl = zero;
        for (int j = 0; j < 32; j++) {
            const f64x2 t = (XL[j] * iscale + shift) - shift, u = t < fifteen ? t : fifteen, wu = W[j] * u;
            sl += wu, sl2 += wu * u, sxl += WX[j] * u;
        }
        const f64x2 D = sw * sl2 - sl * sl, dd = (sw * sxl - sx * sl) / D, mm = (sl2 * sx - sl * sxl) / D;
        const f64x2 err = dd * dd * sl2 + 2.0 * dd * mm * sl + mm * mm * sw - 2.0 * dd * sxl - 2.0 * mm * sx + sxx;
        const i64x2 better = valid & (D > zero) & (dd > zero) & (err < best);
        best = better ? err : best, d = better ? dd : d, m = better ? mm : m;
    }
    for (int l = 0; l < 2; l++) d_out[l] = float(d[l]), m_out[l] = float(m[l]);
}

// fit_q4 for 4 blocks x[4][32] with ranges lo, hi [4]: in AVX2 where the CPU has it, else as two pairs
static void fit_q4_x4(const float* x, const float* lo, const float* hi, float* d_out, float* m_out, bool avx2) {
#ifdef MOE_X86
    if (avx2) return fit_q4_x4_avx2(x, lo, hi, d_out, m_out);
#endif
    fit_q4_x2(x, lo, hi, d_out, m_out), fit_q4_x2(x + 64, lo + 2, hi + 2, d_out + 2, m_out + 2);
}

#ifdef MOE_X86
// block_range in AVX2 (of -0 and +0 either may come out: plus_zero stores both as +0)
__attribute__((target("avx2"))) static void block_range_avx2(const float* blk, float& l, float& h, float& amax) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 lo = _mm256_loadu_ps(blk), hi = lo, am = _mm256_andnot_ps(sign, lo);
    for (int i = 1; i < 4; i++) {
        const __m256 v = _mm256_loadu_ps(blk + 8 * i);
        lo = _mm256_min_ps(lo, v), hi = _mm256_max_ps(hi, v), am = _mm256_max_ps(am, _mm256_andnot_ps(sign, v));
    }
    alignas(32) float a[3][8];
    _mm256_store_ps(a[0], lo), _mm256_store_ps(a[1], hi), _mm256_store_ps(a[2], am);
    l = a[0][0], h = a[1][0], amax = a[2][0];
    for (int i = 1; i < 8; i++) l = std::min(l, a[0][i]), h = std::max(h, a[1][i]), amax = std::max(amax, a[2][i]);
}
#endif

// A block's minimum, maximum and largest magnitude (no NaN: rows holding one are zeros by now), as block_range_avx2.
static void block_range(const float* blk, bool avx2, float& l, float& h, float& amax) {
#ifdef MOE_X86
    if (avx2) return block_range_avx2(blk, l, h, amax);
#endif
    f32x4 lo = load4(blk), hi = lo, am = cast_bits<f32x4>(cast_bits<i32x4>(lo) & INT32_MAX);
    for (int i = 4; i < 32; i += 4) {
        const f32x4 v = load4(blk + i), a = cast_bits<f32x4>(cast_bits<i32x4>(v) & INT32_MAX);
        lo = v < lo ? v : lo, hi = v > hi ? v : hi, am = a > am ? a : am;
    }
    l = std::min(std::min(lo[0], lo[1]), std::min(lo[2], lo[3])), h = std::max(std::max(hi[0], hi[1]), std::max(hi[2], hi[3]));
    amax = std::max(std::max(am[0], am[1]), std::max(am[2], am[3]));
}

// One row's block scales: int8 amax/127, int6 amax/31; int4 fit_q4's d and m where `fit` (4 blocks at a time), else the
// block's range. x: the row, zero-padded to nb blocks; d, m: [nb] fp32 before the fp16 rounding.
static void row_scales(const float* x, int64_t nb, int bits, bool fit, bool avx2, float* d, float* m) {
    float lo[4], hi[4];
    for (int64_t b = 0; b < nb; b++) {
        const float* blk = x + 32 * b;
        float l, h, amax;
        block_range(blk, avx2, l, h, amax);
        if (bits != 4) {
            d[b] = amax / (bits == 8 ? 127.f : 31.f);
        } else if (!fit) {
            d[b] = (h - l) / 15.f, m[b] = l;  // round-to-nearest on the block's range
        } else if (b / 4 < nb / 4) {  // a whole group of 4 blocks: fitted when its last block's range is in
            lo[b % 4] = l, hi[b % 4] = h;
            if (b % 4 == 3) fit_q4_x4(blk - 96, lo, hi, d + b - 3, m + b - 3, avx2);
        } else {
            fit_q4(blk, l, h, d[b], m[b]);
        }
    }
}

#ifdef MOE_X86
// block_codes in AVX2: vcvtps2dq rounds half to even under the default rounding mode, as nearbyint does.
__attribute__((target("avx2"))) static void block_codes_avx2(const float* blk, float mf, float inv, int bits, uint8_t* u) {
    const int top = bits == 8 ? 127 : bits == 6 ? 31 : 15;
    const __m256 lo = _mm256_set1_ps(float(bits == 4 ? 0 : -top)), hi = _mm256_set1_ps(float(top));
    const __m256i bias = _mm256_set1_epi32(bits == 4 ? 0 : top + 1);
    alignas(32) int32_t c[32];
    for (int i = 0; i < 4; i++) {
        const __m256 x = _mm256_loadu_ps(blk + 8 * i);
        const __m256 v = _mm256_mul_ps(bits != 4 ? x : _mm256_sub_ps(x, _mm256_set1_ps(mf)), _mm256_set1_ps(inv));
        const __m256i q = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));  // clamped first: see block_codes
        _mm256_store_si256(reinterpret_cast<__m256i*>(c + 8 * i), _mm256_add_epi32(q, bias));
    }
    for (int j = 0; j < 32; j++) u[j] = uint8_t(c[j]);
}
#endif

// One block's codes u[32] for its scale: int8 round(x·inv) in [-127, 127] + 128, int6 in [-31, 31] + 32, int4
// round((x - mf)·inv) in [0, 15]. Clamped before rounding (the same codes), so that a value beyond int32 (an int4
// minimum beyond fp16's range is -inf) clamps as in formats.quantize rather than converting to INT_MIN; a NaN (inf·0)
// gives the lowest code. Portable: rounded half to even by adding and subtracting 1.5·2^23, exact below 2^22.
static void block_codes(const float* blk, float mf, float inv, int bits, bool avx2, uint8_t* u) {
#ifdef MOE_X86
    if (avx2) return block_codes_avx2(blk, mf, inv, bits, u);
#endif
    const f32x4 zero = {}, top = zero + float(bits == 8 ? 127 : bits == 6 ? 31 : 15), shift = zero + 0x1.8p23f;
    const f32x4 lo = bits == 4 ? zero : -top, bias = bits == 4 ? zero : top + 1;
    for (int i = 0; i < 32; i += 4) {
        f32x4 x = (bits == 4 ? load4(blk + i) - mf : load4(blk + i)) * inv;
        x = x > lo ? x : lo, x = x < top ? x : top;
        const i32x4 c = __builtin_convertvector((x + shift) - shift + bias, i32x4);
        for (int j = 0; j < 4; j++) u[i + j] = uint8_t(c[j]);
    }
}

// Row `off / k` of W in fp32, zero-padded to kp
static void load_row(const void* w, int dtype, int64_t off, int64_t k, int64_t kp, float* row) {
    to_f32(w, dtype, off, k, row);
    std::fill(row + k, row + kp, 0.f);
}

// Whether x[0..n) holds a NaN or an infinity (exponent bits all set): max and min drop a NaN, so a block's scale
// would be finite and its codes made up. Read on the bits: vectorizes, and no compiler flag may assume it away.
static bool any_nonfinite(const float* x, int64_t n) {
    uint32_t all = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b;
        std::memcpy(&b, x + i, 4);
        all |= uint32_t((b & 0x7f800000u) == 0x7f800000u);
    }
    return all != 0;
}

// An fp16 scale or minimum as stored: -0 as +0 (which zero min/max found, or a tiny fit rounded from, is noise)
static uint16_t plus_zero(uint16_t h) { return h == 0x8000 ? 0 : h; }

// Quantize W [rows, k] (fp32, bf16 or fp16; rows a multiple of 16) into the interleaved layout:
// q [rows, kp·bits/8], s and m [rows, kp/32] (m null but for int4); int4 with fit_q4's d and m where `fit`, else the
// block's range. Bit-identical to formats.quantize. -4: W holds a NaN or an infinity (formats.quantize raises too).
API int moe_quantize(const void* w, int w_dtype, int64_t n_rows, int64_t k, int bits, uint8_t* q, uint16_t* s,
                     uint16_t* m, int num_threads, int fit) {
    if (!valid_bits(bits) || (bits == 4) != bool(m) || w_dtype < F32 || w_dtype > F16) return -1;
    if (n_rows <= 0 || k <= 0 || n_rows % QROWS) return -3;
    const int64_t kp = pad32(k), nb = kp / 32, rb = kp * bits / 8, groups = n_rows / QROWS;
    const bool avx2 = cpu_has(AVX2);
    std::atomic<int64_t> next{0};
    std::atomic<bool> nonfinite{false};
    g_pool->run(std::max(1, num_threads), [&](int) {
        std::vector<float> row(kp), d_row(nb), m_row(nb);
        for (int64_t g; (g = next.fetch_add(1)) < groups;) {
            uint8_t* qg = q + g * QROWS * rb;
            for (int rr = 0; rr < QROWS; rr++) {
                const int64_t r = g * QROWS + rr;
                load_row(w, w_dtype, r * k, k, kp, row.data());
                if (any_nonfinite(row.data(), k)) {  // refused (-4); zeros meanwhile: a NaN cast to int is undefined
                    nonfinite.store(true, std::memory_order_relaxed);
                    std::fill(row.begin(), row.end(), 0.f);
                }
                row_scales(row.data(), nb, bits, fit, avx2, d_row.data(), m_row.data());
                for (int64_t b = 0; b < nb; b++) {
                    const float* blk = row.data() + 32 * b;
                    const uint16_t d16 = plus_zero(f32_to_f16(d_row[b]));
                    const float d = f16_to_f32(d16), inv = d > 0.f ? 1.f / d : 0.f;
                    s[g * QROWS * nb + b * QROWS + rr] = d16;
                    float mf = 0.f;
                    if (bits == 4) {
                        const uint16_t m16 = plus_zero(f32_to_f16(m_row[b]));
                        m[g * QROWS * nb + b * QROWS + rr] = m16;
                        mf = f16_to_f32(m16);
                    }
                    uint8_t u[32];
                    block_codes(blk, mf, inv, bits, avx2, u);
                    // formats.interleave: int8 columns 4i..4i+3 in vector i; int4 columns 8v..8v+3 (low nibbles) and
                    // 8v+4..8v+7 (high) in vector v; int6 those nibbles, then step i's bits 4-5 in vector 4 + i/4 at
                    // bits 2(i%4); each vector holds 4 bytes per row
                    uint8_t* qb = qg + b * bits * 64 + rr * 4;
                    if (bits == 8) {
                        for (int i = 0; i < 8; i++) std::memcpy(qb + i * 64, u + 4 * i, 4);
                    } else {
                        for (int v = 0; v < 4; v++)
                            for (int c = 0; c < 4; c++) qb[v * 64 + c] = uint8_t((u[8 * v + c] & 0xF) | (u[8 * v + 4 + c] << 4));
                    }
                    if (bits == 6) {
                        for (int h = 0; h < 2; h++)
                            for (int c = 0; c < 4; c++) {
                                uint8_t top = 0;
                                for (int k = 0; k < 4; k++) top |= uint8_t((u[4 * (4 * h + k) + c] >> 4) << (2 * k));
                                qb[256 + h * 64 + c] = top;
                            }
                    }
                }
            }
        }
    });
    return nonfinite.load() ? -4 : 0;
}
