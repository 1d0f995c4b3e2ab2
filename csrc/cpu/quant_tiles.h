// Quantized weights x quantized activations (engine/quant/formats.py has the layout and the twin):
//   Y[t, r] = sum_b d[r,b]·dx[t,b]·(sum_j u[r,32b+j]·qx[t,32b+j]) + m[r,b]·ds[t,b]     (ds = dx·sum_j qx)
// with int8 m = -128·d, int6 m = -32·d. Weights: u8 codes interleaved by groups of 16 rows, so one 64-byte vector holds
// 4 columns of 16 rows (int4: 8 columns, in low and high nibbles; int6: int4's nibbles, then 2 vectors of their 2 high
// bits, 4 steps of 4 columns per vector) and one 16-wide fp16 load holds a
// block's scales for the group; activations: s8 codes and fp32 scales per token and block (Q8_1),
// broadcast 4 bytes at a time. No horizontal sums: a vector of 16 int32 is 16 rows' dot products.
// Paths: AMX-INT8 (tdpbsud; int8 at 11+ tokens, int4 at 28+), AVX-512 VNNI (vpdpbusd), AVX-VNNI (vpdpbusd on ymm), AVX2 (pmaddubsw +
// pmaddwd) and portable C++ (4-lane vectors: SSE2, NEON). Each sums a
// (row, token) in one fixed order whatever the call's other rows and tokens, so a token's result
// never depends on its batch.
#pragma once

#include "common.h"

#include <array>
#include <utility>

namespace {

constexpr int QROWS = 16;  // rows per interleaved group

struct QMat {  // one expert's matrix: group g (rows 16g..16g+15) at q + 16g·row_bytes, its scales at s + 16g·nb
    const uint8_t* q;
    const uint16_t* s;
    const uint16_t* m;  // int4 minimums; null for int8 and int6
    int64_t row_bytes, nb;
};

struct QActs {  // T tokens' activations, quantized: row t at q + t·kp, scales at d/ds + t·nb
    const int8_t* q;
    const float* d;  // [T, nb] dx
    const float* ds;  // [T, nb] dx·sum(qx)
    int64_t kp, nb;
};

inline float h2f(uint16_t v) { return f16_to_f32(v); }

template <int BITS>
constexpr float zero_code() { return BITS == 8 ? 128.f : 32.f; }  // a symmetric format's code of 0: m = -zero_code·d

// ---- portable: the same sums in 4-lane float vectors (SSE2, NEON: common.h). Every product u·qx and every partial sum
// of a block is an integer below 2^24 (32·255·127), so float arithmetic gives the integer dot product exactly, in any
// order, fused or not; the block's scaling then runs as the integer paths' scalar form did, one row per lane.

// Group block b's codes as floats: c[i][4·rr + j] = row rr's code of column 4i + j (i: the step of 4 columns)
template <int BITS>
inline void block_codes_f32(const uint8_t* qb, float (*c)[64]) {
    for (int i = 0; i < 8; i++) {
        const uint8_t* v = qb + 64 * (BITS == 8 ? i : i / 2);  // int4/int6: steps 2v, 2v+1 in vector v's nibbles
        const uint8_t* top = qb + 256 + 64 * (i / 4);  // int6: step i's bits 4-5 at bits 2(i % 4)
        for (int j = 0; j < 64; j++) {
            int u = BITS == 8 ? v[j] : i % 2 ? v[j] >> 4 : v[j] & 0xF;
            if (BITS == 6) u |= ((top[j] >> (2 * (i % 4))) & 3) << 4;
            c[i][j] = float(u);
        }
    }
}

// Y[t, 0..15] for group g's 16 rows and T tokens: each block's codes widened once for all T tokens, each token alone
template <int BITS>
void qgroup_portable(const QMat& W, int64_t g, const QActs& A, int T, float* Y, int64_t ldy) {
    const uint8_t* q = W.q + g * QROWS * W.row_bytes;
    const uint16_t* s = W.s + g * QROWS * W.nb;
    const uint16_t* m = W.m ? W.m + g * QROWS * W.nb : nullptr;
    alignas(16) float c[8][64];
    for (int t = 0; t < T; t++) std::fill(Y + t * ldy, Y + t * ldy + QROWS, 0.f);
    for (int64_t b = 0; b < W.nb; b++) {
        block_codes_f32<BITS>(q + b * BITS * 64, c);
        for (int t = 0; t < T; t++) {
            const int8_t* xb = A.q + t * A.kp + 32 * b;
            f32x4 x[8];
            for (int i = 0; i < 8; i++)
                x[i] = f32x4{float(xb[4 * i]), float(xb[4 * i + 1]), float(xb[4 * i + 2]), float(xb[4 * i + 3])};
            alignas(16) float dot[QROWS];
            for (int rr = 0; rr < QROWS; rr++) {
                f32x4 lane = load4(&c[0][4 * rr]) * x[0];
                for (int i = 1; i < 8; i++) lane += load4(&c[i][4 * rr]) * x[i];
                dot[rr] = (lane[0] + lane[2]) + (lane[1] + lane[3]);
            }
            const float dx = A.d[t * A.nb + b], ds = A.ds[t * A.nb + b];
            for (int v = 0; v < QROWS / 4; v++) {
                const f32x4 d = weights4<F16>(s, b * QROWS + 4 * v);
                const f32x4 mn = m ? weights4<F16>(m, b * QROWS + 4 * v) : -zero_code<BITS>() * d;
                float* y = Y + t * ldy + 4 * v;
                const f32x4 acc = load4(y) + (load4(dot + 4 * v) * (d * dx) + mn * ds);
                std::memcpy(y, &acc, sizeof acc);
            }
        }
    }
}

template <int BITS>
void qmat_scalar(const QMat& W, int64_t r0, int64_t nr, const QActs& A, int T, float* Y, int64_t ldy) {
    for (int64_t r = r0; r < r0 + nr; r += QROWS) qgroup_portable<BITS>(W, r / QROWS, A, T, Y + (r - r0), ldy);
}

#ifdef MOE_X86
// One whole block of 32 as the loop below quantizes it (max is order-free, vcvtps2dq rounds half to even as
// nearbyint does under the default rounding mode, the sum is exact): the same bytes and scales; a NaN makes dx NaN.
__attribute__((target("avx2"))) inline void quantize_block_avx2(const float* xr, int8_t* q, float* d, float* ds) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 x[4], top = _mm256_setzero_ps(), nan = _mm256_setzero_ps();  // maxps drops a NaN: found apart
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(xr + 8 * i), top = _mm256_max_ps(top, _mm256_and_ps(x[i], abs_mask));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x[i], x[i], _CMP_UNORD_Q));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm256_movemask_ps(nan) ? NAN : _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float db = amax / 127.f, inv = db > 0.f ? 1.f / db : 0.f;
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i c[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        c[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(x[i], _mm256_set1_ps(inv))), lo), hi);
        sum = _mm256_add_epi32(sum, c[i]);
    }
    // packs work per 128-bit lane: 4-byte runs come out as columns 0 8 16 24 | 4 12 20 28 (+0..3); put them in order
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *d = db;
    *ds = db * float(_mm_cvtsi128_si32(s4));
}
#endif

