// The arithmetic floor of the int4 VNNI kernel (csrc/cpu/quant_tiles.h: qgroup_vnni<4, TC>): its instruction mix per
// block of 16 rows x 32 columns with every operand in registers, so no memory stall counts: per block 4 and + 4 shift
// (the nibbles), per token 8 vpdpbusd into one chain, then cvt, mul (d * dx), fma (scale) and fma (minimum).
// Not part of the library; docs/benchmarks.md ("int4 at 1-9 tokens against its arithmetic floor") uses it:
//   g++ -O3 csrc/probes/vnni_floor.cpp -o /tmp/vnni_floor && /tmp/vnni_floor
// A call's floor: (rows / 16) x (columns / 32) x tokens x experts x the printed ns, over the threads.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
template <int TC>
__attribute__((target("avx512f,avx512bw,avx512vnni,fma"), noinline)) double run(long blocks, const int* xs, const float* sc) {
    __m512 acc[TC]; for (int t = 0; t < TC; t++) acc[t] = _mm512_setzero_ps();
    __m512i w = _mm512_set1_epi32(0x05060708), low = _mm512_set1_epi8(0x0F);
    __m512 d = _mm512_set1_ps(0.01f), mn = _mm512_set1_ps(-0.02f);
    auto t0 = std::chrono::steady_clock::now();
    for (long b = 0; b < blocks; b++) {
        __m512i u[8];
        for (int v = 0; v < 4; v++) { __m512i x = _mm512_add_epi32(w, _mm512_set1_epi32(v + (int)b)); u[2*v] = _mm512_and_si512(x, low); u[2*v+1] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low); }
        __m512i dot[TC];
        for (int t = 0; t < TC; t++) dot[t] = _mm512_setzero_si512();
        for (int i = 0; i < 8; i++)
            for (int t = 0; t < TC; t++) dot[t] = _mm512_dpbusd_epi32(dot[t], u[i], _mm512_set1_epi32(xs[8 * t + i]));
        for (int t = 0; t < TC; t++) {
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_mul_ps(d, _mm512_set1_ps(sc[2 * t])), acc[t]);
            acc[t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sc[2 * t + 1]), acc[t]);
        }
        asm volatile("" : : "r"(xs), "r"(sc) : "memory");
    }
    double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    __m512 s = _mm512_setzero_ps(); for (int t = 0; t < TC; t++) s = _mm512_add_ps(s, acc[t]);
    volatile float sink = _mm512_reduce_add_ps(s); (void)sink;
    return ns / blocks / TC;  // per token and block
}
int main() {
    alignas(64) int xs[128]; alignas(64) float sc[32];
    for (int i = 0; i < 128; i++) xs[i] = 0x01020304 + i; for (int i = 0; i < 32; i++) sc[i] = 0.5f + i;
    for (int r = 0; r < 3; r++)
        printf("ns per token and block: 1 token %.2f, 5 tokens %.2f, 9 tokens %.2f\n", run<1>(20000000, xs, sc), run<5>(10000000, xs, sc), run<9>(5000000, xs, sc));
}
