// What one core of an AVX2 CPU does: its clock under load (a chain of dependent vpaddd, one a cycle), how many of each
// multiply instruction it issues a cycle, and the library's AVX2 kernels (bf16 tile walk, int8/int6/int4 groups) in
// multiply-adds a cycle at 1-9 tokens with their weights in L2, so that memory is not what bounds them.
// Not part of the library; docs/benchmarks.md ("The AVX2 kernels at 2-9 tokens: the load ports and the compiler") uses it:
//   g++ -O3 -std=c++20 csrc/probes/avx2_rates.cpp -o /tmp/avx2_rates && /tmp/avx2_rates
#include "../cpu/quant_tiles.h"
#include "../cpu/x86_tiles.h"

#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

constexpr long long REP = 200000000;

template <typename F> double seconds(F f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// 8 independent chains of one instruction, 64 a loop: the issue rate (latency 5 / 8 chains caps vfmadd231ps at 1.6)
#define EIGHT(ins) ins " %%ymm8, %%ymm0, %%ymm0\n" ins " %%ymm8, %%ymm1, %%ymm1\n" ins " %%ymm8, %%ymm2, %%ymm2\n" \
    ins " %%ymm8, %%ymm3, %%ymm3\n" ins " %%ymm8, %%ymm4, %%ymm4\n" ins " %%ymm8, %%ymm5, %%ymm5\n"                 \
    ins " %%ymm8, %%ymm6, %%ymm6\n" ins " %%ymm8, %%ymm7, %%ymm7\n"
#define RATE(ins) seconds([] { for (long long i = 0; i < REP / 64; i++) \
    asm volatile(".rept 8\n" EIGHT(ins) ".endr\n" ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7"); })

double cycle_seconds() {  // measured again before each row: the VM's clock moves
    return seconds([] { for (long long i = 0; i < REP / 640; i++)
        asm volatile(".rept 64\nvpaddd %%ymm8, %%ymm0, %%ymm0\n.endr\n" ::: "xmm0"); }) / (REP / 10);
}

int main() {
    asm volatile("vpxor %%xmm8, %%xmm8, %%xmm8" ::: "xmm8");
    double cycle = cycle_seconds();
    printf("clock %.2f GHz\n", 1e-9 / cycle);
    const char* names[] = {"vpmaddubsw", "vpmaddwd", "vfmadd231ps", "vpaddw"};
    const double t[] = {RATE("vpmaddubsw"), RATE("vpmaddwd"), RATE("vfmadd231ps"), RATE("vpaddw")};
    for (int i = 0; i < 4; i++) printf("%-12s %.2f a cycle\n", names[i], REP * cycle / t[i]);

    const int64_t rows = 64, K = 2048;  // 256 KB of bf16 weights, 64 KB of int4: in L2
    const int Ts[] = {1, 2, 3, 4, 5, 6, 8, 9};
    std::mt19937 rng(1);
    std::vector<float> X(16 * K), Y(16 * rows);
    for (auto& v : X) v = float(rng() % 1000) / 1000.f;
    auto report = [&](const char* name, auto call) {
        cycle = cycle_seconds();
        printf("%-6s", name);
        for (int T : Ts) {
            for (int i = 0; i < 10; i++) call(T);
            const int reps = int(2e9 / (rows * K * T)) + 1;
            const double s = seconds([&] { for (int i = 0; i < reps; i++) call(T); });
            printf(" %5.1f", double(rows) * K * T * reps * cycle / s);
        }
        printf("   multiply-adds a cycle at 1 2 3 4 5 6 8 9 tokens (%.2f GHz)\n", 1e-9 / cycle);
    };
    std::vector<uint16_t> W(rows * K);
    for (auto& v : W) v = uint16_t(0x3c00 + rng() % 0x800);  // bf16 in [2^-7, 2)
    report("bf16", [&](int T) {
        MatJob j{};
        j.W = W.data(), j.X = X.data(), j.Y = Y.data(), j.rows = rows, j.len = K, j.ldw = K, j.ldx = K, j.ldy = rows, j.T = T;
        mat_avx2_pairs(j);
    });
    const int64_t nb = K / 32;
    std::vector<int8_t> xq(16 * K);
    std::vector<float> d(16 * nb), ds(16 * nb);
    quantize_acts(X.data(), K, K, 16, K, xq.data(), d.data(), ds.data(), AVX2);
    const QActs A{xq.data(), d.data(), ds.data(), K, nb};
    for (int bits : {8, 6, 4}) {
        const int64_t row_bytes = nb * bits * 4;
        std::vector<uint8_t> q(rows * row_bytes);
        std::vector<uint16_t> s(rows * nb, 0x2000), m(rows * nb, 0xa000);  // fp16 scales, int4 minimums
        for (auto& v : q) v = uint8_t(rng());
        const QMat Wq{q.data(), s.data(), bits == 4 ? m.data() : nullptr, row_bytes, nb};
        report(bits == 8 ? "int8" : bits == 6 ? "int6" : "int4", [&](int T) { qmat(Wq, 0, rows, A, T, Y.data(), rows, bits, AVX2); });
    }
}