// Quantize T rows of fp32 activations x [T, K] (row stride ldx) into q [T, kp], d, ds; whole blocks in AVX2 unless `isa`
// is SCALAR. Bit-identical to formats.quantize_activations: dx = amax/127, q = round-half-even(x·(1/dx)); a block holding a
// NaN gets dx NaN, as the twin's amax does, so that its products are NaN (std::max and maxps would drop it: finite garbage).
void quantize_acts(const float* x, int64_t ldx, int64_t K, int T, int64_t kp, int8_t* q, float* d, float* ds, Isa isa) {
    const int64_t nb = kp / 32;
#ifdef MOE_X86
    const bool vector = isa != SCALAR && cpu_has(AVX2);  // the serial part of a call: 8 experts' activations of each token
#else
    constexpr bool vector = false;
    (void)isa;
#endif
    for (int t = 0; t < T; t++) {
        const float* xr = x + t * ldx;
        for (int64_t b = 0; b < nb; b++) {
#ifdef MOE_X86
            if (vector && 32 * b + 32 <= K) {
                quantize_block_avx2(xr + 32 * b, q + t * kp + 32 * b, d + t * nb + b, ds + t * nb + b);
                continue;
            }
#endif
            float amax = 0.f;
            for (int64_t k = 32 * b; k < std::min(K, 32 * b + 32); k++) {
                const float a = std::fabs(xr[k]);
                amax = a > amax || a != a ? a : amax;  // a NaN stays
            }
            const float db = amax / 127.f, inv = db > 0.f ? 1.f / db : 0.f;
            int32_t sum = 0;
            for (int64_t k = 32 * b; k < 32 * b + 32; k++) {  // clamped before the cast: a NaN (NaN or inf · 0) casts to 127
                const int qi = int(std::nearbyint(std::max(-127.f, std::min(127.f, k < K ? xr[k] * inv : 0.f))));
                q[t * kp + k] = int8_t(qi);
                sum += qi;
            }
            d[t * nb + b] = db;
            ds[t * nb + b] = db * float(sum);
        }
    }
}

