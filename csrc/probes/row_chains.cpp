// How fast one-row bf16 products read their rows from DRAM, by how a row's sum is split into FMA chains: one chain,
// two over the row's halves (x86_tiles.h's tile_avx512), two over its even and odd 16-lane blocks; and a plain read of the
// same bytes. Rows of 4, 8 and 28 KB (704 MB a matrix, three rotated), 2 threads taking blocks of 32 rows from a counter,
// the next row hinted into L2 (8 KB ahead at least, as the walk does), alternated in one process.
// Not part of the library; docs/benchmarks.md ("The AMD changes of the 4th on a Zen 4") uses it:
//   g++ -O3 -fopenmp csrc/probes/row_chains.cpp -o /tmp/row_chains && /tmp/row_chains [ROUNDS] [any: no hints]
#include <immintrin.h>
#include <omp.h>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <vector>
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
enum Mode { ONE, HALVES, EVENODD, PLAIN };
static bool g_pf = true;  // the prefetch hints (off: a second argument)
T512 static inline __m512 w16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
template <Mode M> T512 float row(const uint16_t* W, const uint16_t* P, int64_t len, const float* X) {
    __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    if (M == PLAIN) {
        __m512i s = _mm512_setzero_si512();
        for (int64_t k = 0; k < len; k += 32) s = _mm512_add_epi16(s, _mm512_loadu_si512(W + k));
        return float(_mm512_reduce_add_epi32(s));
    }
    if (M == ONE) {
        for (int64_t k = 0; k < len; k += 16) {
            if (g_pf) _mm_prefetch((const char*)(P + k), _MM_HINT_T1);
            a = _mm512_fmadd_ps(w16(W + k), _mm512_loadu_ps(X + k), a);
        }
    } else if (M == HALVES) {
        const int64_t h = len / 32 * 16;
        for (int64_t k = 0; k < h; k += 16) {
            if (g_pf) _mm_prefetch((const char*)(P + k), _MM_HINT_T1);
            if (g_pf) _mm_prefetch((const char*)(P + h + k), _MM_HINT_T1);
            a = _mm512_fmadd_ps(w16(W + k), _mm512_loadu_ps(X + k), a);
            b = _mm512_fmadd_ps(w16(W + h + k), _mm512_loadu_ps(X + h + k), b);
        }
    } else {
        for (int64_t k = 0; k < len; k += 32) {
            if (g_pf) _mm_prefetch((const char*)(P + k), _MM_HINT_T1);
            a = _mm512_fmadd_ps(w16(W + k), _mm512_loadu_ps(X + k), a);
            b = _mm512_fmadd_ps(w16(W + k + 16), _mm512_loadu_ps(X + k + 16), b);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}
template <Mode M> double run(const std::vector<uint16_t*>& mats, int64_t rows, int64_t len, const float* X, float* Y) {
    auto t0 = std::chrono::steady_clock::now();
    const int64_t lead = std::max<int64_t>(1, 8192 / (len * 2));
    for (auto* W : mats) {
        std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(2)
        for (int64_t blk; (blk = next.fetch_add(1)) * 32 < rows;)
            for (int64_t r = blk * 32; r < std::min(rows, blk * 32 + 32); r++)
                Y[r] = row<M>(W + r * len, W + std::min(rows - 1, r + lead) * len, len, X);
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return double(mats.size()) * rows * len * 2 / s / 1e9;
}
int main(int argc, char** argv) {
    g_pf = argc < 3;
    const int64_t bytes = 704LL << 20;
    for (int64_t len : {2048, 4096, 14336}) {
        const int64_t rows = bytes / (len * 2);
        std::vector<uint16_t*> mats;
        for (int i = 0; i < 3; i++) {
            auto* m = static_cast<uint16_t*>(aligned_alloc(64, rows * len * 2));
            for (int64_t j = 0; j < rows * len; j++) m[j] = uint16_t(0x3f80 + (j & 63));
            mats.push_back(m);
        }
        std::vector<float> X(len, 0.5f), Y(rows);
        const char* names[] = {"one chain", "halves", "even/odd", "plain"};
        std::vector<double> g[4];
        for (int rnd = 0; rnd < (argc > 1 ? atoi(argv[1]) : 5); rnd++) {
            int order[4] = {0, 1, 2, 3};
            if (rnd % 2) std::swap(order[0], order[3]), std::swap(order[1], order[2]);
            for (int o : order) {
                double (*const modes[])(const std::vector<uint16_t*>&, int64_t, int64_t, const float*, float*) = {
                    run<ONE>, run<HALVES>, run<EVENODD>, run<PLAIN>};
                g[o].push_back(modes[o](mats, rows, len, X.data(), Y.data()));
            }
        }
        printf("len %5ld (%5ld B rows):", long(len), long(len * 2));
        for (int o = 0; o < 4; o++) {
            printf("  %s", names[o]);
            for (double v : g[o]) printf(" %.1f", v);
        }
        printf("\n");
        for (auto* m : mats) free(m);
    }
}
