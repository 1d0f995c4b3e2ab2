// The x86 paths of the matrix-times-tokens job: AVX-512F, AVX-512 BF16, AMX-BF16 and AVX2+FMA, each
// compiled for its own target (function attributes), so the library runs on any x86-64 CPU and the
// dispatcher (expert_ffn.cpp) picks what this one has at run time.
#pragma once

#include "common.h"

#include <utility>

namespace {

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

// R rows x TC tokens over columns [k0, k1), k1 - k0 a multiple of 16 but at the row's end (a masked tail): acc +=
// W[r, k0:k1] · X[t, k0:k1], one chain of 16 lanes per (row, token) in column order.
template <typename WT, int R, int TC>
AVX512_TARGET inline void chain_avx512(__m512 (&acc)[R][TC], const WT* W, const WT* P, int64_t ldw, int64_t k0, int64_t k1,
                                       const float* X, int64_t ldx) {
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16) {
        __m512 w[R];
        for (int r = 0; r < R; r++) {
            // the next rows (P: the walk's, past the job's end its `next`), as far ahead as the walk chose: each row is its
            // own short stream (2-4 KB), too short for the hardware prefetcher to ramp up on before it ends; a hint past
            // the matrix's end does not fault. Into L2 (T1), not L1: an L1 prefetch holds one of the core's few L1 miss
            // buffers until its line arrives, which capped a core's stream well below DRAM's (docs/benchmarks.md,
            // "Prefetching into L2")
            _mm_prefetch(reinterpret_cast<const char*>(P + r * ldw + k), _MM_HINT_T1);
            w[r] = w16<WT>(W + r * ldw + k);
        }
        for (int t = 0; t < TC; t++) {
            __m512 x = _mm512_loadu_ps(X + t * ldx + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(w[r], x, acc[r][t]);
        }
    }
    if (k < k1) {  // tail: masked loads read nothing past the row
        __mmask16 m = __mmask16((1u << (k1 - k)) - 1);
        __m512 w[R];
        for (int r = 0; r < R; r++) w[r] = w16m<WT>(W + r * ldw + k, m);
        for (int t = 0; t < TC; t++) {
            __m512 x = _mm512_maskz_loadu_ps(m, X + t * ldx + k);
            for (int r = 0; r < R; r++) acc[r][t] = _mm512_fmadd_ps(w[r], x, acc[r][t]);
        }
    }
}

// Each (row, token) sums its row's two halves as two chains, A over [0, h) and B over [h, len) with h = 16·⌊len/32⌋, and
// writes reduce(A + B), whatever R and TC: one FMA chain a row ran at 63 GB/s from L3 on Zen 5 (its 4-cycle latency per
// 16 lanes), two at 90, and a fast DRAM phase reads 86 (docs/benchmarks.md, "Two chains a row"). One row a tile runs both
// halves side by side; R rows a tile hold R·TC accumulators, so run the halves one after the other.
template <typename WT, int R, int TC>
AVX512_TARGET void tile_avx512(const WT* W, const WT* P, int64_t ldw, int64_t len, const float* X, int64_t ldx, float* Y,
                               int64_t ldy) {
    const int64_t h = len / 32 * 16;
    __m512 a[R][TC], b[R][TC];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) a[r][t] = b[r][t] = _mm512_setzero_ps();
    if constexpr (R == 1) {
        for (int64_t k = 0; k < h; k += 16) {
            _mm_prefetch(reinterpret_cast<const char*>(P + k), _MM_HINT_T1);  // as chain_avx512, both halves
            _mm_prefetch(reinterpret_cast<const char*>(P + h + k), _MM_HINT_T1);
            const __m512 w0 = w16<WT>(W + k), w1 = w16<WT>(W + h + k);
            for (int t = 0; t < TC; t++) {
                a[0][t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(X + t * ldx + k), a[0][t]);
                b[0][t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(X + t * ldx + h + k), b[0][t]);
            }
        }
        chain_avx512<WT, R, TC>(b, W, P, ldw, 2 * h, len, X, ldx);  // B's blocks past 2h and the tail
    } else {
        chain_avx512<WT, R, TC>(a, W, P, ldw, 0, h, X, ldx);
        chain_avx512<WT, R, TC>(b, W, P, ldw, h, len, X, ldx);
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) Y[t * ldy + r] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][t], b[r][t]));
}