inline int32_t x4(const int8_t* p) {  // 4 activation codes as one int32, for a broadcast
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

#ifdef MOE_X86
// ---- AVX-512 VNNI: one group of 16 rows x TC tokens; per block 8 (int4: 4 loads, int6: 6 loads, 8) vpdpbusd per token
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

// int6: step i's 2 high bits in place (bits 4-5 of each byte, the rest zero), from h, the vector of steps 4(i/4)..+3, with
// k = i % 4. A 16-bit shift carries bits across bytes only outside the 0x30 mask.
VNNI_TARGET inline __m512i top_bits512(__m512i h, int k) {
    const __m512i mask = _mm512_set1_epi8(0x30);
    switch (k) {
        case 0: return _mm512_and_si512(_mm512_slli_epi16(h, 4), mask);
        case 1: return _mm512_and_si512(_mm512_slli_epi16(h, 2), mask);
        case 2: return _mm512_and_si512(h, mask);
        default: return _mm512_and_si512(_mm512_srli_epi16(h, 2), mask);
    }
}

template <int BITS, int TC>
VNNI_TARGET void qgroup_vnni(const QMat& W, int64_t g, const QActs& A, int t0, float* Y, int64_t ldy) {
    const uint8_t* q = W.q + g * QROWS * W.row_bytes;
    const uint16_t* s = W.s + g * QROWS * W.nb;
    const uint16_t* m = W.m ? W.m + g * QROWS * W.nb : nullptr;
    const __m512i low = _mm512_set1_epi8(0x0F);
    constexpr int CH = TC < 4 ? 2 : 1;  // integer chains per token: two when few tokens hide vpdpbusd's latency; more spill
    __m512 acc[TC];
    for (int t = 0; t < TC; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < W.nb; b++) {
        __m512i dot[TC][CH];
        for (int t = 0; t < TC; t++)
            for (int c = 0; c < CH; c++) dot[t][c] = _mm512_setzero_si512();
        const int8_t* xb = A.q + t0 * A.kp + 32 * b;
        for (int line = 0; line < BITS; line++)  // the next group's block (its 4, 6 or 8 cache lines), one group ahead
            _mm_prefetch(reinterpret_cast<const char*>(q + QROWS * W.row_bytes + b * BITS * 64 + 64 * line), _MM_HINT_T1);
        if (BITS == 8) {
            const uint8_t* qb = q + b * 512;
            for (int i = 0; i < 8; i++) {
                const __m512i w = _mm512_loadu_si512(qb + 64 * i);
                for (int t = 0; t < TC; t++)
                    dot[t][i % CH] = _mm512_dpbusd_epi32(dot[t][i % CH], w, _mm512_set1_epi32(x4(xb + t * A.kp + 4 * i)));
            }
        } else {
            const uint8_t* qb = q + b * BITS * 64;
            __m512i u[8];  // the block unpacked once for all TC tokens: u[2v] columns 8v..8v+3, u[2v+1] 8v+4..8v+7
            for (int v = 0; v < 4; v++) {
                const __m512i w = _mm512_loadu_si512(qb + 64 * v);
                u[2 * v] = _mm512_and_si512(w, low), u[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
            }
            if (BITS == 6) {
                const __m512i h[2] = {_mm512_loadu_si512(qb + 256), _mm512_loadu_si512(qb + 320)};
                for (int i = 0; i < 8; i++) u[i] = _mm512_or_si512(u[i], top_bits512(h[i / 4], i % 4));
            }
            for (int i = 0; i < 8; i++)
                for (int t = 0; t < TC; t++)
                    dot[t][i % CH] = _mm512_dpbusd_epi32(dot[t][i % CH], u[i], _mm512_set1_epi32(x4(xb + t * A.kp + 4 * i)));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + b * QROWS)));
        const __m512 mn = m ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(m + b * QROWS)))
                            : _mm512_mul_ps(d, _mm512_set1_ps(-zero_code<BITS>()));
        for (int t = 0; t < TC; t++) {
            const int64_t tb = (t0 + t) * A.nb + b;
            const __m512i sum = CH == 2 ? _mm512_add_epi32(dot[t][0], dot[t][CH - 1]) : dot[t][0];
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(A.d[tb])), acc[t]);
            acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(A.ds[tb]), acc[t]);
        }
    }
    for (int t = 0; t < TC; t++) _mm512_storeu_ps(Y + t * ldy, acc[t]);
}

// ---- AVX2: the group as two 8-row halves; pmaddubsw (u8·s8 pairs) + pmaddwd to int32. int8 codes are
// made signed (u ^ 0x80) for the sign trick (|q|·sign(x, q) cannot overflow int16), which needs no
// correction: sum q·qx = sum u·qx - 128·sum qx. int4 sums a whole block in int16 (8·2·15·127 < 2^15), int6 two steps
// (2·2·63·127 < 2^15).
#define AVX2Q_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2Q_TARGET inline __m256i top_bits256(__m256i h, int k) {  // top_bits512 on 32 bytes
    const __m256i mask = _mm256_set1_epi8(0x30);
    switch (k) {
        case 0: return _mm256_and_si256(_mm256_slli_epi16(h, 4), mask);
        case 1: return _mm256_and_si256(_mm256_slli_epi16(h, 2), mask);
        case 2: return _mm256_and_si256(h, mask);
        default: return _mm256_and_si256(_mm256_srli_epi16(h, 2), mask);
    }
}

