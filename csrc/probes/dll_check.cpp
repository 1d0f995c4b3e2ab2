// The CPU kernels' library as Python's ctypes meets it: loaded by path (LoadLibrary on Windows, dlopen elsewhere), its
// entry points looked up by name, then each path this CPU has against the scalar path of the same library: the float
// expert FFN (bf16, fp16 and fp32 weights), the quantized one (int8, int4) and its linear layer, the activations'
// quantization, and the decode ops (attention, linear, router, norm) on each decode path; a call's bits on 1 and 4
// threads, and two threads calling at once. Prints one line per check, then "ok" (exit 0) or the failures (exit 1).
// Not part of the library; tests/native/test_windows_build.py cross-compiles it with MinGW and runs it under wine:
//   x86_64-w64-mingw32-g++ -O2 -std=c++17 csrc/probes/dll_check.cpp -o dll_check.exe -static && wine dll_check.exe X.dll
//   g++ -O2 -std=c++17 csrc/probes/dll_check.cpp -o /tmp/dll_check -ldl -lpthread && /tmp/dll_check libmoechat_cpu-*.so
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#ifdef _WIN32
#include <windows.h>
static void* open_library(const char* path) { return (void*)LoadLibraryA(path); }
static void* symbol(void* lib, const char* name) { return (void*)GetProcAddress((HMODULE)lib, name); }
#else
#include <dlfcn.h>
static void* open_library(const char* path) { return dlopen(path, RTLD_NOW); }
static void* symbol(void* lib, const char* name) { return dlsym(lib, name); }
#endif

namespace {

typedef int (*Supported)(int);
typedef int (*ExpertFfn)(int64_t, const int64_t*, const int64_t*, const void*, const void*, int, int64_t, int64_t, const void*,
                         int, const int64_t*, const float*, float*, int, int);
typedef int (*ExpertFfnQ)(int64_t, const int64_t*, const int64_t*, const uint8_t*, const uint16_t*, const uint16_t*,
                          const uint8_t*, const uint16_t*, const uint16_t*, int, int64_t, int64_t, const void*, int,
                          const int64_t*, const int64_t*, const float*, float*, int, int);
typedef int (*QLinear)(const uint8_t*, const uint16_t*, const uint16_t*, int, int64_t, int64_t, const float*, int64_t, float*,
                       int, int);
typedef int (*Quantize)(const void*, int, int64_t, int64_t, int, uint8_t*, uint16_t*, uint16_t*, int, int);
typedef int (*QuantizeActs)(const float*, int64_t, int64_t, int8_t*, float*, float*, int);
typedef int (*DecodeIsa)(int);
typedef int (*Attention)(float*, int64_t, float*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                         const float*, const float*, float, const float*, const float*, float*, float*, int64_t, int64_t,
                         int64_t, float, float*, int64_t, int);
typedef int (*Linear)(const float*, const float*, const float*, int64_t, int64_t, int64_t, float*, int64_t, int);
typedef int (*Router)(const float*, const float*, int64_t, int64_t, int64_t, int64_t, int, float*, float*, int64_t*, int);
typedef int (*Norm)(float*, const float*, const float*, float, int64_t, int64_t, float*);

enum { F32 = 0, BF16 = 1, F16 = 2 };
const char* ISA_NAMES[] = {"auto", "scalar", "avx2", "avx512", "avx512_bf16", "amx_bf16", "avx512_vnni", "amx_int8", "avx_vnni"};
int failures = 0;

void check(bool ok, const char* what, double err = 0) {
    std::printf("%s %s (max relative difference %.3g)\n", ok ? "ok  " : "FAIL", what, err);
    failures += !ok;
}

std::vector<float> randoms(size_t n, float scale, uint32_t seed) {  // an LCG: the same numbers on every platform
    std::vector<float> v(n);
    for (auto& x : v) seed = seed * 1664525u + 1013904223u, x = scale * (float(seed >> 8) / 8388608.f - 1.f);
    return v;
}

std::vector<uint16_t> narrowed(const std::vector<float>& v, int dtype) {  // bf16 by truncation, fp16 by the F16C-free way
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
        uint32_t u;
        std::memcpy(&u, &v[i], 4);
        if (dtype == BF16) h[i] = uint16_t(u >> 16);
        else if (((u >> 23) & 0xff) < 113) h[i] = uint16_t((u >> 16) & 0x8000);  // below fp16's normals: zero
        else h[i] = uint16_t(((u >> 16) & 0x8000) | ((((u >> 23) & 0xff) - 112) << 10) | ((u >> 13) & 0x3ff));
    }
    return h;
}

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
    double most = 1e-12, diff = 0;
    for (size_t i = 0; i < a.size(); ++i)
        most = std::max(most, double(std::fabs(b[i]))), diff = std::max(diff, double(std::fabs(a[i] - b[i])));
    return std::isfinite(diff) ? diff / most : 1e30;
}

