// The arithmetic floor of the AVX2 quantized kernels (csrc/cpu/quant_tiles.h: qgroup_avx2<BITS, TC>): their instruction
// mix per block of 16 rows x 32 columns, every operand in registers, so no memory stall counts. Per 8-row half and
// token, int4: 8 pmaddubsw summed in int16, one pmaddwd; int8: 8 x (psignb, pmaddubsw, pmaddwd, add). Then per half and
// token cvt, mul (d * dx), fma (scale) and, for int4, fma (minimum). The nibbles are unpacked once per block.
// Not part of the library; docs/benchmarks.md ("The AVX2 kernels at their multiply floor") uses it:
//   g++ -O3 csrc/probes/avx2_floor.cpp -o /tmp/avx2_floor && /tmp/avx2_floor
// A call's floor: (rows / 16) x (columns / 32) x tokens x experts x the printed ns, over the threads.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
template <int BITS, int TC>
__attribute__((target("avx2,fma"), noinline)) double run(long blocks, const int* xs, const float* sc) {
    __m256 acc[TC][2];
    for (int t = 0; t < TC; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    const __m256i w0 = _mm256_set1_epi32(0x05060708), low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256 d = _mm256_set1_ps(0.01f), mn = _mm256_set1_ps(-0.02f);
    auto t0 = std::chrono::steady_clock::now();
    for (long b = 0; b < blocks; b++) {
        for (int h = 0; h < 2; h++) {
            __m256i dot[TC];
            if (BITS == 4) {
                __m256i s16[TC];
                for (int t = 0; t < TC; t++) s16[t] = _mm256_setzero_si256();
                for (int v = 0; v < 4; v++) {
                    const __m256i w = _mm256_add_epi32(w0, _mm256_set1_epi32(v + (int)b + h));
                    const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                    for (int t = 0; t < TC; t++) {
                        s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xs[8 * t + 2 * v])));
                        s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xs[8 * t + 2 * v + 1])));
                    }
                }
                for (int t = 0; t < TC; t++) dot[t] = _mm256_madd_epi16(s16[t], ones);
            } else {
                for (int t = 0; t < TC; t++) dot[t] = _mm256_setzero_si256();
                for (int i = 0; i < 8; i++) {
                    const __m256i w = _mm256_add_epi32(w0, _mm256_set1_epi32(i + (int)b + h)), aw = _mm256_sign_epi8(w, w);
                    for (int t = 0; t < TC; t++) {
                        const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(xs[8 * t + i]), w);
                        dot[t] = _mm256_add_epi32(dot[t], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, x), ones));
                    }
                }
            }
            for (int t = 0; t < TC; t++) {
                acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(d, _mm256_set1_ps(sc[2 * t])), acc[t][h]);
                if (BITS == 4) acc[t][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sc[2 * t + 1]), acc[t][h]);
            }
        }
        asm volatile("" : : "r"(xs), "r"(sc) : "memory");
    }
    double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    __m256 s = _mm256_setzero_ps();
    for (int t = 0; t < TC; t++) s = _mm256_add_ps(s, _mm256_add_ps(acc[t][0], acc[t][1]));
    alignas(32) float out[8];
    _mm256_store_ps(out, s);
    volatile float sink = out[0]; (void)sink;
    return ns / blocks / TC;  // per token and block
}
// A lone instruction's cost: 12 independent chains of pmaddubsw (OP 0) or pmaddwd (OP 1).
template <int OP>
__attribute__((target("avx2,fma"), noinline)) double chain(long n) {
    __m256i a[12]; for (int i = 0; i < 12; i++) a[i] = _mm256_set1_epi16(i);
    const __m256i b = _mm256_set1_epi8(1);
    auto t0 = std::chrono::steady_clock::now();
    for (long k = 0; k < n; k++)
        for (int i = 0; i < 12; i++) {
            a[i] = OP == 0 ? _mm256_maddubs_epi16(a[i], b) : _mm256_madd_epi16(a[i], b);
            asm volatile("" : "+x"(a[i]));
        }
    double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    volatile int sink = _mm256_extract_epi32(a[0], 0) + _mm256_extract_epi32(a[11], 0); (void)sink;
    return ns / n / 12;
}
int main() {
    alignas(64) int xs[128]; alignas(64) float sc[32];
    for (int i = 0; i < 128; i++) xs[i] = 0x01020304 + i;
    for (int i = 0; i < 32; i++) sc[i] = 0.5f + i;
    for (int r = 0; r < 3; r++) {
        printf("ns per instruction: pmaddubsw %.2f, pmaddwd %.2f\n", chain<0>(20000000), chain<1>(20000000));
        printf("int4 ns per token and block: 1 token %.2f, 2 tokens %.2f, 4 tokens %.2f\n", run<4, 1>(10000000, xs, sc),
               run<4, 2>(5000000, xs, sc), run<4, 4>(2500000, xs, sc));
        printf("int8 ns per token and block: 1 token %.2f, 2 tokens %.2f, 4 tokens %.2f\n", run<8, 1>(10000000, xs, sc),
               run<8, 2>(5000000, xs, sc), run<8, 4>(2500000, xs, sc));
    }
}