#define AVX2Q_INLINE AVX2Q_TARGET __attribute__((always_inline)) inline
// A token's sum kept in a register between steps: GCC 12 otherwise reassociates the integer adds into a tree over a
// block's products, computed first and spilled (int4: 19 -> 22 multiply-adds a cycle at 4-9 tokens on Zen 2)
#define AVX2Q_IN_ORDER(v) __asm__("" : "+x"(v))

// Block b's integer sums for NH 8-row halves from h0, token by token: dot[h][t] = sum over the block's 32 columns of
// u·qx. Each step's weights serve every half and token, each broadcast activation every half, each sum kept in order.
template <int BITS, int TC, int NH>
AVX2Q_INLINE void avx2_block_dots(const uint8_t* q, int64_t b, int h0, const int8_t* xb, int64_t kp, __m256i (*dot)[TC]) {
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(char(0x80));
    for (int h = 0; h < NH; h++)
        for (int t = 0; t < TC; t++) dot[h][t] = _mm256_setzero_si256();
    if (BITS == 8) {
        for (int i = 0; i < 8; i++) {
            __m256i w[NH], aw[NH];
            for (int h = 0; h < NH; h++) {
                w[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(q + b * 512 + 64 * i + 32 * (h0 + h))), flip);
                aw[h] = _mm256_sign_epi8(w[h], w[h]);
            }
            for (int t = 0; t < TC; t++) {
                const __m256i x = _mm256_set1_epi32(x4(xb + t * kp + 4 * i));
                for (int h = 0; h < NH; h++) {
                    const __m256i p = _mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(x, w[h]));
                    dot[h][t] = _mm256_add_epi32(dot[h][t], _mm256_madd_epi16(p, ones));
                    AVX2Q_IN_ORDER(dot[h][t]);
                }
            }
        }
    } else if (BITS == 6) {
        for (int v = 0; v < 4; v++) {
            __m256i lo[NH], hi[NH];
            for (int h = 0; h < NH; h++) {
                const uint8_t* qb = q + b * 384 + 32 * (h0 + h);
                const __m256i w = _mm256_loadu_si256((const __m256i*)(qb + 64 * v));
                const __m256i top = _mm256_loadu_si256((const __m256i*)(qb + 256 + 64 * (v / 2)));
                lo[h] = _mm256_or_si256(_mm256_and_si256(w, low), top_bits256(top, (2 * v) % 4));
                hi[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), low), top_bits256(top, (2 * v + 1) % 4));
            }
            for (int t = 0; t < TC; t++) {
                const __m256i x0 = _mm256_set1_epi32(x4(xb + t * kp + 8 * v)), x1 = _mm256_set1_epi32(x4(xb + t * kp + 8 * v + 4));
                for (int h = 0; h < NH; h++) {
                    const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], x0), _mm256_maddubs_epi16(hi[h], x1));
                    dot[h][t] = _mm256_add_epi32(dot[h][t], _mm256_madd_epi16(s16, ones));
                    AVX2Q_IN_ORDER(dot[h][t]);
                }
            }
        }
    } else {  // int16 sums over the whole block, widened once
        for (int v = 0; v < 4; v++) {
            __m256i lo[NH], hi[NH];
            for (int h = 0; h < NH; h++) {
                const __m256i w = _mm256_loadu_si256((const __m256i*)(q + b * 256 + 64 * v + 32 * (h0 + h)));
                lo[h] = _mm256_and_si256(w, low), hi[h] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
            }
            for (int t = 0; t < TC; t++) {
                const __m256i x0 = _mm256_set1_epi32(x4(xb + t * kp + 8 * v)), x1 = _mm256_set1_epi32(x4(xb + t * kp + 8 * v + 4));
                for (int h = 0; h < NH; h++) {
                    dot[h][t] = _mm256_add_epi16(dot[h][t], _mm256_maddubs_epi16(lo[h], x0));
                    dot[h][t] = _mm256_add_epi16(dot[h][t], _mm256_maddubs_epi16(hi[h], x1));
                    AVX2Q_IN_ORDER(dot[h][t]);
                }
            }
        }
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < TC; t++) dot[h][t] = _mm256_madd_epi16(dot[h][t], ones);
    }
}