struct Case {  // E experts of [2I, H] and [H, I]; groups of tokens routed to experts 3, 0, 5
    int64_t H, I, E = 6, N = 5;
    std::vector<int64_t> experts{3, 0, 5}, offsets{0, 4, 5, 8}, rows{0, 1, 2, 4, 3, 0, 2, 4};
    std::vector<float> gate_up, down, x, w = randoms(8, 1.f, 7);
    Case(int64_t h, int64_t i) : H(h), I(i), gate_up(randoms(E * 2 * I * H, 0.1f, 1)), down(randoms(E * H * I, 0.1f, 2)),
                                 x(randoms(N * H, 1.f, 3)) {}
};

std::vector<float> widened(const std::vector<uint16_t>& h, int dtype) {
    std::vector<float> v(h.size());
    for (size_t i = 0; i < h.size(); ++i) {
        const uint32_t u = dtype == BF16 ? uint32_t(h[i]) << 16
                           : (h[i] & 0x7fff) == 0 ? uint32_t(h[i] & 0x8000) << 16
                                                  : (uint32_t(h[i] & 0x8000) << 16) | ((((h[i] >> 10) & 0x1f) + 112u) << 23) |
                                                        (uint32_t(h[i] & 0x3ff) << 13);
        std::memcpy(&v[i], &u, 4);
    }
    return v;
}

// out[rows[s]] += w[s] · down_e(silu(gate_e · x) ⊙ up_e · x), in double precision
std::vector<float> reference(const Case& c, const std::vector<float>& gate_up, const std::vector<float>& down) {
    std::vector<double> out(c.N * c.H, 0.0), h(c.I);
    for (size_t g = 0; g + 1 < c.offsets.size(); ++g)
        for (int64_t s = c.offsets[g]; s < c.offsets[g + 1]; ++s) {
            const float* x = c.x.data() + c.rows[s] * c.H;
            const float* gu = gate_up.data() + c.experts[g] * 2 * c.I * c.H;
            for (int64_t i = 0; i < c.I; ++i) {
                double a = 0, b = 0;
                for (int64_t j = 0; j < c.H; ++j)
                    a += double(gu[i * c.H + j]) * x[j], b += double(gu[(c.I + i) * c.H + j]) * x[j];
                h[i] = a / (1 + std::exp(-a)) * b;
            }
            const float* dn = down.data() + c.experts[g] * c.H * c.I;
            for (int64_t r = 0; r < c.H; ++r) {
                double y = 0;
                for (int64_t i = 0; i < c.I; ++i) y += double(dn[r * c.I + i]) * h[i];
                out[c.rows[s] * c.H + r] += c.w[s] * y;
            }
        }
    return std::vector<float>(out.begin(), out.end());
}

void float_ffn(void* lib) {
    auto supported = (Supported)symbol(lib, "moe_cpu_isa_supported");
    auto ffn = (ExpertFfn)symbol(lib, "moe_expert_ffn");
    for (auto [H, I] : {std::pair<int64_t, int64_t>{128, 96}, {67, 45}})
        for (int dtype : {BF16, F16, F32}) {
            Case c(H, I);
            auto gu16 = narrowed(c.gate_up, dtype), dn16 = narrowed(c.down, dtype);
            const void* gu = dtype == F32 ? (const void*)c.gate_up.data() : gu16.data();
            const void* dn = dtype == F32 ? (const void*)c.down.data() : dn16.data();
            auto run = [&](int isa, int threads) {
                std::vector<float> out(c.N * H, 0.f);
                const int rc = ffn(3, c.experts.data(), c.offsets.data(), gu, dn, dtype, H, I, c.x.data(), F32, c.rows.data(),
                                   c.w.data(), out.data(), threads, isa);
                return rc == 0 ? out : std::vector<float>(c.N * H, NAN);
            };
            const auto want = run(1, 1);
            const double err = rel_diff(want, reference(c, dtype == F32 ? c.gate_up : widened(gu16, dtype),
                                                        dtype == F32 ? c.down : widened(dn16, dtype)));
            check(err < 1e-5, "expert FFN scalar: the contract in double precision", err);
            for (int isa = 2; isa <= 5; ++isa) {
                if (!supported(isa)) continue;
                char what[160];
                std::snprintf(what, sizeof what, "expert FFN %s, %s weights, H %lld I %lld", ISA_NAMES[isa],
                              dtype == BF16 ? "bf16" : dtype == F16 ? "fp16" : "fp32", (long long)H, (long long)I);
                const double err = rel_diff(run(isa, 2), want);
                check(err < (isa == 4 || isa == 5 ? 1e-2 : 2e-5), what, err);  // AVX-512 BF16, AMX: activations in bf16
            }
            std::vector<float> one = run(0, 1), four = run(0, 4);
            check(one == four, dtype == BF16 ? "expert FFN: 1 and 4 threads give the same bits" : "expert FFN: threads, again");
        }
}

