// How fast a bf16 matrix-vector product reads its weights, against a plain read of the same bytes: the decode ops'
// pattern (decode_body.h dot4: 4 rows at once, the next 4 prefetched into L2) and variants of it, 2 threads, 40
// matrices of 4096 x 2048 (670 MB, past any cache), alternated in one process so the VM's memory phases hit all alike.
// Not part of the library; docs/benchmarks.md ("A Zen 5: side by side, the kernels and where a bf16 token goes") uses it:
//   g++ -O3 -fopenmp csrc/probes/matvec_read.cpp -o /tmp/matvec_read && /tmp/matvec_read
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define AVX2 __attribute__((target("avx2,fma")))
constexpr int64_t R = 4096, K = 2048, MATS = 40;
enum Mode { DOT4_L2, DOT4_L1, DOT4_NONE, ONE_STREAM, PLAIN_READ };

AVX2 static inline __m256 widen8(const uint16_t* p) {  // 8 bf16 -> fp32, as decode_body.h's load8
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

template <Mode M> AVX2 void quad(const float* x, const uint16_t* w, float* y) {  // rows w[0..4) · x
    __m256 lo[4], hi[4];
    for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_ps();
    if (M == PLAIN_READ) {  // the same bytes summed as integers: no widening, no product
        __m256i s = _mm256_setzero_si256();
        for (int64_t i = 0; i < 4 * K; i += 16) s = _mm256_add_epi16(s, _mm256_loadu_si256((const __m256i*)(w + i)));
        y[0] = float(_mm256_extract_epi16(s, 0));
        return;
    }
    for (int j0 = 0; j0 < (M == ONE_STREAM ? 4 : 1); j0++)
        for (int64_t i = 0; i < K; i += 16)
            for (int j = (M == ONE_STREAM ? j0 : 0); j < (M == ONE_STREAM ? j0 + 1 : 4); j++) {
                if ((i & 31) == 0) {  // once per 64-byte line
                    if (M == DOT4_L2) _mm_prefetch((const char*)(w + (4 + j) * K + i), _MM_HINT_T1);
                    if (M == DOT4_L1) _mm_prefetch((const char*)(w + (4 + j) * K + i), _MM_HINT_T0);
                    if (M == ONE_STREAM) _mm_prefetch((const char*)(w + j * K + i) + 2048, _MM_HINT_T0);
                }
                lo[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), widen8(w + j * K + i), lo[j]);
                hi[j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), widen8(w + j * K + i + 8), hi[j]);
            }
    for (int j = 0; j < 4; j++) {
        float t[8];
        _mm256_storeu_ps(t, _mm256_add_ps(lo[j], hi[j]));
        y[j] = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
    }
}

template <Mode M> double gbps(const uint16_t* w, const float* x, float* y) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t m = 0; m < MATS; m++)
#pragma omp parallel for num_threads(2) schedule(dynamic, 16)
        for (int64_t q = 0; q < R / 4; q++) quad<M>(x, w + (m * R + 4 * q) * K, y + 4 * q);
    return MATS * R * K * 2.0 / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
}

int main() {
    uint16_t* w = static_cast<uint16_t*>(aligned_alloc(64, MATS * R * K * 2));
    for (int64_t i = 0; i < MATS * R * K; i++) w[i] = uint16_t(0x3f80 + (i & 7));
    std::vector<float> x(K, 0.5f), y(R);
    for (int r = 0; r < 8; r++)
        printf("GB/s: dot4, next rows into L2 %.1f | into L1 %.1f | no prefetch %.1f | one row at a time %.1f | plain read %.1f\n",
               gbps<DOT4_L2>(w, x.data(), y.data()), gbps<DOT4_L1>(w, x.data(), y.data()), gbps<DOT4_NONE>(w, x.data(), y.data()),
               gbps<ONE_STREAM>(w, x.data(), y.data()), gbps<PLAIN_READ>(w, x.data(), y.data()));
}