// acc[t] += d·dx·dot[t] + m·dx·Σqx for block b, half h (int8: m = -128·d cancels in the sign trick, so no second term).
template <int BITS, int TC>
AVX2Q_INLINE void avx2_block_scale(const uint16_t* s, const uint16_t* m, int64_t b, int h, const QActs& A, int t0,
                                   const __m256i* dot, __m256* acc) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + b * QROWS + 8 * h)));
    const __m256 mn = m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(m + b * QROWS + 8 * h)))
                        : _mm256_mul_ps(d, _mm256_set1_ps(-zero_code<BITS>()));
    for (int t = 0; t < TC; t++) {
        const int64_t tb = (t0 + t) * A.nb + b;
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(d, _mm256_set1_ps(A.d[tb])), acc[t]);
        if (BITS != 8) acc[t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(A.ds[tb]), acc[t]);
    }
}

// Up to 2 tokens both halves go together (2 x 2 x TC of the 16 ymm: integer sums and accumulators); from 3 on a half at
// a time (2 x TC), so up to 5 tokens share one unpacking of the weights instead of 2. Every element's sums run in the
// same order either way (blocks in turn, the same integer sums): the same bits.
template <int BITS, int TC>
AVX2Q_TARGET void qgroup_avx2(const QMat& W, int64_t g, const QActs& A, int t0, float* Y, int64_t ldy) {
    constexpr int HALVES = TC <= 2 ? 2 : 1, PASSES = 2 / HALVES;  // the halves a pass over the blocks works
    const uint8_t* q = W.q + g * QROWS * W.row_bytes;
    const uint16_t* s = W.s + g * QROWS * W.nb;
    const uint16_t* m = W.m ? W.m + g * QROWS * W.nb : nullptr;
    for (int h0 = 0; h0 < 2; h0 += HALVES) {
        __m256 acc[HALVES][TC];
        for (int j = 0; j < HALVES; j++)
            for (int t = 0; t < TC; t++) acc[j][t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < W.nb; b++) {
            const int8_t* xb = A.q + t0 * A.kp + 32 * b;
            // the next group's lines, as qgroup_vnni; a half at a time, each pass hints half of them (the second pass
            // reads this group's from the cache, so DRAM would idle through it)
            for (int line = h0 * BITS / PASSES; line < (h0 + 1) * BITS / PASSES; line++)
                _mm_prefetch(reinterpret_cast<const char*>(q + QROWS * W.row_bytes + b * BITS * 64 + 64 * line), _MM_HINT_T1);
            __m256i dot[HALVES][TC];
            avx2_block_dots<BITS, TC, HALVES>(q, b, h0, xb, A.kp, dot);
            for (int j = 0; j < HALVES; j++) avx2_block_scale<BITS, TC>(s, m, b, h0 + j, A, t0, dot[j], acc[j]);
        }
        for (int j = 0; j < HALVES; j++)
            for (int t = 0; t < TC; t++) _mm256_storeu_ps(Y + t * ldy + 8 * (h0 + j), acc[j][t]);
    }
}

// ---- AVX-VNNI (VEX vpdpbusd on ymm: Intel Core from the 12th generation, which has no AVX-512): each lane a row, so a
// block's integer sums and their scaling are qgroup_vnni's lane for lane (the same bits). Up to 2 tokens both 8-row
// halves of the group go together (two independent chains per token); from 3 tokens on, one half at a time, the
// tokens' chains hiding vpdpbusd's latency, so that 5 tokens' accumulators fit 16 ymm.
#define AVXVNNI_TARGET __attribute__((target("avx2,avxvnni,fma,f16c")))