void quant_ffn(void* lib) {
    auto supported = (Supported)symbol(lib, "moe_q_isa_supported");
    auto quantize = (Quantize)symbol(lib, "moe_quantize");
    auto ffn = (ExpertFfnQ)symbol(lib, "moe_expert_ffn_q");
    auto linear = (QLinear)symbol(lib, "moe_q_linear");
    auto acts = (QuantizeActs)symbol(lib, "moe_quantize_acts");
    const int q_isas[] = {2, 8, 6, 7};
    for (int bits : {8, 4}) {
        Case c(80, 48);  // multiples of 16, not of 32: padded blocks
        const int64_t Hp = 96, Ip = 64;
        std::vector<uint8_t> gq(c.E * 2 * c.I * Hp * bits / 8), dq(c.E * c.H * Ip * bits / 8);
        std::vector<uint16_t> gs(c.E * 2 * c.I * Hp / 32), gm(gs.size()), ds(c.E * c.H * Ip / 32), dm(ds.size());
        uint16_t *gmp = bits == 4 ? gm.data() : nullptr, *dmp = bits == 4 ? dm.data() : nullptr;
        const int qa = quantize(c.gate_up.data(), F32, c.E * 2 * c.I, c.H, bits, gq.data(), gs.data(), gmp, 2, 1);
        const int qb = quantize(c.down.data(), F32, c.E * c.H, c.I, bits, dq.data(), ds.data(), dmp, 2, 1);
        check(qa == 0 && qb == 0, bits == 8 ? "int8 quantization runs" : "int4 quantization runs");
        auto run = [&](int isa, int threads) {
            std::vector<float> out(c.N * c.H, 0.f);
            const int rc = ffn(3, c.experts.data(), c.offsets.data(), gq.data(), gs.data(), gmp, dq.data(), ds.data(), dmp, bits,
                               c.H, c.I, c.x.data(), F32, c.rows.data(), c.rows.data(), c.w.data(), out.data(), threads, isa);
            return rc == 0 ? out : std::vector<float>(c.N * c.H, NAN);
        };
        auto run_linear = [&](int isa) {
            std::vector<float> out(c.N * 2 * c.I, 0.f);
            const int rc = linear(gq.data(), gs.data(), gmp, bits, 2 * c.I, c.H, c.x.data(), c.N, out.data(), 2, isa);
            return rc == 0 ? out : std::vector<float>(out.size(), NAN);
        };
        const auto want = run(1, 1), want_linear = run_linear(1);
        for (int isa : q_isas) {
            if (!supported(isa)) continue;
            char what[160];
            std::snprintf(what, sizeof what, "int%d expert FFN %s", bits, ISA_NAMES[isa]);
            double err = rel_diff(run(isa, 2), want);
            check(err < 1e-5, what, err);
            std::snprintf(what, sizeof what, "int%d linear %s", bits, ISA_NAMES[isa]);
            err = rel_diff(run_linear(isa), want_linear);
            check(err < 1e-6, what, err);
        }
        check(run(0, 1) == run(0, 4), "quantized FFN: 1 and 4 threads give the same bits");
    }
    std::vector<int8_t> q1(5 * 96), q2(5 * 96);
    std::vector<float> d1(15), d2(15), s1(15), s2(15), x = randoms(5 * 80, 2.f, 9);
    acts(x.data(), 5, 80, q1.data(), d1.data(), s1.data(), 1);
    for (int isa : q_isas) {
        if (!supported(isa)) continue;
        acts(x.data(), 5, 80, q2.data(), d2.data(), s2.data(), isa);
        char what[160];
        std::snprintf(what, sizeof what, "activation quantization %s: the scalar path's bits", ISA_NAMES[isa]);
        check(q1 == q2 && d1 == d2 && s1 == s2, what);
    }
}

