// How fast two threads read 704 MB from DRAM by how the work is handed out: blocks of 4 KB or 128 KB (32 rows of 4 KB,
// what the bf16 kernels took from one shared counter before pool.h's Items) taken in turn from a shared counter, 1 MB
// stretches likewise, or each thread its own half; with a software prefetch 4 KB ahead or none. Plain loads, nothing
// computed: what the access pattern alone costs. A second argument madvises the buffer into huge pages.
// Not part of the library; docs/benchmarks.md ("Runs of rows") uses it:
//   g++ -O3 -fopenmp csrc/probes/read_runs.cpp -o /tmp/read_runs && /tmp/read_runs [ROUNDS] [huge]
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
// AVX2 loads, so the probe runs on every x86-64 this project has met (a Zen 2 has no AVX-512); reads are the bound.
__attribute__((target("avx2"))) static int64_t sum(const char* p, int64_t n, int pf) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (int64_t i = 0; i < n; i += 128) {
        if (pf)
            for (int j = 0; j < 128; j += 64) _mm_prefetch(p + i + pf + j, _MM_HINT_T0);
        a = _mm256_add_epi32(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
        b = _mm256_add_epi32(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
        c = _mm256_add_epi32(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
        d = _mm256_add_epi32(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
    }
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d)));
    int64_t total = 0;
    for (int32_t v : lanes) total += v;
    return total;
}
int main(int argc, char** argv) {
    const int64_t N = 704ll << 20;
    char* buf = static_cast<char*>(aligned_alloc(1 << 21, N));
    if (argc > 2) madvise(buf, N, MADV_HUGEPAGE);
    memset(buf, 1, N);
    const int64_t chunks[] = {4096, 32 * 4096, 1 << 20, N / 2};
    volatile int64_t sink = 0;
    for (int r = 0; r < (argc > 1 ? atoi(argv[1]) : 3); ++r) {
        for (int64_t ch : chunks)
            for (int pf : {0, 4096}) {
                auto t0 = std::chrono::steady_clock::now();
                std::atomic<int64_t> next{0};
                int64_t total = 0;
#pragma omp parallel num_threads(2) reduction(+ : total)
                {
                    if (ch == N / 2) total += sum(buf + omp_get_thread_num() * ch, ch, pf);  // each thread its own half
                    else
                        for (int64_t b; (b = next.fetch_add(1)) * ch < N;) total += sum(buf + b * ch, ch, pf);
                }
                sink = sink + total;
                const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
                printf("%-10s prefetch %4d: %.1f GB/s\n",
                       ch == N / 2 ? "halves" : ch == 4096 ? "4 KB" : ch == (1 << 20) ? "1 MB" : "128 KB", pf, N / s / 1e9);
            }
    }
}