template <int BITS, int TC, int NH>  // NH halves from h0
AVXVNNI_TARGET void qhalves_avxvnni(const QMat& W, int64_t g, int h0, const QActs& A, int t0, float* Y, int64_t ldy) {
    const uint8_t* q = W.q + g * QROWS * W.row_bytes;
    const uint16_t* s = W.s + g * QROWS * W.nb;
    const uint16_t* m = W.m ? W.m + g * QROWS * W.nb : nullptr;
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[TC][NH];
    for (int t = 0; t < TC; t++)
        for (int h = 0; h < NH; h++) acc[t][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < W.nb; b++) {
        __m256i dot[TC][NH];
        for (int t = 0; t < TC; t++)
            for (int h = 0; h < NH; h++) dot[t][h] = _mm256_setzero_si256();
        const int8_t* xb = A.q + t0 * A.kp + 32 * b;
        if (h0 == 0)
            for (int line = 0; line < BITS; line++)  // as qgroup_vnni: the next group's block, one group ahead
                _mm_prefetch(reinterpret_cast<const char*>(q + QROWS * W.row_bytes + b * BITS * 64 + 64 * line), _MM_HINT_T1);
        for (int h = 0; h < NH; h++) {
            const uint8_t* qh = q + 32 * (h0 + h);
            if (BITS == 8) {
                for (int i = 0; i < 8; i++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i*)(qh + b * 512 + 64 * i));
                    for (int t = 0; t < TC; t++)
                        dot[t][h] = _mm256_dpbusd_avx_epi32(dot[t][h], w, _mm256_set1_epi32(x4(xb + t * A.kp + 4 * i)));
                }
            } else {
                const uint8_t* qb = qh + b * BITS * 64;
                __m256i top[2] = {};
                if (BITS == 6) top[0] = _mm256_loadu_si256((const __m256i*)(qb + 256)), top[1] = _mm256_loadu_si256((const __m256i*)(qb + 320));
                for (int v = 0; v < 4; v++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i*)(qb + 64 * v));
                    __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                    if (BITS == 6) {
                        lo = _mm256_or_si256(lo, top_bits256(top[v / 2], (2 * v) % 4));
                        hi = _mm256_or_si256(hi, top_bits256(top[v / 2], (2 * v + 1) % 4));
                    }
                    for (int t = 0; t < TC; t++) {
                        dot[t][h] = _mm256_dpbusd_avx_epi32(dot[t][h], lo, _mm256_set1_epi32(x4(xb + t * A.kp + 8 * v)));
                        dot[t][h] = _mm256_dpbusd_avx_epi32(dot[t][h], hi, _mm256_set1_epi32(x4(xb + t * A.kp + 8 * v + 4)));
                    }
                }
            }
        }
        for (int h = 0; h < NH; h++) {
            const int64_t sb = b * QROWS + 8 * (h0 + h);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + sb)));
            const __m256 mn = m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(m + sb)))
                                : _mm256_mul_ps(d, _mm256_set1_ps(-zero_code<BITS>()));
            for (int t = 0; t < TC; t++) {
                const int64_t tb = (t0 + t) * A.nb + b;
                acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t][h]), _mm256_mul_ps(d, _mm256_set1_ps(A.d[tb])), acc[t][h]);
                acc[t][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(A.ds[tb]), acc[t][h]);
            }
        }
    }
    for (int t = 0; t < TC; t++)
        for (int h = 0; h < NH; h++) _mm256_storeu_ps(Y + t * ldy + 8 * (h0 + h), acc[t][h]);
}

template <int BITS, int TC>
void qgroup_avxvnni(const QMat& W, int64_t g, const QActs& A, int t0, float* Y, int64_t ldy) {
    if (TC <= 2) return qhalves_avxvnni<BITS, TC, 2>(W, g, 0, A, t0, Y, ldy);
    qhalves_avxvnni<BITS, TC, 1>(W, g, 0, A, t0, Y, ldy);
    qhalves_avxvnni<BITS, TC, 1>(W, g, 1, A, t0, Y, ldy);
}

// ---- AMX-INT8, int8 and int4 weights: one tile op per block of 32 columns. A = up to 16 tokens' codes [TT x 32 s8],
// loaded straight from the quantized activations; B = a 16-row group's block [8 x 64 u8]: int8's interleaved codes as
// they are (already the layout B wants), int4's nibbles unpacked into that layout once per group and call; C = [TT
// tokens x 16 rows] int32: the integer sums vpdpbusd makes, then the VNNI path's scaling in its order, so the bits
// equal that path's. The per-block round trip (store C, reload, scale: 4 vector ops per token, row group and block)
// bounds it, so it pays only past one VNNI pass, and for int4, whose VNNI pass is cheaper (its nibbles unpacked once for
// 10 tokens), from 28 tokens. A last tile of fewer than 16 tokens is configured that many rows and scales only those
// (at 16 + 4 tokens a whole second tile's scaling was the loss that kept int4 off the tiles below 40).
#define AMXQ_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
constexpr int AMXQ_MIN_T = 11;  // int8, fewer tokens: one VNNI pass (up to 10 tokens), measured as fast
constexpr int AMXQ4_MIN_T = 28;  // int4, fewer: VNNI as fast or faster (its nibbles unpacked once for up to 10 tokens)

struct QTileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

AMXQ_TARGET inline void amxq_config(int tokens) {  // two sets, A [tokens x 32 B], B [8 x 64 B], C [tokens x 64 B]: tmm0-2, 3-5
    QTileConfig c{};
    c.palette = 1;
    for (int i = 0; i < 6; i += 3) {
        c.rows[i] = uint8_t(tokens), c.colsb[i] = 32;
        c.rows[i + 1] = 8, c.colsb[i + 1] = 64;
        c.rows[i + 2] = uint8_t(tokens), c.colsb[i + 2] = 64;
    }
    asm volatile("" : : "r"(&c) : "memory");  // GCC 12 does not see ldtilecfg read c: keep the stores
    _tile_loadconfig(&c);
}

