// How fast a one-token bf16 product reads its weights with four rows side by side (four streams a thread: the experts'
// 4-row AVX-512 tile, x86_tiles.h, and the decode linears' dot4, decode_body.h) against one row at a time (one stream),
// beside llama.cpp's BF16 dot (vdpbf16ps, activations rounded to bf16, one row at a time) and a plain read: 2 threads,
// 40 matrices of 4096 x 2048 (670 MB, past any cache), alternated in one process so the VM's memory phases hit all alike.
// Not part of the library; docs/benchmarks.md ("... one weight row at a time on Zen 5") uses it:
//   g++ -O3 -fopenmp csrc/probes/row_streams.cpp -o /tmp/row_streams && OMP_WAIT_POLICY=ACTIVE /tmp/row_streams
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define AVX2 __attribute__((target("avx2,fma")))
#define Z __attribute__((target("avx512f,avx512bw,avx512bf16")))
constexpr int64_t R = 4096, K = 2048, MATS = 40;
enum Mode { DOT4, YMM_ROW, TILE4, TILE1, GGML, PLAIN };

AVX2 static inline __m256 widen8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

AVX2 void dot4(const float* x, const uint16_t* w, float* y) {  // decode_body.h dot4: 4 rows, 2 chains each, next 4 into L2
    __m256 lo[4], hi[4];
    for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < K; i += 16)
        for (int j = 0; j < 4; j++) {
            __builtin_prefetch(w + (4 + j) * K + i, 0, 2);
            lo[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), widen8(w + j * K + i), lo[j]);
            hi[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), widen8(w + j * K + i + 8), hi[j]);
        }
    for (int j = 0; j < 4; j++) {
        float t[8];
        _mm256_storeu_ps(t, _mm256_add_ps(lo[j], hi[j]));
        y[j] = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
    }
}

AVX2 void ymm_row(const float* x, const uint16_t* w, float* y) {  // decode_body.h dot: one row, the same 2 chains
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t i = 0; i < K; i += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), widen8(w + i), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), widen8(w + i + 8), hi);
    }
    float t[8];
    _mm256_storeu_ps(t, _mm256_add_ps(lo, hi));
    *y = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}

template <int RR> Z void tile(const uint16_t* w, const float* x, float* y) {  // x86_tiles.h tile_avx512<uint16_t, RR, 1>
    __m512 acc[RR];
    for (int r = 0; r < RR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 v[RR];
        for (int r = 0; r < RR; r++) {
            _mm_prefetch(reinterpret_cast<const char*>(w + (RR + r) * K + k), _MM_HINT_T1);  // the next RR rows
            const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + r * K + k)));
            v[r] = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
        }
        const __m512 xv = _mm512_loadu_ps(x + k);
        for (int r = 0; r < RR; r++) acc[r] = _mm512_fmadd_ps(v[r], xv, acc[r]);
    }
    for (int r = 0; r < RR; r++) y[r] = _mm512_reduce_add_ps(acc[r]);
}

Z void ggml_row(const uint16_t* xb, const uint16_t* w, float* y) {  // ggml_vec_dot_bf16 on AVX512-BF16
    __m512 c1 = _mm512_setzero_ps(), c2 = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; i += 64) {
        c1 = _mm512_dpbf16_ps(c1, (__m512bh)_mm512_loadu_si512(xb + i), (__m512bh)_mm512_loadu_si512(w + i));
        c2 = _mm512_dpbf16_ps(c2, (__m512bh)_mm512_loadu_si512(xb + i + 32), (__m512bh)_mm512_loadu_si512(w + i + 32));
    }
    *y = _mm512_reduce_add_ps(_mm512_add_ps(c1, c2));
}

Z void plain_row(const uint16_t* w, float* y) {  // the same bytes summed as integers: no widening, no product
    __m512i s = _mm512_setzero_si512();
    for (int64_t i = 0; i < K; i += 32) s = _mm512_add_epi16(s, _mm512_loadu_si512(w + i));
    *y = float(_mm512_reduce_add_epi32(s));
}

template <Mode M> double gbps(const uint16_t* w, const float* x, const uint16_t* xb, float* y) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t m = 0; m < MATS; m++) {
        const uint16_t* wm = w + m * R * K;
#pragma omp parallel for num_threads(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < R / 32; b++)  // items of 32 rows, as the experts kernel's
            for (int64_t r = 32 * b; r < 32 * b + 32; r += (M == DOT4 || M == TILE4) ? 4 : 1) {
                if (M == DOT4) dot4(x, wm + r * K, y + r);
                if (M == YMM_ROW) ymm_row(x, wm + r * K, y + r);
                if (M == TILE4) tile<4>(wm + r * K, x, y + r);
                if (M == TILE1) tile<1>(wm + r * K, x, y + r);
                if (M == GGML) ggml_row(xb, wm + r * K, y + r);
                if (M == PLAIN) plain_row(wm + r * K, y + r);
            }
    }
    return MATS * R * K * 2.0 / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
}

int main() {
    uint16_t* w = static_cast<uint16_t*>(aligned_alloc(64, MATS * R * K * 2));
    for (int64_t i = 0; i < MATS * R * K; i++) w[i] = uint16_t(0x3f80 + (i & 7));
    std::vector<float> x(K, 0.5f), y(R);
    std::vector<uint16_t> xb(K, 0x3f00);
    for (int r = 0; r < 10; r++)
        printf("GB/s: dot4 (4 rows) %.1f | dot (1 row) %.1f | tile 4 rows %.1f | tile 1 row %.1f | llama.cpp's dot %.1f | "
               "plain read %.1f\n",
               gbps<DOT4>(w, x.data(), xb.data(), y.data()), gbps<YMM_ROW>(w, x.data(), xb.data(), y.data()),
               gbps<TILE4>(w, x.data(), xb.data(), y.data()), gbps<TILE1>(w, x.data(), xb.data(), y.data()),
               gbps<GGML>(w, x.data(), xb.data(), y.data()), gbps<PLAIN>(w, x.data(), xb.data(), y.data()));
}
