// Fused SwiGLU expert FFN for the CPU tier: for many experts and their token groups in one call,
//   out[rows[s], :] += weights[s] * down_e(silu(gate_e x_s) * up_e x_s)      (s in group of expert e)
// Decode is memory-bound (1-9 tokens per expert): every weight row is read once from DRAM and
// dotted with all of its group's tokens while it sits in registers/L1, in fp32.
//
// Paths, chosen at run time: AVX-512 BF16 (vdpbf16ps, bf16 weights and activations), AVX-512F and
// AVX2+FMA (weights bf16/fp16/fp32 converted to fp32 in registers), and portable C++ (4-lane vectors: SSE2, NEON).
// Threads: a persistent pool (caller + n-1 workers that sleep when idle); phase 1 splits (expert,
// block of I rows), phase 2 splits blocks of H output columns, so no two threads write one element
// and every element sums its experts in the same order whatever the thread count.
// Plain C ABI for ctypes, which releases the GIL for the whole call.

#include "common.h"
#include "pool.h"
#include "x86_tiles.h"

#define API extern "C" __attribute__((visibility("default")))

namespace {

// Which path a (weights, activations) dtype pair takes on `isa` (AUTO: the best this CPU has).
Isa resolve(int isa, int w_dtype, int x_dtype) {
    if (isa == AUTO) {
        if (w_dtype == BF16 && x_dtype == BF16 && cpu_has(AMX_BF16)) return AMX_BF16;
        if (w_dtype == BF16 && x_dtype == BF16 && cpu_has(AVX512_BF16)) return AVX512_BF16;
        return cpu_has(AVX512) ? AVX512 : cpu_has(AVX2) ? AVX2 : SCALAR;
    }
    if ((isa == AVX512_BF16 || isa == AMX_BF16) && !(w_dtype == BF16 && x_dtype == BF16)) return AVX512;  // bf16 on both sides
    return Isa(isa);
}

void run_mat(const MatJob& j, int w_dtype, Isa isa) {
#ifdef MOE_X86
    switch (isa) {
        case AVX512_BF16: return mat_bf16(j);
        case AVX512:
            if (w_dtype == BF16) return mat_avx512<uint16_t>(j);
            if (w_dtype == F16) return mat_avx512<Half>(j);
            return mat_avx512<float>(j);
        case AVX2:
            if (w_dtype == BF16) return mat_avx2_pairs(j);  // activations in permute_pairs order
            if (w_dtype == F16) return mat_avx2<Half>(j);
            return mat_avx2<float>(j);
        default: break;
    }
#else
    (void)isa;
#endif
    mat_scalar(j, w_dtype);
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

constexpr int64_t RB_ROWS = 32;  // weight rows per work item in both phases (two AMX row blocks)

}  // namespace

// Codes: 0 ok, -1 bad dtype, -2 ISA not supported by this CPU, -3 bad shapes.
API int moe_cpu_isa_supported(int isa) { return isa == AUTO || cpu_has(Isa(isa)); }

// Up to how many tokens the AVX-512 products read one weight row at a time (common.h, moe_rows): n >= 0 sets it (tests
// run both ways); returns the value calls take now
API int moe_one_row_tokens(int n) {
    if (n >= 0) moe_rows::g_one_row_tokens.store(n, std::memory_order_relaxed);
    return moe_rows::one_row_tokens();
}

API int moe_cpu_resolve_isa(int isa, int w_dtype, int x_dtype) { return resolve(isa, w_dtype, x_dtype); }

// Group g's expert through its own three matrices: gate[g] and up[g] [I, H], down[g] [H, I] (each contiguous,
// anywhere: the disk tier's per-expert tensors of a mapped checkpoint); the rest as moe_expert_ffn.
API int moe_expert_ffn_ptrs(int64_t n_groups, const int64_t* offsets, const void* const* gate, const void* const* up,
                            const void* const* down, int w_dtype, int64_t hidden, int64_t inter,
                            const void* x, int x_dtype, const int64_t* rows, const float* row_weights,
                            float* out, int num_threads, int isa_req) {
    if (w_dtype < F32 || w_dtype > F16 || x_dtype < F32 || x_dtype > F16) return -1;
    if (hidden <= 0 || inter <= 0 || n_groups < 0) return -3;
    Isa isa = resolve(isa_req, w_dtype, x_dtype);
    if (!cpu_has(isa)) return -2;
    const int64_t S = n_groups ? offsets[n_groups] : 0, H = hidden, I = inter;
    if (S == 0) return 0;
    int64_t max_t = 0;
    for (int64_t g = 0; g < n_groups; g++) max_t = std::max(max_t, offsets[g + 1] - offsets[g]);
    if (isa == AMX_BF16 && (max_t > AMX_N || H % 32 || I % 32)) isa = AVX512_BF16;  // tiles: K in 32s, 16 tokens
    const size_t wsize = w_dtype == F32 ? 4 : 2;
    const bool bf16 = isa == AVX512_BF16 || isa == AMX_BF16, amx = isa == AMX_BF16;

    // Activations gathered per group: xs [S, H] fp32 (or bf16 for the bf16 paths), h [S, I];
    // for AMX also packed per group: xp [G][H/2][16][2], hp [G][I/2][16][2].
    std::vector<float> xs(bf16 ? 0 : S * H), h(S * I);
    std::vector<uint16_t> xs16(bf16 ? S * H : 0), h16(bf16 ? S * I : 0);
    std::vector<uint16_t> xp(amx ? n_groups * H * AMX_N : 0), hp(amx ? n_groups * I * AMX_N : 0);
    for (int64_t s = 0; s < S; s++) {
        const int64_t src = rows[s] * H;
        if (bf16) std::memcpy(&xs16[s * H], static_cast<const uint16_t*>(x) + src, H * 2);
        else to_f32(x, x_dtype, src, H, &xs[s * H]);
    }
    if (amx)
        for (int64_t g = 0; g < n_groups; g++)
            pack_vnni(&xs16[offsets[g] * H], H, int(offsets[g + 1] - offsets[g]), H, &xp[g * H * AMX_N]);
    const bool pairs = isa == AVX2 && w_dtype == BF16;  // mat_avx2_pairs reads activations pair-split
    if (pairs)
        for (int64_t s = 0; s < S; s++) permute_pairs(&xs[s * H], H);

    // Y [T, RB] = W [nr, K] . X^T for one group: AMX on whole 16-row blocks, the vector path elsewhere. next: the rows
    // of K this thread reads after these (MatJob::next), prefetched as the last tiles run.
    auto mat = [&](const char* W, int64_t nr, int64_t K, const void* X, const uint16_t* P, int T, float* Y,
                   const char* next) {
#ifdef MOE_X86
        int64_t done = 0;
        if (amx) {
            done = nr / 16 * 16;
            if (done) mat_amx(reinterpret_cast<const uint16_t*>(W), K, done, K, P, T, Y, RB_ROWS);
        }
        if (done < nr) {
            run_mat({W + done * K * wsize, K, nr - done, K, X, K, T, Y + done, RB_ROWS, next}, w_dtype,
                    amx ? AVX512_BF16 : isa);
        }
#else
        (void)P;
        run_mat({W, K, nr, K, X, K, T, Y, RB_ROWS, next}, w_dtype, isa);
#endif
    };

    const int threads = threads_for(num_threads, double(n_groups) * 3 * H * I * wsize);
    const int64_t iblocks = (I + RB_ROWS - 1) / RB_ROWS, hblocks = (H + RB_ROWS - 1) / RB_ROWS;

    // Phase 1: h[s, i] = silu(gate_e x_s)_i * (up_e x_s)_i over items (group, block of I rows), in runs (pool.h's Items:
    // a thread streams stretches of one expert's gate and up rows). The gate's rows go on into the up's, the up's into the
    // gate rows of the item this thread takes next in its run.
    Items items1(n_groups * iblocks, threads);
    auto gate_rows = [&](int64_t item) -> const char* {  // null: none
        if (item < 0) return nullptr;
        return static_cast<const char*>(gate[item / iblocks]) + (item % iblocks) * RB_ROWS * H * wsize;
    };
    g_pool->run(threads, [&](int) {
        if (amx) amx_begin();
        std::vector<float> yg(max_t * RB_ROWS), yu(max_t * RB_ROWS);
        Items::Cursor cursor;
        for (int64_t item; (item = items1.next(cursor)) >= 0;) {
            const int64_t g = item / iblocks, i0 = (item % iblocks) * RB_ROWS, nr = std::min(RB_ROWS, I - i0);
            const int64_t s0 = offsets[g];
            const int T = int(offsets[g + 1] - s0);
            if (T == 0) continue;
            const void* X = bf16 ? static_cast<const void*>(&xs16[s0 * H]) : &xs[s0 * H];
            const uint16_t* P = amx ? &xp[g * H * AMX_N] : nullptr;
            const char* up_rows = static_cast<const char*>(up[g]) + i0 * H * wsize;
            mat(gate_rows(item), nr, H, X, P, T, yg.data(), up_rows);
            mat(up_rows, nr, H, X, P, T, yu.data(), gate_rows(Items::ahead(cursor)));
            for (int t = 0; t < T; t++)
                for (int64_t r = 0; r < nr; r++)
                    h[(s0 + t) * I + i0 + r] = silu(yg[t * RB_ROWS + r]) * yu[t * RB_ROWS + r];
        }
        if (amx) amx_end();
    });
    if (bf16)
        for (int64_t i = 0; i < S * I; i++) h16[i] = f32_to_bf16(h[i]);
    if (pairs)
        for (int64_t s = 0; s < S; s++) permute_pairs(&h[s * I], I);
    if (amx)
        for (int64_t g = 0; g < n_groups; g++)
            pack_vnni(&h16[offsets[g] * I], I, int(offsets[g + 1] - offsets[g]), I, &hp[g * I * AMX_N]);

    // Phase 2: out[rows[s], j] += w_s * (down_e h_s)_j over blocks of H output columns, in runs: a thread takes a run of
    // blocks and streams each group's rows of it (one stretch of that expert's down matrix), the groups in order, so
    // every element sums its experts in one order whatever the thread count: disjoint columns per thread.
    Items items2(hblocks, threads);
    g_pool->run(threads, [&](int) {
        if (amx) amx_begin();
        std::vector<float> yd(max_t * RB_ROWS);
        for (Items::Cursor run; items2.next_run(run);) {
            for (int64_t g = 0; g < n_groups; g++) {
                const int64_t s0 = offsets[g];
                const int T = int(offsets[g + 1] - s0);
                if (T == 0) continue;
                const char* base = static_cast<const char*>(down[g]);
                const void* X = bf16 ? static_cast<const void*>(&h16[s0 * I]) : &h[s0 * I];
                const uint16_t* P = amx ? &hp[g * I * AMX_N] : nullptr;
                for (int64_t item = run.at; item < run.end; item++) {
                    const int64_t j0 = item * RB_ROWS, nr = std::min(RB_ROWS, H - j0);
                    // then this group's next block, after the run's last the next group's first block of the run
                    const char* following = item + 1 < run.end ? base + (j0 + RB_ROWS) * I * wsize
                                            : g + 1 < n_groups ? static_cast<const char*>(down[g + 1]) + run.at * RB_ROWS * I * wsize
                                                               : nullptr;
                    mat(base + j0 * I * wsize, nr, I, X, P, T, yd.data(), following);
                    for (int t = 0; t < T; t++) {
                        float* o = out + rows[s0 + t] * H + j0;
                        const float w = row_weights[s0 + t];
                        for (int64_t r = 0; r < nr; r++) o[r] += w * yd[t * RB_ROWS + r];
                    }
                }
            }
        }
        if (amx) amx_end();
    });
    return 0;
}

// experts [G] expert ids into gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I];
// offsets [G+1]: activations offsets[g]..offsets[g+1] belong to group g; rows [S]: each
// activation's token row in x [N, H]; row_weights [S] fp32; out [N, H] fp32, accumulated into.
API int moe_expert_ffn(int64_t n_groups, const int64_t* experts, const int64_t* offsets,
                       const void* gate_up, const void* down, int w_dtype, int64_t hidden, int64_t inter,
                       const void* x, int x_dtype, const int64_t* rows, const float* row_weights,
                       float* out, int num_threads, int isa_req) {
    if (n_groups < 0) return -3;
    const size_t wsize = w_dtype == F32 ? 4 : 2, matrix = size_t(inter) * size_t(hidden) * wsize;
    std::vector<const void*> g(n_groups), u(n_groups), d(n_groups);
    for (int64_t i = 0; i < n_groups; i++) {
        g[i] = static_cast<const char*>(gate_up) + size_t(experts[i]) * 2 * matrix;
        u[i] = static_cast<const char*>(g[i]) + matrix;
        d[i] = static_cast<const char*>(down) + size_t(experts[i]) * matrix;
    }
    return moe_expert_ffn_ptrs(n_groups, offsets, g.data(), u.data(), d.data(), w_dtype, hidden, inter, x, x_dtype, rows,
                               row_weights, out, num_threads, isa_req);
}