// acc[t] += block b's sums C [TT][16] for TT tokens, scaled as qgroup_vnni<BITS> scales them; token t's dx and ds at
// A.d/A.ds + tb[t] + b
template <int BITS, int TT>
AMXQ_TARGET inline void amxq_scale(const int32_t* C, const QMat& W, int64_t g, int64_t b, const int64_t* tb, const QActs& A,
                                   __m512* acc) {
    const int64_t sb = g * QROWS * W.nb + b * QROWS;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(W.s + sb)));
    const __m512 mn = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(W.m + sb)))
                                : _mm512_mul_ps(d, _mm512_set1_ps(-zero_code<BITS>()));
#pragma GCC unroll 16
    for (int t = 0; t < TT; t++) {
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(C + 16 * t)), _mm512_mul_ps(d, _mm512_set1_ps(A.d[tb[t] + b])),
                                 acc[t]);
        acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(A.ds[tb[t] + b]), acc[t]);
    }
}

// int4 group: its nb blocks' nibbles into int8's layout, u [nb][512] (vector v's low nibbles are columns 8v..8v+3,
// int8's vector 2v; its high nibbles 8v+4..8v+7, vector 2v + 1)
AMXQ_TARGET inline void amxq_unpack4(const uint8_t* q, int64_t nb, uint8_t* u) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t i = 0; i < 4 * nb; i++) {
        const __m512i w = _mm512_loadu_si512(q + 64 * i);
        _mm512_storeu_si512(u + 128 * i, _mm512_and_si512(w, low));
        _mm512_storeu_si512(u + 128 * i + 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), low));
    }
}

// One block's integer sums into C [TT tokens x 16 rows]: A tile (tokens) times B tile (rows) in tiles ta, tb, tc. A macro:
// GCC's tile intrinsics paste their tile numbers into the assembly, so a template parameter cannot name them.
#define AMXQ_BLOCK(ta, tb, tc, a, lda, b, C) \
    do {                                     \
        _tile_loadd(ta, a, lda);             \
        _tile_loadd(tb, b, 64);              \
        _tile_zero(tc);                      \
        _tile_dpbsud(tc, ta, tb);            \
        _tile_stored(tc, C, 64);             \
    } while (0)

// Tokens t0..t0+TT-1 (TT <= 16, the tiles configured TT rows) of row group g into Y: their sums in TT zmm over the
// blocks; block b+1's tile ops (the other tile set and C buffer) go before block b's scaling, so the two overlap.
template <int BITS, int TT>
AMXQ_TARGET void amxq_tokens(const QMat& W, int64_t g, const uint8_t* B, const QActs& A, int t0, float* Y, int64_t ldy) {
    alignas(64) int32_t C[2][16 * 16];
    const int8_t* a = A.q + t0 * A.kp;
    __m512 acc[TT];
    int64_t tb[TT];
#pragma GCC unroll 16
    for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps(), tb[t] = (t0 + t) * A.nb;
    AMXQ_BLOCK(0, 1, 2, a, A.kp, B, C[0]);
    for (int64_t b = 0; b < W.nb; b += 2) {
        if (b + 1 < W.nb) AMXQ_BLOCK(3, 4, 5, a + 32 * (b + 1), A.kp, B + 512 * (b + 1), C[1]);
        amxq_scale<BITS, TT>(C[0], W, g, b, tb, A, acc);
        if (b + 2 < W.nb) AMXQ_BLOCK(0, 1, 2, a + 32 * (b + 2), A.kp, B + 512 * (b + 2), C[0]);
        if (b + 1 < W.nb) amxq_scale<BITS, TT>(C[1], W, g, b + 1, tb, A, acc);
    }
#pragma GCC unroll 16
    for (int t = 0; t < TT; t++) _mm512_storeu_ps(Y + (t0 + t) * ldy, acc[t]);
}

using AmxTokens = void (*)(const QMat&, int64_t, const uint8_t*, const QActs&, int, float*, int64_t);

template <int BITS, int... I>
constexpr std::array<AmxTokens, sizeof...(I)> amxq_tokens_table(std::integer_sequence<int, I...>) {
    return {amxq_tokens<BITS, I + 1>...};
}

