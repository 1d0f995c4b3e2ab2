// Shared by the CPU expert kernels: dtypes, scalar conversions, the matrix-times-tokens job and its
// portable implementation.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

// MOE_PORTABLE_ONLY builds the portable path alone, as on an ARM CPU (tests compile it on x86 too)
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(MOE_PORTABLE_ONLY)
#include <immintrin.h>
#define MOE_X86 1
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(_WIN32) && defined(_tile_loadd_internal)
// GCC 12's AMX macros pass the stride as `long`, 32 bits on Windows: no address register, the assembler rejects the
// build; these are its macros with the stride in 64 bits (__PTRDIFF_TYPE__, as later GCCs have them)
#undef _tile_loadd_internal
#define _tile_loadd_internal(dst, base, stride)                                                       \
    __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm" #dst "|tileloadd\t%%tmm" #dst ", [%0+%1*1]}" :: \
                         "r"((const void*)(base)), "r"((__PTRDIFF_TYPE__)(stride)))
#undef _tile_stored_internal
#define _tile_stored_internal(src, base, stride)                                                        \
    __asm__ volatile("{tilestored\t%%tmm" #src ", (%0,%1,1)|tilestored\t[%0+%1*1], %%tmm" #src "}" :: \
                         "r"((void*)(base)), "r"((__PTRDIFF_TYPE__)(stride)) : "memory")
#endif
#endif

// Up to how many tokens the AVX-512 tiles read their weight rows one at a time (a row's two halves side by side)
// instead of four side by side: on AMD's Zen 5 one stream read 12-20 % faster at 1 and 2 tokens and four rows were
// faster from 3 (docs/benchmarks.md, "Side by side in one process, and one weight row at a time on Zen 5"); where it is
// above 0 the AVX-512 decode linears run these tiles too (decode_body.h, linear_tiles). Intel's CPUs keep four and dot4
// (not measured there). A row's sum runs in one order either way, so the bits do not change with the tokens.
// One value for the library (tests set it: moe_one_row_tokens).
namespace moe_rows {
inline bool cpu_is_amd() {
#ifdef MOE_X86
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;  // "AuthenticAMD"
#else
    return false;
#endif
}
inline std::atomic<int> g_one_row_tokens{-1};  // -1: not asked yet
inline int one_row_tokens() {
    int n = g_one_row_tokens.load(std::memory_order_relaxed);
    if (n < 0) g_one_row_tokens.store(n = cpu_is_amd() ? 2 : 0, std::memory_order_relaxed);
    return n;
}
}  // namespace moe_rows

namespace {

enum DType { F32 = 0, BF16 = 1, F16 = 2 };
enum Isa { AUTO = 0, SCALAR = 1, AVX2 = 2, AVX512 = 3, AVX512_BF16 = 4, AMX_BF16 = 5, AVX512_VNNI = 6, AMX_INT8 = 7, AVX_VNNI = 8 };
constexpr int ISA_CODES = AVX_VNNI + 1;  // the codes above, AVX_VNNI the last: cpu_has's table

// AMX: CPUID.7.0:EDX `bit` and bit 24 (AMX-TILE), and Linux's permission to use tiles; asked once per process
// (CPUID is a VM exit under a hypervisor: not per call).
inline bool amx_usable(int bit) {
#if defined(MOE_X86) && defined(__linux__)
    static const unsigned edx = [] {
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return 0u;
        return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? d : 0u;
    }();
    return edx & (1u << bit);
#else
    (void)bit;
    return false;
#endif
}

#ifdef MOE_X86
// CPUID.leaf.sub's register `reg` (0-3: EAX, EBX, ECX, EDX) bit `bit`: for the features clang 14's __builtin_cpu_supports
// does not name (f16c, avxvnni), which would fail the whole build there; their state is the AVX state the builtin checks
inline bool cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit) {
    unsigned r[4] = {0, 0, 0, 0};
    if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3])) return false;
    return r[reg] & (1u << bit);
}
#endif

// What this CPU can run (and, for AMX, what Linux lets this process use), asked of the CPU.
bool probe_isa(Isa isa) {
#ifdef MOE_X86
    __builtin_cpu_init();
    switch (isa) {
        case AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpuid_bit(1, 0, 2, 29);  // F16C
        case AVX512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && probe_isa(AVX2);
        case AVX512_BF16: return probe_isa(AVX512) && __builtin_cpu_supports("avx512bf16");
        case AVX512_VNNI: return probe_isa(AVX512) && __builtin_cpu_supports("avx512vnni");
        case AVX_VNNI: return probe_isa(AVX2) && cpuid_bit(7, 1, 0, 4);  // AVX-VNNI, VEX vpdpbusd: Intel Core 12th gen on
        case AMX_BF16: return amx_usable(22) && probe_isa(AVX512_BF16);  // CPUID.7.0:EDX bit 22: AMX-BF16
        case AMX_INT8: return amx_usable(25) && probe_isa(AVX512_VNNI);  // bit 25: AMX-INT8
        default: return isa == SCALAR;
    }
#else
    return isa == SCALAR;
#endif
}

