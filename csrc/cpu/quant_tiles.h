// Quantized weights x quantized activations (engine/quant/formats.py has the layout and the twin):
//   Y[t, r] = sum_b d[r,b]·dx[t,b]·(sum_j u[r,32b+j]·qx[t,32b+j]) + m[r,b]·ds[t,b]     (ds = dx·sum_j qx)
// with int8 m = -128·d. Weights: u8 codes (int8 one per byte; int4 per 64-chunk byte j = u[j] | u[32+j]<<4),
// fp16 d and m per block of 32. Activations: s8 codes and fp32 scales per token and block (Q8_1).
// Paths: AVX-512 VNNI (vpdpbusd: 64 u8·s8 products into 16 int32 per instruction, two blocks),
// AVX2 (pmaddubsw + pmaddwd, one block), and portable scalar C++; each sums a (row, token) in the
// same order whatever the other rows and tokens of the call, so a token's result never depends on
// its batch.
#pragma once

#include "common.h"

#include <utility>

namespace {

struct QMat {  // one expert's matrix: row r at q + r·row_bytes, its scales at s + r·nb
    const uint8_t* q;
    const uint16_t* s;
    const uint16_t* m;  // int4 minimums; null for int8
    int64_t row_bytes, nb;
};

struct QActs {  // T tokens' activations, quantized: row t at q + t·kp, scales at d/ds + t·nb
    const int8_t* q;
    const float* d;  // [T, nb] dx
    const float* ds;  // [T, nb] dx·sum(qx)
    const float* dxv;  // [T, kp/64, 16] dx expanded for the VNNI path: 8 lanes per block
    int64_t kp, nb;
};

inline float h2f(uint16_t v) { return f16_to_f32(v); }

// The correction sum_b m[r,b]·ds[t,b] (int4) or -128·sum_b d[r,b]·ds[t,b] (int8), in block order.
inline float q_correction(const QMat& W, int64_t r, const QActs& A, int t) {
    const uint16_t* m = (W.m ? W.m : W.s) + r * W.nb;
    const float* ds = A.ds + t * A.nb;
    float c = 0.f;
    for (int64_t b = 0; b < W.nb; b++) c += h2f(m[b]) * ds[b];
    return W.m ? c : -128.f * c;
}

// ---- portable -----------------------------------------------------------------------------------
template <int BITS>
void qmat_scalar(const QMat& W, int64_t r0, int64_t nr, const QActs& A, int T, float* Y, int64_t ldy) {
    for (int64_t r = r0; r < r0 + nr; r++) {
        const uint8_t* q = W.q + r * W.row_bytes;
        const uint16_t* s = W.s + r * W.nb;
        for (int t = 0; t < T; t++) {
            const int8_t* x = A.q + t * A.kp;
            const float* dx = A.d + t * A.nb;
            float acc = 0.f;
            for (int64_t b = 0; b < W.nb; b++) {
                int32_t dot = 0;
                for (int j = 0; j < 32; j++) {
                    const int64_t k = 32 * b + j;
                    int u;
                    if (BITS == 8) u = q[k];
                    else u = (q[(k / 64) * 32 + (k % 32)] >> ((k % 64) >= 32 ? 4 : 0)) & 0xF;
                    dot += u * int(x[k]);
                }
                acc += h2f(s[b]) * dx[b] * float(dot);
            }
            Y[t * ldy + (r - r0)] = acc + q_correction(W, r, A, t);
        }
    }
}

// Quantize T rows of fp32 activations x [T, K] (row stride ldx) into q [T, kp], d, ds, dxv.
// Bit-identical to formats.quantize_activations: dx = amax/127, q = round-half-even(x·(1/dx)).
void quantize_acts(const float* x, int64_t ldx, int64_t K, int T, int64_t kp, int8_t* q, float* d, float* ds, float* dxv) {
    const int64_t nb = kp / 32;
    for (int t = 0; t < T; t++) {
        const float* xr = x + t * ldx;
        for (int64_t b = 0; b < nb; b++) {
            float amax = 0.f;
            for (int64_t k = 32 * b; k < std::min(K, 32 * b + 32); k++) amax = std::max(amax, std::fabs(xr[k]));
            const float db = amax / 127.f, inv = db > 0.f ? 1.f / db : 0.f;
            int32_t sum = 0;
            for (int64_t k = 32 * b; k < 32 * b + 32; k++) {
                float v = k < K ? xr[k] * inv : 0.f;
                int qi = int(std::nearbyint(v));
                qi = std::max(-127, std::min(127, qi));
                q[t * kp + k] = int8_t(qi);
                sum += qi;
            }
            d[t * nb + b] = db;
            ds[t * nb + b] = db * float(sum);
            for (int i = 0; i < 8; i++) dxv[(t * nb + b) * 8 + i] = db;  // [T][kp/64][16] = [T][nb][8]
        }
    }
}

#ifdef MOE_X86
// ---- AVX-512 VNNI: per 64-chunk and (row, token): vpdpbusd, convert, scale, accumulate -------------
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

template <int BITS>
VNNI_TARGET inline __m512i qload_vnni(const uint8_t* row, int64_t c) {
    if (BITS == 8) return _mm512_loadu_si512(row + 64 * c);
    // int4: the chunk's 32 bytes in both halves; the upper half shifted by 4 -> its high nibbles
    const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(row + 32 * c)));
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi8(0x0F));
}

