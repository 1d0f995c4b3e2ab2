// Fused SwiGLU expert FFN for the CPU tier: for many experts and their token groups in one call,
//   out[rows[s], :] += weights[s] * down_e(silu(gate_e x_s) * up_e x_s)      (s in group of expert e)
// Decode is memory-bound (1-9 tokens per expert): every weight row is read once from DRAM and
// dotted with all of its group's tokens while it sits in registers/L1, in fp32.
//
// Paths, chosen at run time: AVX-512 BF16 (vdpbf16ps, bf16 weights and activations), AVX-512F and
// AVX2+FMA (weights bf16/fp16/fp32 converted to fp32 in registers), and portable scalar C++.
// Threads: a persistent pool (caller + n-1 workers that sleep when idle); phase 1 splits (expert,
// block of I rows), phase 2 splits blocks of H output columns, so no two threads write one element
// and every element sums its experts in the same order whatever the thread count.
// Plain C ABI for ctypes, which releases the GIL for the whole call.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MOE_X86 1
#include <pthread.h>
#if defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#define API extern "C" __attribute__((visibility("default")))

namespace {

enum DType { F32 = 0, BF16 = 1, F16 = 2 };
enum Isa { AUTO = 0, SCALAR = 1, AVX2 = 2, AVX512 = 3, AVX512_BF16 = 4, AMX_BF16 = 5 };

// ---- scalar conversions -------------------------------------------------------------------------
inline float bf16_to_f32(uint16_t v) {
    uint32_t u = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);  // inf / NaN
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  // subnormal: normalise
        int e = -1;
        do { e++; man <<= 1; } while (!(man & 0x400));
        u = sign | uint32_t(112 - e) << 23 | ((man & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline float load_scalar(const void* p, int64_t i, int dtype) {
    switch (dtype) {
        case BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
        case F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
        default: return static_cast<const float*>(p)[i];
    }
}

// A matrix-times-tokens job: Y[t, r] = sum_k W[r, k] * X[t, k], r < rows, t < T.
// W [rows, len] row-major (row stride ldw elements), X [T, len] fp32 (or bf16 for the BF16 path).
struct MatJob {
    const void* W;
    int64_t ldw, rows, len;
    const void* X;
    int64_t ldx;
    int T;
    float* Y;
    int64_t ldy;
};

void mat_scalar(const MatJob& j, int dtype) {
    const float* X = static_cast<const float*>(j.X);
    for (int64_t r = 0; r < j.rows; r++) {
        for (int t = 0; t < j.T; t++) j.Y[t * j.ldy + r] = 0.f;
        for (int64_t k = 0; k < j.len; k++) {
            float w = load_scalar(j.W, r * j.ldw + k, dtype);
            for (int t = 0; t < j.T; t++) j.Y[t * j.ldy + r] += w * X[t * j.ldx + k];
        }
    }
}

// Per 16-block of a row: its 8 even entries, then its 8 odd ones (the order mat_avx2_pairs reads).
void permute_pairs(float* x, int64_t len) {
    float tmp[16];
    for (int64_t k = 0; k + 16 <= len; k += 16) {
        for (int i = 0; i < 8; i++) tmp[i] = x[k + 2 * i], tmp[8 + i] = x[k + 2 * i + 1];
        std::memcpy(x + k, tmp, sizeof tmp);
    }
}

#ifdef MOE_X86
// ---- AVX-512F: 16 lanes; R rows x TC tokens of fp32 accumulators stay in the 32 zmm registers ----
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

template <typename WT> AVX512_TARGET inline __m512 w16(const WT* p);
template <> AVX512_TARGET inline __m512 w16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> AVX512_TARGET inline __m512 w16<uint16_t>(const uint16_t* p) {  // bf16: the high half of fp32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
struct Half { uint16_t v; };  // fp16 storage, distinct from bf16's uint16_t
template <> AVX512_TARGET inline __m512 w16<Half>(const Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
template <typename WT> AVX512_TARGET inline __m512 w16m(const WT* p, __mmask16 m);
template <> AVX512_TARGET inline __m512 w16m<float>(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
template <> AVX512_TARGET inline __m512 w16m<uint16_t>(const uint16_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
template <> AVX512_TARGET inline __m512 w16m<Half>(const Half* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

template <typename WT, int R, int TC>
AVX512_TARGET void tile_avx512(const WT* W, int64_t ldw, int64_t len, const float* X, int64_t ldx, float* Y, int64_t ldy) {
    __m512 acc[R][TC];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) acc[r][t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= len; k += 16) {
        __m512 w[R];
        for (int r = 0; r < R; r++) w[r] = w16<WT>(W + r * ldw + k);
        for (int t = 0; t < TC; t++) {
            __m512 x = _mm512_loadu_ps(X + t * ldx + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(w[r], x, acc[r][t]);
        }
    }
    if (k < len) {  // tail: masked loads read nothing past the row
        __mmask16 m = __mmask16((1u << (len - k)) - 1);
        __m512 w[R];
        for (int r = 0; r < R; r++) w[r] = w16m<WT>(W + r * ldw + k, m);
        for (int t = 0; t < TC; t++) {
            __m512 x = _mm512_maskz_loadu_ps(m, X + t * ldx + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(w[r], x, acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) Y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

template <typename WT, int R>
using TileFn = void (*)(const WT*, int64_t, int64_t, const float*, int64_t, float*, int64_t);

template <typename WT>
AVX512_TARGET void mat_avx512(const MatJob& j) {
    constexpr int TCMAX = 6;  // 4 rows x 6 tokens = 24 accumulators + 4 weights + 1 token
    static const TileFn<WT, 4> tab4[TCMAX] = {tile_avx512<WT, 4, 1>, tile_avx512<WT, 4, 2>, tile_avx512<WT, 4, 3>,
                                              tile_avx512<WT, 4, 4>, tile_avx512<WT, 4, 5>, tile_avx512<WT, 4, 6>};
    static const TileFn<WT, 1> tab1[TCMAX] = {tile_avx512<WT, 1, 1>, tile_avx512<WT, 1, 2>, tile_avx512<WT, 1, 3>,
                                              tile_avx512<WT, 1, 4>, tile_avx512<WT, 1, 5>, tile_avx512<WT, 1, 6>};
    const WT* W = static_cast<const WT*>(j.W);
    const float* X = static_cast<const float*>(j.X);
    for (int64_t r = 0; r < j.rows;) {
        const bool four = r + 4 <= j.rows;
        for (int t = 0; t < j.T; t += TCMAX) {
            int tc = std::min(TCMAX, j.T - t);
            if (four) tab4[tc - 1](W + r * j.ldw, j.ldw, j.len, X + t * j.ldx, j.ldx, j.Y + t * j.ldy + r, j.ldy);
            else tab1[tc - 1](W + r * j.ldw, j.ldw, j.len, X + t * j.ldx, j.ldx, j.Y + t * j.ldy + r, j.ldy);
        }
        r += four ? 4 : 1;
    }
}

// ---- AVX-512 BF16: vdpbf16ps multiplies 32 bf16 pairs into 16 fp32 sums per instruction -------
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

template <int R, int TC>
BF16_TARGET void tile_bf16(const uint16_t* W, int64_t ldw, int64_t len, const uint16_t* X, int64_t ldx, float* Y,
                           int64_t ldy) {
    __m512 acc[R][TC];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) acc[r][t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= len; k += 32) {  // unmasked: a per-iteration mask keeps GCC from holding acc in registers
        __m512i w[R];
        for (int r = 0; r < R; r++) w[r] = _mm512_loadu_si512(W + r * ldw + k);
        for (int t = 0; t < TC; t++) {
            __m512i x = _mm512_loadu_si512(X + t * ldx + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)w[r], (__m512bh)x);
        }
    }
    if (k < len) {  // tail: masked loads read nothing past the row, and zeros add nothing
        const __mmask32 m = __mmask32((1u << (len - k)) - 1);
        __m512i w[R];
        for (int r = 0; r < R; r++) w[r] = _mm512_maskz_loadu_epi16(m, W + r * ldw + k);
        for (int t = 0; t < TC; t++) {
            __m512i x = _mm512_maskz_loadu_epi16(m, X + t * ldx + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)w[r], (__m512bh)x);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) Y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

using TileBf16 = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, float*, int64_t);

BF16_TARGET void mat_bf16(const MatJob& j) {
    constexpr int TCMAX = 6;
    static const TileBf16 tab4[TCMAX] = {tile_bf16<4, 1>, tile_bf16<4, 2>, tile_bf16<4, 3>,
                                         tile_bf16<4, 4>, tile_bf16<4, 5>, tile_bf16<4, 6>};
    static const TileBf16 tab1[TCMAX] = {tile_bf16<1, 1>, tile_bf16<1, 2>, tile_bf16<1, 3>,
                                         tile_bf16<1, 4>, tile_bf16<1, 5>, tile_bf16<1, 6>};
    const uint16_t* W = static_cast<const uint16_t*>(j.W);
    const uint16_t* X = static_cast<const uint16_t*>(j.X);
    for (int64_t r = 0; r < j.rows;) {
        const bool four = r + 4 <= j.rows;
        for (int t = 0; t < j.T; t += TCMAX) {
            int tc = std::min(TCMAX, j.T - t);
            if (four) tab4[tc - 1](W + r * j.ldw, j.ldw, j.len, X + t * j.ldx, j.ldx, j.Y + t * j.ldy + r, j.ldy);
            else tab1[tc - 1](W + r * j.ldw, j.ldw, j.len, X + t * j.ldx, j.ldx, j.Y + t * j.ldy + r, j.ldy);
        }
        r += four ? 4 : 1;
    }
}

// ---- AMX BF16: a tile op multiplies a 16x32 weight block by 32x16 (tokens) activations --------
// Weights are tile-loaded straight from their rows; activations are packed once per group into
// the VNNI layout the B tile wants: P[k/2][n][2] = X[n][k..k+1], tokens n >= T zero.
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,fma")))
constexpr int AMX_N = 16;  // tokens per B tile

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

AMX_TARGET void amx_begin() {  // per thread: tmm0-1 C [16 rows x 16 tokens fp32], tmm2-3 A [16 x 32 bf16], tmm4 B
    TileConfig c{};
    c.palette = 1;
    for (int i = 0; i < 5; i++) c.rows[i] = 16, c.colsb[i] = 64;
    asm volatile("" : : "r"(&c) : "memory");  // GCC 12 does not see ldtilecfg read c: keep the stores
    _tile_loadconfig(&c);
}

AMX_TARGET void amx_end() { _tile_release(); }

void pack_vnni(const uint16_t* X, int64_t ldx, int T, int64_t K, uint16_t* P) {  // P [K/2][AMX_N][2]
    for (int64_t kp = 0; kp < K / 2; kp++)
        for (int n = 0; n < AMX_N; n++) {
            P[(kp * AMX_N + n) * 2] = n < T ? X[n * ldx + 2 * kp] : 0;
            P[(kp * AMX_N + n) * 2 + 1] = n < T ? X[n * ldx + 2 * kp + 1] : 0;
        }
}

// Y[t, r] for r < rows (a multiple of 16), t < T <= 16; K a multiple of 32. Two row blocks at a
// time: two independent accumulator chains share each B tile.
AMX_TARGET void mat_amx(const uint16_t* W, int64_t ldw, int64_t rows, int64_t K, const uint16_t* P, int T, float* Y,
                        int64_t ldy) {
    alignas(64) float C[2][16 * AMX_N];
    for (int64_t r = 0; r < rows; r += 32) {
        const bool two = r + 32 <= rows;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k = 0; k < K; k += 32) {
            _tile_loadd(4, P + k * AMX_N, 64);
            _tile_loadd(2, W + r * ldw + k, ldw * 2);
            _tile_dpbf16ps(0, 2, 4);
            if (two) {
                _tile_loadd(3, W + (r + 16) * ldw + k, ldw * 2);
                _tile_dpbf16ps(1, 3, 4);
            }
        }
        _tile_stored(0, C[0], 64);
        if (two) _tile_stored(1, C[1], 64);
        for (int b = 0; b < (two ? 2 : 1); b++)
            for (int i = 0; i < 16; i++)
                for (int t = 0; t < T; t++) Y[t * ldy + r + 16 * b + i] = C[b][i * AMX_N + t];
    }
}

// ---- AVX2 + FMA: 8 lanes, 16 ymm registers: 2 rows x 4 tokens --------------------------------
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

template <typename WT> AVX2_TARGET inline __m256 w8(const WT* p);
template <> AVX2_TARGET inline __m256 w8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <> AVX2_TARGET inline __m256 w8<uint16_t>(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
template <> AVX2_TARGET inline __m256 w8<Half>(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

inline float scalar_of(const float* p) { return *p; }
inline float scalar_of(const uint16_t* p) { return bf16_to_f32(*p); }
inline float scalar_of(const Half* p) { return f16_to_f32(p->v); }

AVX2_TARGET inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

template <typename WT, int R, int TC>
AVX2_TARGET void tile_avx2(const WT* W, int64_t ldw, int64_t len, const float* X, int64_t ldx, float* Y, int64_t ldy) {
    __m256 acc[R][TC];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) acc[r][t] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= len; k += 8) {
        __m256 w[R];
        for (int r = 0; r < R; r++) w[r] = w8<WT>(W + r * ldw + k);
        for (int t = 0; t < TC; t++) {
            __m256 x = _mm256_loadu_ps(X + t * ldx + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(w[r], x, acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) {
            float s = hsum8(acc[r][t]);
            for (int64_t kk = k; kk < len; kk++) s += scalar_of(W + r * ldw + kk) * X[t * ldx + kk];  // tail
            Y[t * ldy + r] = s;
        }
}

template <typename WT>
AVX2_TARGET void mat_avx2(const MatJob& j) {
    constexpr int TCMAX = 6;  // 2 rows x 6 tokens = 12 accumulators + 2 weights + 1 token of 16 ymm
    static const TileFn<WT, 2> tab2[TCMAX] = {tile_avx2<WT, 2, 1>, tile_avx2<WT, 2, 2>, tile_avx2<WT, 2, 3>,
                                              tile_avx2<WT, 2, 4>, tile_avx2<WT, 2, 5>, tile_avx2<WT, 2, 6>};
    static const TileFn<WT, 1> tab1[TCMAX] = {tile_avx2<WT, 1, 1>, tile_avx2<WT, 1, 2>, tile_avx2<WT, 1, 3>,
                                              tile_avx2<WT, 1, 4>, tile_avx2<WT, 1, 5>, tile_avx2<WT, 1, 6>};
    const WT* W = static_cast<const WT*>(j.W);
    const float* X = static_cast<const float*>(j.X);
    for (int64_t r = 0; r < j.rows;) {
        const bool two = r + 2 <= j.rows;
        for (int t = 0; t < j.T; t += TCMAX) {
            int tc = std::min(TCMAX, j.T - t);
            if (two) tab2[tc - 1](W + r * j.ldw, j.ldw, j.len, X + t * j.ldx, j.ldx, j.Y + t * j.ldy + r, j.ldy);
            else tab1[tc - 1](W + r * j.ldw, j.ldw, j.len, X + t * j.ldx, j.ldx, j.Y + t * j.ldy + r, j.ldy);
        }
        r += two ? 2 : 1;
    }
}

// bf16 weights on AVX2, without widening each 8 of them: one 256-bit load holds 16 bf16 = 8 pairs;
// the even ones become fp32 by a shift, the odd ones by masking off the low half. Activations are
// laid out to match (permute_pairs: per 16-block, the 8 even entries, then the 8 odd ones), so a
// block costs 1 load + 2 ALU ops for 16 weights instead of 2 widening loads + 2 shifts.

template <int R, int TC>
AVX2_TARGET void tile_avx2_pairs(const uint16_t* W, int64_t ldw, int64_t len, const float* X, int64_t ldx, float* Y,
                                 int64_t ldy) {
    const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
    __m256 acc[R][TC];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) acc[r][t] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= len; k += 16) {
        __m256 even[R], odd[R];
        for (int r = 0; r < R; r++) {
            __m256i w = _mm256_loadu_si256((const __m256i*)(W + r * ldw + k));
            even[r] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
            odd[r] = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
        }
        for (int t = 0; t < TC; t++) {
            __m256 xe = _mm256_loadu_ps(X + t * ldx + k), xo = _mm256_loadu_ps(X + t * ldx + k + 8);
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(odd[r], xo, _mm256_fmadd_ps(even[r], xe, acc[r][t]));
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) {
            float s = hsum8(acc[r][t]);
            for (int64_t kk = k; kk < len; kk++) s += bf16_to_f32(W[r * ldw + kk]) * X[t * ldx + kk];  // tail: natural order
            Y[t * ldy + r] = s;
        }
}

using TilePairs = void (*)(const uint16_t*, int64_t, int64_t, const float*, int64_t, float*, int64_t);

AVX2_TARGET void mat_avx2_pairs(const MatJob& j) {
    constexpr int TCMAX = 5;  // 2 rows x 5 tokens = 10 accumulators + 4 weight halves + 1-2 tokens of 16 ymm
    static const TilePairs tab2[TCMAX] = {tile_avx2_pairs<2, 1>, tile_avx2_pairs<2, 2>, tile_avx2_pairs<2, 3>,
                                          tile_avx2_pairs<2, 4>, tile_avx2_pairs<2, 5>};
    static const TilePairs tab1[TCMAX] = {tile_avx2_pairs<1, 1>, tile_avx2_pairs<1, 2>, tile_avx2_pairs<1, 3>,
                                          tile_avx2_pairs<1, 4>, tile_avx2_pairs<1, 5>};
    const uint16_t* W = static_cast<const uint16_t*>(j.W);
    const float* X = static_cast<const float*>(j.X);
    for (int64_t r = 0; r < j.rows;) {
        const bool two = r + 2 <= j.rows;
        for (int t = 0; t < j.T; t += TCMAX) {
            int tc = std::min(TCMAX, j.T - t);
            if (two) tab2[tc - 1](W + r * j.ldw, j.ldw, j.len, X + t * j.ldx, j.ldx, j.Y + t * j.ldy + r, j.ldy);
            else tab1[tc - 1](W + r * j.ldw, j.ldw, j.len, X + t * j.ldx, j.ldx, j.Y + t * j.ldy + r, j.ldy);
        }
        r += two ? 2 : 1;
    }
}
#endif  // MOE_X86

bool cpu_has(Isa isa) {
#ifdef MOE_X86
    __builtin_cpu_init();
    switch (isa) {
        case AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        case AVX512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && cpu_has(AVX2);
        case AVX512_BF16: return cpu_has(AVX512) && __builtin_cpu_supports("avx512bf16");
        case AMX_BF16: {  // CPUID.7.0:EDX bits 22 (AMX-BF16) and 24 (AMX-TILE), and Linux's permission to use tiles
#if defined(__linux__)
            static const bool ok = [] {
                unsigned a, b, c, d;
                if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
                return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
            }();
            return ok && cpu_has(AVX512_BF16);
#else
            return false;
#endif
        }
        default: return isa == SCALAR;
    }
#else
    return isa == SCALAR;
#endif
}

// Which path a (weights, activations) dtype pair takes on `isa` (AUTO: the best this CPU has).
Isa resolve(int isa, int w_dtype, int x_dtype) {
    if (isa == AUTO) {
        if (w_dtype == BF16 && x_dtype == BF16 && cpu_has(AMX_BF16)) return AMX_BF16;
        if (w_dtype == BF16 && x_dtype == BF16 && cpu_has(AVX512_BF16)) return AVX512_BF16;
        return cpu_has(AVX512) ? AVX512 : cpu_has(AVX2) ? AVX2 : SCALAR;
    }
    if ((isa == AVX512_BF16 || isa == AMX_BF16) && !(w_dtype == BF16 && x_dtype == BF16)) return AVX512;  // bf16 on both sides
    return Isa(isa);
}

void run_mat(const MatJob& j, int w_dtype, Isa isa) {
#ifdef MOE_X86
    switch (isa) {
        case AVX512_BF16: return mat_bf16(j);
        case AVX512:
            if (w_dtype == BF16) return mat_avx512<uint16_t>(j);
            if (w_dtype == F16) return mat_avx512<Half>(j);
            return mat_avx512<float>(j);
        case AVX2:
            if (w_dtype == BF16) return mat_avx2_pairs(j);  // activations in permute_pairs order
            if (w_dtype == F16) return mat_avx2<Half>(j);
            return mat_avx2<float>(j);
        default: break;
    }
#else
    (void)isa;
#endif
    mat_scalar(j, w_dtype);
}

// ---- thread pool: the caller is thread 0; workers sleep on a condition variable between calls --
class Pool {
public:
    // Runs fn(tid) for tid in [0, n) and returns when all are done. One call at a time.
    void run(int n, const std::function<void(int)>& fn) {
        std::lock_guard<std::mutex> call(call_mutex_);
        if (n <= 1) return fn(0);
        {
            std::lock_guard<std::mutex> lk(m_);
            while (int(started_) < n - 1) {  // grow on demand; workers are detached and live as long as the process
                std::thread(&Pool::worker, this, started_++).detach();
            }
            job_ = &fn;
            want_ = n - 1;
            remaining_ = n - 1;
            generation_++;
        }
        cv_.notify_all();
        fn(0);
        std::unique_lock<std::mutex> lk(m_);
        done_.wait(lk, [&] { return remaining_ == 0; });
        job_ = nullptr;
    }

private:
    void worker(int id) {
        uint64_t seen = 0;
        for (;;) {
            const std::function<void(int)>* job;
            {
                std::unique_lock<std::mutex> lk(m_);
                cv_.wait(lk, [&] { return generation_ != seen; });
                seen = generation_;
                if (id >= want_) continue;  // this call uses fewer threads
                job = job_;
            }
            (*job)(id + 1);
            std::lock_guard<std::mutex> lk(m_);
            if (--remaining_ == 0) done_.notify_one();
        }
    }

    std::mutex call_mutex_, m_;
    std::condition_variable cv_, done_;
    const std::function<void(int)>* job_ = nullptr;
    uint64_t generation_ = 0;
    int want_ = 0, remaining_ = 0, started_ = 0;
};

Pool* g_pool = new Pool;  // never destroyed: detached workers may still wait on it at exit

#ifdef MOE_X86
// A forked child has none of the parent's threads (nor a sane mutex state): start a fresh pool.
struct ForkGuard {
    ForkGuard() { pthread_atfork(nullptr, nullptr, [] { g_pool = new Pool; }); }
} g_fork_guard;
#endif

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

constexpr int64_t RB_ROWS = 32;  // weight rows per work item in both phases (two AMX row blocks)

}  // namespace

// Codes: 0 ok, -1 bad dtype, -2 ISA not supported by this CPU, -3 bad shapes.
API int moe_cpu_isa_supported(int isa) { return isa == AUTO || cpu_has(Isa(isa)); }

API int moe_cpu_resolve_isa(int isa, int w_dtype, int x_dtype) { return resolve(isa, w_dtype, x_dtype); }

// experts [G] expert ids into gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I];
// offsets [G+1]: activations offsets[g]..offsets[g+1] belong to group g; rows [S]: each
// activation's token row in x [N, H]; row_weights [S] fp32; out [N, H] fp32, accumulated into.
API int moe_expert_ffn(int64_t n_groups, const int64_t* experts, const int64_t* offsets,
                       const void* gate_up, const void* down, int w_dtype, int64_t hidden, int64_t inter,
                       const void* x, int x_dtype, const int64_t* rows, const float* row_weights,
                       float* out, int num_threads, int isa_req) {
    if (w_dtype < F32 || w_dtype > F16 || x_dtype < F32 || x_dtype > F16) return -1;
    if (hidden <= 0 || inter <= 0 || n_groups < 0) return -3;
    Isa isa = resolve(isa_req, w_dtype, x_dtype);
    if (!cpu_has(isa)) return -2;
    const int64_t S = n_groups ? offsets[n_groups] : 0, H = hidden, I = inter;
    if (S == 0) return 0;
    int64_t max_t = 0;
    for (int64_t g = 0; g < n_groups; g++) max_t = std::max(max_t, offsets[g + 1] - offsets[g]);
    if (isa == AMX_BF16 && (max_t > AMX_N || H % 32 || I % 32)) isa = AVX512_BF16;  // tiles: K in 32s, 16 tokens
    const size_t wsize = w_dtype == F32 ? 4 : 2;
    const bool bf16 = isa == AVX512_BF16 || isa == AMX_BF16, amx = isa == AMX_BF16;

    // Activations gathered per group: xs [S, H] fp32 (or bf16 for the bf16 paths), h [S, I];
    // for AMX also packed per group: xp [G][H/2][16][2], hp [G][I/2][16][2].
    std::vector<float> xs(bf16 ? 0 : S * H), h(S * I);
    std::vector<uint16_t> xs16(bf16 ? S * H : 0), h16(bf16 ? S * I : 0);
    std::vector<uint16_t> xp(amx ? n_groups * H * AMX_N : 0), hp(amx ? n_groups * I * AMX_N : 0);
    for (int64_t s = 0; s < S; s++) {
        const int64_t src = rows[s] * H;
        if (bf16) std::memcpy(&xs16[s * H], static_cast<const uint16_t*>(x) + src, H * 2);
        else if (x_dtype == F32) std::memcpy(&xs[s * H], static_cast<const float*>(x) + src, H * 4);
        else for (int64_t k = 0; k < H; k++) xs[s * H + k] = load_scalar(x, src + k, x_dtype);
    }
    if (amx)
        for (int64_t g = 0; g < n_groups; g++)
            pack_vnni(&xs16[offsets[g] * H], H, int(offsets[g + 1] - offsets[g]), H, &xp[g * H * AMX_N]);
    const bool pairs = isa == AVX2 && w_dtype == BF16;  // mat_avx2_pairs reads activations pair-split
    if (pairs)
        for (int64_t s = 0; s < S; s++) permute_pairs(&xs[s * H], H);

    // Y [T, RB] = W [nr, K] . X^T for one group: AMX on whole 16-row blocks, the vector path elsewhere.
    auto mat = [&](const char* W, int64_t nr, int64_t K, const void* X, const uint16_t* P, int T, float* Y) {
        int64_t done = 0;
#ifdef MOE_X86
        if (amx) {
            done = nr / 16 * 16;
            if (done) mat_amx(reinterpret_cast<const uint16_t*>(W), K, done, K, P, T, Y, RB_ROWS);
        }
        if (done < nr) {
            run_mat({W + done * K * wsize, K, nr - done, K, X, K, T, Y + done, RB_ROWS}, w_dtype,
                    amx ? AVX512_BF16 : isa);
        }
#else
        (void)P;
        run_mat({W, K, nr, K, X, K, T, Y, RB_ROWS}, w_dtype, isa);
#endif
    };

    // Small calls are not worth waking threads for: ~3 MB of weights per extra thread.
    const double bytes = double(n_groups) * 3 * H * I * wsize;
    const int threads = int(std::max<int64_t>(1, std::min<int64_t>(num_threads, int64_t(bytes / 3e6) + 1)));
    const int64_t iblocks = (I + RB_ROWS - 1) / RB_ROWS, hblocks = (H + RB_ROWS - 1) / RB_ROWS;

    // Phase 1: h[s, i] = silu(gate_e x_s)_i * (up_e x_s)_i over items (group, block of I rows).
    std::atomic<int64_t> next{0};
    g_pool->run(threads, [&](int) {
        if (amx) amx_begin();
        std::vector<float> yg(max_t * RB_ROWS), yu(max_t * RB_ROWS);
        for (int64_t item; (item = next.fetch_add(1)) < n_groups * iblocks;) {
            const int64_t g = item / iblocks, i0 = (item % iblocks) * RB_ROWS, nr = std::min(RB_ROWS, I - i0);
            const int64_t s0 = offsets[g];
            const int T = int(offsets[g + 1] - s0);
            if (T == 0) continue;
            const char* base = static_cast<const char*>(gate_up) + size_t(experts[g]) * 2 * I * H * wsize;
            const void* X = bf16 ? static_cast<const void*>(&xs16[s0 * H]) : &xs[s0 * H];
            const uint16_t* P = amx ? &xp[g * H * AMX_N] : nullptr;
            mat(base + i0 * H * wsize, nr, H, X, P, T, yg.data());
            mat(base + (I + i0) * H * wsize, nr, H, X, P, T, yu.data());
            for (int t = 0; t < T; t++)
                for (int64_t r = 0; r < nr; r++)
                    h[(s0 + t) * I + i0 + r] = silu(yg[t * RB_ROWS + r]) * yu[t * RB_ROWS + r];
        }
        if (amx) amx_end();
    });
    if (bf16)
        for (int64_t i = 0; i < S * I; i++) h16[i] = f32_to_bf16(h[i]);
    if (pairs)
        for (int64_t s = 0; s < S; s++) permute_pairs(&h[s * I], I);
    if (amx)
        for (int64_t g = 0; g < n_groups; g++)
            pack_vnni(&h16[offsets[g] * I], I, int(offsets[g + 1] - offsets[g]), I, &hp[g * I * AMX_N]);

    // Phase 2: out[rows[s], j] += w_s * (down_e h_s)_j over items (block of H output columns), all
    // groups in order inside each item: disjoint columns per thread, a fixed summation order.
    next = 0;
    g_pool->run(threads, [&](int) {
        if (amx) amx_begin();
        std::vector<float> yd(max_t * RB_ROWS);
        for (int64_t item; (item = next.fetch_add(1)) < hblocks;) {
            const int64_t j0 = item * RB_ROWS, nr = std::min(RB_ROWS, H - j0);
            for (int64_t g = 0; g < n_groups; g++) {
                const int64_t s0 = offsets[g];
                const int T = int(offsets[g + 1] - s0);
                if (T == 0) continue;
                const char* base = static_cast<const char*>(down) + size_t(experts[g]) * H * I * wsize;
                const void* X = bf16 ? static_cast<const void*>(&h16[s0 * I]) : &h[s0 * I];
                mat(base + j0 * I * wsize, nr, I, X, amx ? &hp[g * I * AMX_N] : nullptr, T, yd.data());
                for (int t = 0; t < T; t++) {
                    float* o = out + rows[s0 + t] * H + j0;
                    const float w = row_weights[s0 + t];
                    for (int64_t r = 0; r < nr; r++) o[r] += w * yd[t * RB_ROWS + r];
                }
            }
        }
        if (amx) amx_end();
    });
    return 0;
}