// probe_isa's answers, asked once per process: every kernel call asks, and CPUID is a VM exit under a hypervisor (a VM,
// WSL2), 7-11 us each on a 2-vCPU KVM guest: 15 us of a demo expert call's 34 (docs/benchmarks.md, "CPUID once")
bool cpu_has(Isa isa) {
    static const std::array<bool, ISA_CODES> has = [] {
        std::array<bool, ISA_CODES> h{};
        for (int i = 0; i < ISA_CODES; i++) h[i] = probe_isa(Isa(i));
        return h;
    }();
    return unsigned(isa) < unsigned(ISA_CODES) && has[isa];
}

// ---- scalar conversions -------------------------------------------------------------------------
inline float bf16_to_f32(uint16_t v) {
    uint32_t u = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

template <typename To, typename From>
inline To cast_bits(From v) {
    static_assert(sizeof(To) == sizeof(From), "bits of one size");
    To t;
    std::memcpy(&t, &v, sizeof t);
    return t;
}

inline float bits_f32(uint32_t u) { return cast_bits<float>(u); }

// fp16 bits (zero-extended in U: uint32_t, or a vector of them; F: float, or the like vector) -> fp32 bits, exact and
// branch-free, so a loop of it vectorizes: moved into a float's place and rebiased; a subnormal made normal by one exact
// subtraction (no float denormal appears, which DAZ would zero); inf and NaN keep their mantissa
template <typename U, typename F>
inline U f16_bits(U h) {
    const U em = (h & 0x7fff) << 13, exp = em & 0x0f800000u, u = em + (112u << 23);
    const U sub = cast_bits<U>(cast_bits<F>(U(u + (1u << 23))) - bits_f32(113u << 23));  // 2^-14·(1 + m) - 2^-14
    return (exp == 0x0f800000u ? u + (112u << 23) : exp == 0 ? sub : u) | (h & 0x8000) << 16;
}

inline float f16_to_f32(uint16_t h) { return bits_f32(f16_bits<uint32_t, float>(h)); }

inline uint16_t f32_to_f16(float f) {  // round to nearest even, as torch's .half(); subnormals and overflow included
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
    if (u >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to inf
    if (u < 0x38800000u) {  // below the smallest normal half: a subnormal (or zero)
        float a;
        std::memcpy(&a, &u, 4);
        return uint16_t(sign | uint32_t(std::nearbyint(a * 16777216.f)));  // a / 2^-24, exact then RNE
    }
    const uint32_t mant = u & 0x1fffu, base = ((u >> 13) - (112u << 10));
    const uint32_t up = mant > 0x1000u || (mant == 0x1000u && (base & 1u));
    return uint16_t(sign | (base + up));
}

// out[i] = p[off + i] in fp32, i < n: one loop per dtype (each vectorizes)
inline void to_f32(const void* p, int dtype, int64_t off, int64_t n, float* out) {
    const uint16_t* h = static_cast<const uint16_t*>(p) + off;
    if (dtype == BF16) {
        for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(h[i]);
    } else if (dtype == F16) {
        for (int64_t i = 0; i < n; i++) out[i] = f16_to_f32(h[i]);
    } else {
        std::memcpy(out, static_cast<const float*>(p) + off, n * sizeof(float));
    }
}

// A matrix-times-tokens job: Y[t, r] = sum_k W[r, k] * X[t, k], r < rows, t < T.
// W [rows, len] row-major (row stride ldw elements), X [T, len] fp32 (or bf16 for the BF16 path).
struct MatJob {
    const void* W;
    int64_t ldw, rows, len;
    const void* X;
    int64_t ldx;
    int T;
    float* Y;
    int64_t ldy;
    // rows of ldw the thread reads right after this job's last (another expert's, or the up rows after the gate's): the
    // last tiles prefetch them instead of the rows past this matrix's end, so the next job does not start cold; null: none
    const void* next = nullptr;
};

// ---- the portable path: 4-lane vectors (one SSE2 or NEON register: the baseline of x86-64 and aarch64, which GCC and clang
// build from these types without target flags), 16 independent lanes per chain, no dtype switch inside a loop; a·b + c
// is fused where the baseline has FMA (aarch64: fmla, the compilers' default contraction), two roundings on SSE2
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x4 __attribute__((vector_size(8)));

inline f32x4 load4(const float* p) {
    f32x4 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// 4 weights in fp32: bf16 by a shift, fp16 by f16_bits lane by lane
template <int DT>
inline f32x4 weights4(const void* W, int64_t i) {
    if (DT == F32) return load4(static_cast<const float*>(W) + i);
    u16x4 h;
    std::memcpy(&h, static_cast<const uint16_t*>(W) + i, sizeof h);
    const u32x4 u = __builtin_convertvector(h, u32x4);
    return cast_bits<f32x4>(DT == BF16 ? u << 16 : f16_bits<u32x4, f32x4>(u));
}

template <int DT>
inline float weight_at(const void* W, int64_t i) {
    if (DT == BF16) return bf16_to_f32(static_cast<const uint16_t*>(W)[i]);
    if (DT == F16) return f16_to_f32(static_cast<const uint16_t*>(W)[i]);
    return static_cast<const float*>(W)[i];
}

// Y[t, r] for tokens t0..t0+TC-1: each block of 16 weights widened once for the TC tokens, 16 lanes per token; a token's
// lanes, their tree and its tail run in one order whatever TC, so its bits do not depend on the call's other tokens
template <int DT, int TC>
void mat_portable_rows(const MatJob& j, int t0) {
    const float* X = static_cast<const float*>(j.X) + t0 * j.ldx;
    const int64_t n16 = j.len / 16 * 16;
    for (int64_t r = 0; r < j.rows; r++) {
        const int64_t row = r * j.ldw;
        f32x4 acc[TC][4] = {};
        for (int64_t k = 0; k < n16; k += 16) {
            f32x4 w[4];
            for (int v = 0; v < 4; v++) w[v] = weights4<DT>(j.W, row + k + 4 * v);
            for (int t = 0; t < TC; t++)
                for (int v = 0; v < 4; v++) acc[t][v] += w[v] * load4(X + t * j.ldx + k + 4 * v);
        }
        for (int t = 0; t < TC; t++) {
            const f32x4 a = (acc[t][0] + acc[t][2]) + (acc[t][1] + acc[t][3]);
            float s = (a[0] + a[2]) + (a[1] + a[3]);
            for (int64_t k = n16; k < j.len; k++) s += weight_at<DT>(j.W, row + k) * X[t * j.ldx + k];
            j.Y[(t0 + t) * j.ldy + r] = s;
        }
    }
}

// Tokens a pass when T tokens go in passes of at most most: passes as even as they can be (14 of at most 10 as 7 + 7,
// not 10 + 4), so no pass is a short one whose few accumulator chains leave the FMA pipes waiting
inline int even_pass_tokens(int T, int most) {
    const int passes = (T + most - 1) / most;
    return (T + passes - 1) / passes;
}

// Tokens in passes of PORTABLE_TC: 16 lanes × TC accumulators fit NEON's 32 registers, SSE2's 16 take 2 tokens
#if defined(__aarch64__)
constexpr int PORTABLE_TC = 4;
#else
constexpr int PORTABLE_TC = 2;
#endif

template <int DT>
void mat_portable_dt(const MatJob& j) {
    int t = 0;
    for (; t + PORTABLE_TC <= j.T; t += PORTABLE_TC) mat_portable_rows<DT, PORTABLE_TC>(j, t);
    if (j.T - t == 3) mat_portable_rows<DT, 3>(j, t);
    else if (j.T - t == 2) mat_portable_rows<DT, 2>(j, t);
    else if (j.T - t == 1) mat_portable_rows<DT, 1>(j, t);
}

void mat_scalar(const MatJob& j, int dtype) {
    if (dtype == BF16) mat_portable_dt<BF16>(j);
    else if (dtype == F16) mat_portable_dt<F16>(j);
    else mat_portable_dt<F32>(j);
}

// Per 16-block of a row: its 8 even entries, then its 8 odd ones (the order mat_avx2_pairs reads).
void permute_pairs(float* x, int64_t len) {
    float tmp[16];
    for (int64_t k = 0; k + 16 <= len; k += 16) {
        for (int i = 0; i < 8; i++) tmp[i] = x[k + 2 * i], tmp[8 + i] = x[k + 2 * i + 1];
        std::memcpy(x + k, tmp, sizeof tmp);
    }
}

}  // namespace