template <int BITS, int R, int TC>
VNNI_TARGET void qtile_vnni(const QMat& W, int64_t r0, const QActs& A, int t0, float* Y, int64_t ldy) {
    __m512 acc[R][TC];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) acc[r][t] = _mm512_setzero_ps();
    const __m512i expand = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const int64_t nc = A.kp / 64;
    for (int64_t c = 0; c < nc; c++) {
        __m512i w[R];
        __m512 dw[R];
        for (int r = 0; r < R; r++) {
            w[r] = qload_vnni<BITS>(W.q + (r0 + r) * W.row_bytes, c);
            uint32_t two;
            std::memcpy(&two, W.s + (r0 + r) * W.nb + 2 * c, 4);
            dw[r] = _mm512_permutexvar_ps(expand, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(int(two)))));
        }
        for (int t = 0; t < TC; t++) {
            const __m512i x = _mm512_loadu_si512(A.q + (t0 + t) * A.kp + 64 * c);
            const __m512 dx = _mm512_loadu_ps(A.dxv + ((t0 + t) * nc + c) * 16);
            for (int r = 0; r < R; r++) {
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], x);
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw[r], dx), acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++)
            Y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]) + q_correction(W, r0 + r, A, t0 + t);
}

// ---- AVX2: per block and (row, token): pmaddubsw (u8·s8 pairs, no overflow for |u|<=127 or u<=15),
// pmaddwd to int32, convert, scale, accumulate. int8 codes are made signed (u ^ 0x80) and use the
// sign trick (|q| · sign(x, q)), so int8 needs no correction term here: sum q·qx = sum u·qx - 128·sum qx.
#define AVX2Q_TARGET __attribute__((target("avx2,fma,f16c")))

template <int BITS, int R, int TC>
AVX2Q_TARGET void qtile_avx2(const QMat& W, int64_t r0, const QActs& A, int t0, float* Y, int64_t ldy) {
    __m256 acc[R][TC];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) acc[r][t] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(char(0x80));
    for (int64_t b = 0; b < W.nb; b++) {
        __m256i w[R];
        __m256 dw[R];
        for (int r = 0; r < R; r++) {
            const uint8_t* row = W.q + (r0 + r) * W.row_bytes;
            if (BITS == 8) {
                w[r] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(row + 32 * b)), flip);
            } else {
                const __m256i raw = _mm256_loadu_si256((const __m256i*)(row + 32 * (b / 2)));
                w[r] = _mm256_and_si256(b % 2 ? _mm256_srli_epi16(raw, 4) : raw, low);
            }
            dw[r] = _mm256_set1_ps(h2f(W.s[(r0 + r) * W.nb + b]));
        }
        for (int t = 0; t < TC; t++) {
            const __m256i x = _mm256_loadu_si256((const __m256i*)(A.q + (t0 + t) * A.kp + 32 * b));
            const __m256 dx = _mm256_set1_ps(A.d[(t0 + t) * A.nb + b]);
            for (int r = 0; r < R; r++) {
                const __m256i p = BITS == 8 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w[r], w[r]), _mm256_sign_epi8(x, w[r]))
                                            : _mm256_maddubs_epi16(w[r], x);
                const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                acc[r][t] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw[r], dx), acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) {
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r][t]), _mm256_extractf128_ps(acc[r][t], 1));
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            s = _mm_add_ss(s, _mm_movehdup_ps(s));
            Y[t * ldy + r] = _mm_cvtss_f32(s) + (BITS == 4 ? q_correction(W, r0 + r, A, t0 + t) : 0.f);
        }
}

// ---- the row/token walk: blocks of R rows (single rows at the tail) by chunks of up to TCMAX tokens
using QTile = void (*)(const QMat&, int64_t, const QActs&, int, float*, int64_t);

template <int BITS, int R, bool VNNI, int... I>
void qwalk(const QMat& W, int64_t r0, int64_t nr, const QActs& A, int T, float* Y, int64_t ldy,
           std::integer_sequence<int, I...>) {
    constexpr int TCMAX = sizeof...(I);
    static const QTile block[TCMAX] = {(VNNI ? qtile_vnni<BITS, R, I + 1> : qtile_avx2<BITS, R, I + 1>)...};
    static const QTile single[TCMAX] = {(VNNI ? qtile_vnni<BITS, 1, I + 1> : qtile_avx2<BITS, 1, I + 1>)...};
    for (int64_t r = 0; r < nr;) {
        const bool full = r + R <= nr;
        for (int t = 0; t < T; t += TCMAX) {
            const int tc = std::min(TCMAX, T - t);
            (full ? block : single)[tc - 1](W, r0 + r, A, t, Y + t * ldy + r, ldy);
        }
        r += full ? R : 1;
    }
}
#endif  // MOE_X86

// Y[t, r - r0] for rows r0..r0+nr of W and T tokens of A, on `isa` (SCALAR, AVX2 or AVX512_VNNI).
void qmat(const QMat& W, int64_t r0, int64_t nr, const QActs& A, int T, float* Y, int64_t ldy, int bits, Isa isa) {
#ifdef MOE_X86
    // Registers: VNNI 4 rows x 4 tokens = 16 accumulators + 4 weights + 4 scales of 32 zmm; AVX2 2 x 3.
    if (isa == AVX512_VNNI) {
        if (bits == 8) return qwalk<8, 4, true>(W, r0, nr, A, T, Y, ldy, std::make_integer_sequence<int, 4>{});
        return qwalk<4, 4, true>(W, r0, nr, A, T, Y, ldy, std::make_integer_sequence<int, 4>{});
    }
    if (isa == AVX2) {
        if (bits == 8) return qwalk<8, 2, false>(W, r0, nr, A, T, Y, ldy, std::make_integer_sequence<int, 3>{});
        return qwalk<4, 2, false>(W, r0, nr, A, T, Y, ldy, std::make_integer_sequence<int, 3>{});
    }
#else
    (void)isa;
#endif
    if (bits == 8) qmat_scalar<8>(W, r0, nr, A, T, Y, ldy);
    else qmat_scalar<4>(W, r0, nr, A, T, Y, ldy);
}

}  // namespace