// ---- AVX-512 BF16: vdpbf16ps multiplies 32 bf16 pairs into 16 fp32 sums per instruction -------
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

template <int R, int TC>
BF16_TARGET void tile_bf16(const uint16_t* W, const uint16_t* P, int64_t ldw, int64_t len, const uint16_t* X, int64_t ldx,
                           float* Y, int64_t ldy) {
    __m512 acc[R][TC];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) acc[r][t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= len; k += 32) {  // unmasked: a per-iteration mask keeps GCC from holding acc in registers
        __m512i w[R];
        for (int r = 0; r < R; r++) {
            _mm_prefetch(reinterpret_cast<const char*>(P + r * ldw + k), _MM_HINT_T1);  // as tile_avx512
            w[r] = _mm512_loadu_si512(W + r * ldw + k);
        }
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

// ---- AVX2 + FMA: 8 lanes, 16 ymm registers -------------------------------------------------------
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
AVX2_TARGET void tile_avx2(const WT* W, const WT* P, int64_t ldw, int64_t len, const float* X, int64_t ldx, float* Y,
                           int64_t ldy) {
    __m256 acc[R][TC];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) acc[r][t] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= len; k += 8) {
        __m256 w[R];
        for (int r = 0; r < R; r++) {
            _mm_prefetch(reinterpret_cast<const char*>(P + r * ldw + k), _MM_HINT_T1);  // as tile_avx512
            w[r] = w8<WT>(W + r * ldw + k);
        }
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


// bf16 weights on AVX2, without widening each 8 of them: one 256-bit load holds 16 bf16 = 8 pairs;
// the even ones become fp32 by a shift, the odd ones by masking off the low half. Activations are
// laid out to match (permute_pairs: per 16-block, the 8 even entries, then the 8 odd ones), so a
// block costs 2 ALU ops for 16 weights instead of 2 widening loads + 2 shifts.
// Each 16 columns: the even halves of all R rows, then the odd (the row's 32 bytes loaded again, from L1), so only 8
// activations per token stay in registers. Activations as FMA memory operands, one load per product, had capped it at the load
// ports' 2 a cycle (docs/benchmarks.md, "The AVX2 kernels at 2-9 tokens"). A (row, token) chain sums even, odd,
// even, ... in column order either way: the same bits.
template <int R, int TC>
AVX2_TARGET void tile_avx2_pairs(const uint16_t* W, const uint16_t* P, int64_t ldw, int64_t len, const float* X,
                                 int64_t ldx, float* Y, int64_t ldy) {
    const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
    __m256 acc[R][TC];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) acc[r][t] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= len; k += 16) {
        __m256 x[TC];
        for (int t = 0; t < TC; t++) x[t] = _mm256_loadu_ps(X + t * ldx + k);
        for (int r = 0; r < R; r++) {
            _mm_prefetch(reinterpret_cast<const char*>(P + r * ldw + k), _MM_HINT_T1);  // as tile_avx512
            const __m256i w = _mm256_loadu_si256((const __m256i*)(W + r * ldw + k));
            const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
            for (int t = 0; t < TC; t++) acc[r][t] = _mm256_fmadd_ps(even, x[t], acc[r][t]);
        }
        for (int t = 0; t < TC; t++) x[t] = _mm256_loadu_ps(X + t * ldx + k + 8);
        for (int r = 0; r < R; r++) {
            const __m256i w = _mm256_loadu_si256((const __m256i*)(W + r * ldw + k));
            const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
            for (int t = 0; t < TC; t++) acc[r][t] = _mm256_fmadd_ps(odd, x[t], acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TC; t++) {
            float s = hsum8(acc[r][t]);
            for (int64_t kk = k; kk < len; kk++) s += bf16_to_f32(W[r * ldw + kk]) * X[t * ldx + kk];  // tail: natural order
            Y[t * ldy + r] = s;
        }
}

// ---- the row/token walk every vector path shares ------------------------------------------------
constexpr int64_t ONE_ROW_LEAD_BYTES = 8192;  // 8 KB: the experts 13 % faster on Zen 5 than one row ahead; 16 KB less
// A family's tile<R, TC> computes Y for R weight rows x TC tokens with all accumulators in registers;
// the walk takes blocks of R rows (single rows at the tail) by chunks of up to TCMAX tokens.
template <typename Family, int R, int... I>
void walk(const MatJob& j, std::integer_sequence<int, I...>) {
    using WT = typename Family::W;
    using XT = typename Family::X;
    using Tile = void (*)(const WT*, const WT*, int64_t, int64_t, const XT*, int64_t, float*, int64_t);
    constexpr int TCMAX = sizeof...(I);
    static const Tile block[TCMAX] = {Family::template tile<R, I + 1>...};
    static const Tile single[TCMAX] = {Family::template tile<1, I + 1>...};
    const WT *W = static_cast<const WT*>(j.W), *next = static_cast<const WT*>(j.next);
    const XT* X = static_cast<const XT*>(j.X);
    // one row a tile hints the row ONE_ROW_LEAD_BYTES ahead (at least the next): an expert's down row of 1.5 KB hinted
    // one row ahead arrived late (docs/benchmarks.md, "bf16 decode at parity on Zen 5"); R rows a tile, the next R
    const int64_t lead = R > 1 ? R : std::max<int64_t>(1, ONE_ROW_LEAD_BYTES / int64_t(j.len * sizeof(WT)));
    const int per_pass = even_pass_tokens(j.T, TCMAX);
    for (int64_t r = 0; r < j.rows;) {
        const bool full = r + R <= j.rows;
        const int64_t ahead = r + (full ? lead : 1);  // the first row the tile prefetches: past the end, the next job's
        const WT* P = next && ahead >= j.rows ? next + (ahead - j.rows) * j.ldw : W + ahead * j.ldw;
        for (int t = 0; t < j.T; t += per_pass) {
            const int tc = std::min(per_pass, j.T - t);
            (full ? block : single)[tc - 1](W + r * j.ldw, P, j.ldw, j.len, X + t * j.ldx, j.ldx, j.Y + t * j.ldy + r, j.ldy);
        }
        r += full ? R : 1;
    }
}

template <typename Family, int R, int TCMAX>
void walk(const MatJob& j) { walk<Family, R>(j, std::make_integer_sequence<int, TCMAX>{}); }

template <typename WT> struct Avx512 {
    using W = WT;
    using X = float;
    template <int R, int TC> static constexpr auto tile = tile_avx512<WT, R, TC>;
};
struct Avx512Bf16 {
    using W = uint16_t;
    using X = uint16_t;
    template <int R, int TC> static constexpr auto tile = tile_bf16<R, TC>;
};
template <typename WT> struct Avx2 {
    using W = WT;
    using X = float;
    template <int R, int TC> static constexpr auto tile = tile_avx2<WT, R, TC>;
};
struct Avx2Pairs {  // bf16 weights, activations in permute_pairs order
    using W = uint16_t;
    using X = float;
    template <int R, int TC> static constexpr auto tile = tile_avx2_pairs<R, TC>;
};

// Registers: AVX-512 4 rows x 6 tokens = 24 accumulators + 4 weights + 1 token of 32 zmm; AVX2 2 x 6
// = 12 + 2 + 1 of 16 ymm (pairs: 4 x 3 = 12 + 3 tokens' halves + 1 weight half + the mask, one over: GCC
// reads some activations as operands).
// up to moe_rows::one_row_tokens() tokens one row a tile (the same bits: each row's chain runs alone either way)
template <typename WT> void mat_avx512(const MatJob& j) {
    if (j.T <= moe_rows::one_row_tokens()) return walk<Avx512<WT>, 1, 6>(j);
    walk<Avx512<WT>, 4, 6>(j);
}
inline void mat_bf16(const MatJob& j) {
    if (j.T <= moe_rows::one_row_tokens()) return walk<Avx512Bf16, 1, 6>(j);
    walk<Avx512Bf16, 4, 6>(j);
}
template <typename WT> void mat_avx2(const MatJob& j) { walk<Avx2<WT>, 2, 6>(j); }
inline void mat_avx2_pairs(const MatJob& j) { walk<Avx2Pairs, 4, 3>(j); }

#else  // not x86: the AMX helpers the driver names, never called (cpu_has says no)
constexpr int AMX_N = 16;
inline void amx_begin() {}
inline void amx_end() {}
inline void pack_vnni(const uint16_t*, int64_t, int, int64_t, uint16_t*) {}
#endif  // MOE_X86

}  // namespace
