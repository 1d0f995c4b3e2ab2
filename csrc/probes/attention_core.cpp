// The CPU attention core (csrc/cpu/decode_body.h: attend_heads) timed alone at two models' shapes, as a decode step
// (T = 1) and a verification (T = 5) see it: Qwen3-30B-A3B (32 query heads on 4 KV heads of 128, the fp32 KV cache) and
// DeepSeek-V2-Lite (16 heads over one latent cache of 512 + 64). Each row cycles L layers' caches, so they come from DRAM
// as in a real pass; prints the best of R rounds in µs per layer. Not part of the library; docs/benchmarks.md uses it:
//   g++ -O3 -std=c++17 -w -I csrc/cpu csrc/probes/attention_core.cpp -o /tmp/attention_core -lpthread
//   /tmp/attention_core [threads=2] [layers=12] [rounds=6]
// -I another revision's csrc/cpu builds that revision's core, for an A/B in one sitting.
#include "decode_ops.cpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {
std::vector<float> randn(int64_t n, float scale, std::mt19937& rng) {
    std::normal_distribution<float> nd;
    std::vector<float> v(n);
    for (auto& x : v) x = nd(rng) * scale;
    return v;
}

template <typename Call>
double best_us(int rounds, int layers, Call call) {
    double best = 1e30;
    for (int r = 0; r < rounds; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int l = 0; l < layers; ++l) call(l);
        best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    return best / layers;
}
}  // namespace

int main(int argc, char** argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2, layers = argc > 2 ? atoi(argv[2]) : 12;
    const int rounds = argc > 3 ? atoi(argv[3]) : 6;
    std::mt19937 rng(1);
    printf("threads %d, %d layers' caches cycled, best of %d rounds, µs per layer\n", threads, layers, rounds);
    printf("%-18s %6s %3s %10s\n", "shape", "past", "T", "µs");
    for (const int64_t past : {64, 1500, 4000})
        for (const int64_t T : {1, 5}) {
            const int64_t S = past + T;
            {  // Qwen3-30B-A3B: the KV cache [Hkv, S, D] per layer
                const int64_t Hq = 32, Hkv = 4, D = 128;
                std::vector<std::vector<float>> K, V;
                for (int l = 0; l < layers; ++l) K.push_back(randn(Hkv * S * D, 1.f, rng)), V.push_back(randn(Hkv * S * D, 1.f, rng));
                std::vector<float> q = randn(T * Hq * D, 0.1f, rng), out(T * Hq * D);
                const double us = best_us(rounds, layers, [&](int l) {
                    const HeadRows rows{q.data(), nullptr, out.data(), Hq * D, D, 0, 0, Hq * D, D, T, Hq, Hkv, past, 0.088f};
                    const float *k = K[l].data(), *v = V[l].data();
                    ISA_CALL(attend_heads, rows, [&](int64_t g) {
                        return KeyRows{k + g * S * D, nullptr, v + g * S * D, D, 0, D, D, 0, D};
                    }, threads);
                });
                printf("%-18s %6lld %3lld %10.0f\n", "qwen3-30b-a3b", (long long)past, (long long)T, us);
            }
            {  // DeepSeek-V2-Lite: latents [S, 512] and rope keys [S, 64] per layer
                const int64_t H = 16, R = 512, Dr = 64;
                std::vector<std::vector<float>> lat, rope;
                for (int l = 0; l < layers; ++l) lat.push_back(randn(S * R, 1.f, rng)), rope.push_back(randn(S * Dr, 1.f, rng));
                std::vector<float> q = randn(T * H * R, 0.05f, rng), qp = randn(T * H * Dr, 0.05f, rng), out(T * H * R);
                const double us = best_us(rounds, layers, [&](int l) {
                    moe_latent_attention(q.data(), H * R, R, qp.data(), H * Dr, Dr, lat[l].data(), R, rope[l].data(), Dr, T, H,
                                         R, Dr, past, 0.07f, out.data(), threads);
                });
                printf("%-18s %6lld %3lld %10.0f\n", "deepseek-v2-lite", (long long)past, (long long)T, us);
            }
        }
}