// Y[t, r - r0] as qwalk<BITS> writes it: per row group (int4's nibbles unpacked once for all its tiles), 16-token tiles,
// the last one as many tokens as are left (the tiles configured again for it, and for 16 at the next group)
template <int BITS>
AMXQ_TARGET void qwalk_amx(const QMat& W, int64_t r0, int64_t nr, const QActs& A, int T, float* Y, int64_t ldy) {
    static constexpr auto tile = amxq_tokens_table<BITS>(std::make_integer_sequence<int, 16>{});
    static thread_local std::vector<uint8_t> unpacked;  // int4: one group's blocks in int8's layout, for all its tiles
    if (BITS == 4 && unpacked.size() < size_t(512 * W.nb)) unpacked.resize(512 * W.nb);
    int rows = std::min(16, T);
    amxq_config(rows);
    for (int64_t r = r0; r < r0 + nr; r += QROWS) {
        const int64_t g = r / QROWS;
        const uint8_t* B = W.q + g * QROWS * W.row_bytes;  // block b's B tile at B + 512 b
        if (BITS == 4) amxq_unpack4(B, W.nb, unpacked.data()), B = unpacked.data();
        for (int t0 = 0; t0 < T; t0 += 16) {
            const int tt = std::min(16, T - t0);
            if (tt != rows) amxq_config(rows = tt);
            tile[tt - 1](W, g, B, A, t0, Y + (r - r0), ldy);
        }
    }
    _tile_release();
}

using QGroup = void (*)(const QMat&, int64_t, const QActs&, int, float*, int64_t);

enum QPath { Q_VNNI, Q_AVX_VNNI, Q_AVX2 };

template <int BITS, QPath P, int... I>
void qwalk(const QMat& W, int64_t r0, int64_t nr, const QActs& A, int T, float* Y, int64_t ldy,
           std::integer_sequence<int, I...>) {
    constexpr int TCMAX = sizeof...(I);
    static const QGroup tile[TCMAX] = {(P == Q_VNNI ? qgroup_vnni<BITS, I + 1>
                                        : P == Q_AVX_VNNI ? qgroup_avxvnni<BITS, I + 1> : qgroup_avx2<BITS, I + 1>)...};
    const int tc = even_pass_tokens(T, TCMAX);
    for (int64_t r = r0; r < r0 + nr; r += QROWS)
        for (int t = 0; t < T; t += tc)
            tile[std::min(tc, T - t) - 1](W, r / QROWS, A, t, Y + t * ldy + (r - r0), ldy);
}
#endif  // MOE_X86

// Y[t, r - r0] for rows r0..r0+nr of W (both multiples of 16) and T tokens of A, on `isa`.
void qmat(const QMat& W, int64_t r0, int64_t nr, const QActs& A, int T, float* Y, int64_t ldy, int bits, Isa isa) {
#ifdef MOE_X86
    // Registers: VNNI TC tokens x (1 float + 1 int accumulator) + 8 unpacked int4 vectors + 3 of 32 zmm; AVX-VNNI
    // 2 x TC + 6 of 16 ymm (one half-group at a time); AVX2 2 x 2 x TC of 16 ymm up to 2 tokens, then 2 x TC.
    if (isa == AMX_INT8 && bits == 8 && T >= AMXQ_MIN_T) return qwalk_amx<8>(W, r0, nr, A, T, Y, ldy);
    if (isa == AMX_INT8 && bits == 4 && T >= AMXQ4_MIN_T) return qwalk_amx<4>(W, r0, nr, A, T, Y, ldy);  // int6: resolve_q
    if (isa == AVX512_VNNI || isa == AMX_INT8) {
        if (bits == 8) return qwalk<8, Q_VNNI>(W, r0, nr, A, T, Y, ldy, std::make_integer_sequence<int, 10>{});
        if (bits == 6) return qwalk<6, Q_VNNI>(W, r0, nr, A, T, Y, ldy, std::make_integer_sequence<int, 10>{});
        return qwalk<4, Q_VNNI>(W, r0, nr, A, T, Y, ldy, std::make_integer_sequence<int, 10>{});
    }
    if (isa == AVX_VNNI) {
        if (bits == 8) return qwalk<8, Q_AVX_VNNI>(W, r0, nr, A, T, Y, ldy, std::make_integer_sequence<int, 5>{});
        if (bits == 6) return qwalk<6, Q_AVX_VNNI>(W, r0, nr, A, T, Y, ldy, std::make_integer_sequence<int, 5>{});
        return qwalk<4, Q_AVX_VNNI>(W, r0, nr, A, T, Y, ldy, std::make_integer_sequence<int, 5>{});
    }
    if (isa == AVX2) {
        if (bits == 8) return qwalk<8, Q_AVX2>(W, r0, nr, A, T, Y, ldy, std::make_integer_sequence<int, 5>{});
        if (bits == 6) return qwalk<6, Q_AVX2>(W, r0, nr, A, T, Y, ldy, std::make_integer_sequence<int, 5>{});
        return qwalk<4, Q_AVX2>(W, r0, nr, A, T, Y, ldy, std::make_integer_sequence<int, 5>{});
    }
#else
    (void)isa;
#endif
    if (bits == 8) qmat_scalar<8>(W, r0, nr, A, T, Y, ldy);
    else if (bits == 6) qmat_scalar<6>(W, r0, nr, A, T, Y, ldy);
    else qmat_scalar<4>(W, r0, nr, A, T, Y, ldy);
}

}  // namespace
