// Shared by the CPU expert kernels: dtypes, scalar conversions, the matrix-times-tokens job and its
// portable implementation.
#pragma once

#include <algorithm>
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
#if defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace {

enum DType { F32 = 0, BF16 = 1, F16 = 2 };
enum Isa { AUTO = 0, SCALAR = 1, AVX2 = 2, AVX512 = 3, AVX512_BF16 = 4, AMX_BF16 = 5, AVX512_VNNI = 6, AMX_INT8 = 7, AVX_VNNI = 8 };

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

// What this CPU can run (and, for AMX, what Linux lets this process use).
bool cpu_has(Isa isa) {
#ifdef MOE_X86
    __builtin_cpu_init();
    switch (isa) {
        case AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        case AVX512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && cpu_has(AVX2);
        case AVX512_BF16: return cpu_has(AVX512) && __builtin_cpu_supports("avx512bf16");
        case AVX512_VNNI: return cpu_has(AVX512) && __builtin_cpu_supports("avx512vnni");
        case AVX_VNNI: return cpu_has(AVX2) && __builtin_cpu_supports("avxvnni");  // VEX vpdpbusd: Intel Core 12th gen on
        case AMX_BF16: return amx_usable(22) && cpu_has(AVX512_BF16);  // CPUID.7.0:EDX bit 22: AMX-BF16
        case AMX_INT8: return amx_usable(25) && cpu_has(AVX512_VNNI);  // bit 25: AMX-INT8
        default: return isa == SCALAR;
    }
#else
    return isa == SCALAR;
#endif
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

inline float f16_to_f32(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);  // inf / NaN
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else {  // subnormal: normalise
        int e = -1;
        do { e++; man <<= 1; } while (!(man & 0x400));
        u = sign | uint32_t(112 - e) << 23 | ((man & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

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

inline float load_scalar(const void* p, int64_t i, int dtype) {
    switch (dtype) {
        case BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
        case F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
        default: return static_cast<const float*>(p)[i];
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
};

void mat_scalar(const MatJob& j, int dtype) {
    const float* X = static_cast<const float*>(j.X);
    for (int64_t r = 0; r < j.rows; r++) {
        for (int t = 0; t < j.T; t++) j.Y[t * j.ldy + r] = 0.f;
        for (int64_t k = 0; k < j.len; k++) {
            float w = load_scalar(j.W, r * j.ldw + k, dtype);
            for (int t = 0; t < j.T; t++) j.Y[t * j.ldy + r] += w * X[t * j.ldx + k];
        }
    }
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