void decode_ops(void* lib) {
    auto cap = (DecodeIsa)symbol(lib, "moe_decode_isa");
    auto attention = (Attention)symbol(lib, "moe_attention_step");
    auto linear = (Linear)symbol(lib, "moe_linear_f32");
    auto router = (Router)symbol(lib, "moe_router_topk");
    auto norm = (Norm)symbol(lib, "moe_add_rms_norm");
    const int64_t T = 3, Hq = 4, Hkv = 2, D = 32, past = 5, cap_rows = 16, H = 80, E = 8, k = 2, W = (Hq + 2 * Hkv) * D;
    auto run = [&](int path, int threads) {
        std::vector<float> qkv = randoms(T * W, 1.f, 11), cos = randoms(cap_rows * D, 1.f, 12);
        std::vector<float> sin = randoms(cap_rows * D, 1.f, 13);
        std::vector<float> kc = randoms(Hkv * cap_rows * D, 1.f, 14), vc = randoms(Hkv * cap_rows * D, 1.f, 15), out(T * Hq * D);
        std::vector<float> x = randoms(T * H, 1.f, 16), w = randoms(E * H, 0.2f, 17), y(T * E), logits(T * E), weights(T * k);
        std::vector<float> nx = randoms(T * H, 1.f, 18), nr = randoms(T * H, 1.f, 19), nw = randoms(H, 1.f, 20), ny(T * H);
        std::vector<int64_t> ids(T * k);
        cap(path);
        int rc = attention(qkv.data(), W, qkv.data() + Hq * D, W, qkv.data() + (Hq + Hkv) * D, W, T, Hq, Hkv, D, nullptr, nullptr,
                           1e-6f, cos.data(), sin.data(), kc.data(), vc.data(), cap_rows, past, 0, 0.17f, out.data(), Hq * D,
                           threads);
        rc |= linear(x.data(), w.data(), nullptr, T, E, H, y.data(), E, threads);
        rc |= router(x.data(), w.data(), T, E, H, k, 1, logits.data(), weights.data(), ids.data(), threads);
        rc |= norm(nx.data(), nr.data(), nw.data(), 1e-6f, T, H, ny.data());
        for (float v : y) out.push_back(v);
        for (float v : weights) out.push_back(v);
        for (float v : ny) out.push_back(v);
        for (int64_t v : ids) out.push_back(float(v));
        return rc == 0 ? out : std::vector<float>(out.size(), NAN);
    };
    const int widest = cap(-1);
    const auto want = run(0, 1);
    for (int path = 1; path <= widest; ++path) {
        const double err = rel_diff(run(path, 2), want);
        check(err < 1e-5, path == 1 ? "decode ops avx2" : "decode ops avx512", err);
    }
    check(run(widest, 1) == run(widest, 4), "decode ops: 1 and 4 threads give the same bits");
    cap(widest);
}

void two_callers(void* lib) {  // the pool serves one call at a time: a second caller waits for it, both get their bits
    auto ffn = (ExpertFfn)symbol(lib, "moe_expert_ffn");
    Case c(128, 96);
    auto gu = narrowed(c.gate_up, BF16), dn = narrowed(c.down, BF16);
    auto run = [&](std::vector<float>& out) {
        std::fill(out.begin(), out.end(), 0.f);
        return ffn(3, c.experts.data(), c.offsets.data(), gu.data(), dn.data(), BF16, c.H, c.I, c.x.data(), F32, c.rows.data(),
                   c.w.data(), out.data(), 3, 0);
    };
    std::vector<float> want(c.N * c.H), a(want.size()), b(want.size());
    run(want);
    bool same = true;
    for (int round = 0; round < 200 && same; ++round) {
        int ra = 1, rb = 1;
        std::thread other([&] { rb = run(b); });
        ra = run(a);
        other.join();
        same = ra == 0 && rb == 0 && a == want && b == want;
    }
    check(same, "two threads calling at once, 200 rounds");
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: dll_check LIBRARY\n");
        return 2;
    }
    void* lib = open_library(argv[1]);
    if (!lib) {
        std::fprintf(stderr, "cannot load %s\n", argv[1]);
        return 2;
    }
    auto supported = (Supported)symbol(lib, "moe_cpu_isa_supported");
    auto q_supported = (Supported)symbol(lib, "moe_q_isa_supported");
    std::printf("paths:");
    for (int isa = 1; isa <= 8; ++isa)
        if (supported(isa) || q_supported(isa)) std::printf(" %s", ISA_NAMES[isa]);
    std::printf("\n");
    float_ffn(lib);
    quant_ffn(lib);
    decode_ops(lib);
    two_callers(lib);
    std::printf(failures ? "%d failed\n" : "ok\n", failures);
    return failures ? 1 : 0;
}
