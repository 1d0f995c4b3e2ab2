// A MoE decoder stack for a few positions after a past, in one call: per layer the stacked q/k/v product,
// attention's core (decode_ops.cpp), the output product, the residual add fused with the next norm, the
// router's softmax top-k and the routed experts (expert_ffn.cpp / quant_ffn.cpp), every expert on the CPU.
// It is the per-layer sequence engine/model/lean_decode.py runs op by op, without the ~40 µs of Python per
// layer between the ops (engine/model/decode_stack.py: the descriptors, the conditions, the accounting).
// DeepSeek-V2's layers (engine/model/lean_deepseek.py) take the same path with the absorbed latent attention
// (mla_attention) in place of attention's core, the routed weights scaled and the shared experts added; Qwen2-MoE's
// with its q/k/v biases added after their product and its shared expert scaled by its sigmoid gate.
// Each position's row is computed alone in a fixed order, and the experts are summed per token in ascending
// expert id, so a verification pass equals its decode steps bit for bit. fp32 activations; dense weights
// fp32, bf16 or quantized (moe_q_linear's layout). Plain C ABI.

#include <chrono>

#include "common.h"

#if defined(__linux__)
#include <sys/mman.h>  // mincore, madvise: the disk tier's experts asked for ahead
#include <unistd.h>
#endif

#define API extern "C" __attribute__((visibility("default")))

extern "C" {  // the pieces, from the same library
int moe_add_rms_norm(float* x, const float* r, const float* w, float eps, int64_t rows, int64_t n, float* y);
int moe_attention_step(float* q, int64_t q_stride, float* k, int64_t k_stride, const float* v, int64_t v_stride, int64_t T,
                       int64_t Hq, int64_t Hkv, int64_t D, const float* q_norm, const float* k_norm, float eps,
                       const float* cos, const float* sin, float* k_cache, float* v_cache, int64_t capacity, int64_t past,
                       int64_t window, float scale, float* out, int64_t out_stride, int threads);
int moe_router_topk(const float* x, const float* w, int64_t T, int64_t E, int64_t H, int64_t k, int normalize,
                    float* logits, float* weights, int64_t* experts, int threads);
int moe_linear_f32(const float* x, const float* w, const float* b, int64_t T, int64_t R, int64_t K, float* y,
                   int64_t y_stride, int threads);
int moe_linear_bf16w(const float* x, const uint16_t* w, const float* b, int64_t T, int64_t R, int64_t K, float* y,
                     int64_t y_stride, int threads);
int moe_q_linear(const uint8_t* q, const uint16_t* s, const uint16_t* m, int bits, int64_t n_rows, int64_t k,
                 const float* x, int64_t n_tokens, float* out, int num_threads, int isa_req);
int moe_head_f32(int transposed, const float* x, int64_t x_g, int64_t x_t, const float* w, int64_t w_g, int64_t T,
                 int64_t G, int64_t R, int64_t K, float* y, int threads);
int moe_head_bf16w(int transposed, const float* x, int64_t x_g, int64_t x_t, const uint16_t* w, int64_t w_g, int64_t T,
                   int64_t G, int64_t R, int64_t K, float* y, int threads);
int moe_latent_attention(const float* q, int64_t q_t, int64_t q_h, const float* q_pe, int64_t pe_t, int64_t pe_h,
                         const float* latents, int64_t latent_stride, const float* rope_keys, int64_t rope_stride, int64_t T,
                         int64_t H, int64_t R, int64_t Dr, int64_t past, float scale, float* out, int threads);
int moe_expert_ffn(int64_t n_groups, const int64_t* experts, const int64_t* offsets, const void* gate_up, const void* down,
                   int w_dtype, int64_t hidden, int64_t inter, const void* x, int x_dtype, const int64_t* rows,
                   const float* row_weights, float* out, int num_threads, int isa_req);
int moe_expert_ffn_q(int64_t n_groups, const int64_t* experts, const int64_t* offsets, const uint8_t* gu_q,
                     const uint16_t* gu_s, const uint16_t* gu_m, const uint8_t* dn_q, const uint16_t* dn_s,
                     const uint16_t* dn_m, int bits, int64_t hidden, int64_t inter, const void* x, int x_dtype,
                     const int64_t* rows, const int64_t* rows_out, const float* row_weights, float* out, int num_threads,
                     int isa_req);
}

// One bias-free linear layer: fp32 W [rows, k], or bf16 w16 (a bf16 checkpoint in fp32, engine/model/bf16_linear.py:
// widened as it is read, the same bits), or (both null) a quantized matrix in moe_q_linear's layout.
struct DenseWeight {
    const float* w;
    const uint16_t* w16;
    const uint8_t* q;
    const uint16_t *s, *m;  // m: int4's minimums, null for int8
    int64_t bits, rows, k;
};

// One decoder layer. The ctypes twin in engine/model/decode_stack.py must match field for field.
struct StackLayer {
    const float *input_norm, *post_norm;  // [H]
    DenseWeight qkv;                      // [(H_q + 2 H_kv) D, H]: q rows, then k, then v; or q's alone, where kv has rows
    DenseWeight kv;                       // [2 H_kv D, H]: k rows, then v, in another format (int4's int8); rows 0: none
    DenseWeight o;                        // [H, H_q D]
    const float *q_norm, *k_norm;         // [D] Qwen3's per-head norms, or [H_q D], [H_kv D] OLMoE's (whole_qk_norm); or null
    const float* router;                  // [E, H]; null: a dense MLP layer (gate, up, down below; qwen3_moe's mlp_only_layers)
    DenseWeight gate, up, down_proj;      // [I', H], [I', H], [H, I']: a dense layer's MLP; with a router, shared experts
    int64_t expert_bits, w_dtype;         // bits 8/4: quantized experts (gu_*/dn_*); 0: float (gate_up/down, w_dtype)
    const void *gate_up, *down;           // [E, 2I, H], [E, H, I]
    const uint8_t *gu_q, *dn_q;
    const uint16_t *gu_s, *gu_m, *dn_s, *dn_m;
    int64_t read_ahead;                   // 1: the experts are read in place from a mapped file (the disk tier)
    float *k_cache, *v_cache;             // [H_kv, capacity, D]: this call's cache; entries past..past+T-1 written
    int64_t capacity;
    // DeepSeek-V2 (MLA): qkv holds q [H_q (nope + rope), H] then kv_a [R + rope, H]; k_cache the latents [capacity, R],
    // v_cache the rotated rope keys [capacity, rope]
    const float* kv_a_norm;               // [R]; null: not an MLA layer
    const void* kv_b;                     // [H_q (nope + v), R], fp32, or bf16 where kv_b_bf16
    int64_t kv_b_bf16;
    // Qwen2-MoE: q/k/v's biases and its shared expert's gate
    const float* qkv_bias;                // [(H_q + 2 H_kv) D], added after the q/k/v product(s); or null
    DenseWeight shared_gate;              // [1, H]: the shared experts' output scaled by sigmoid(shared_gate h); rows 0: none
    int64_t window;                       // > 0: a sliding window, position p attending to keys (p - window, p]; 0: none
};

struct StackShape {
    int64_t layers, H, Hq, Hkv, D, E, k, I, normalize, float_isa, q_isa;
    float eps, head_eps, scale;  // the norms' eps, the q/k norms' (MLA: the latent norm's) eps, attention's scale
    int64_t R, nope, rope, vdim;  // MLA's latent rank and per-head widths; R 0: llama-like attention
    float routed_scale;           // the routed experts' weights times this (DeepSeek's routed_scaling_factor; else 1)
    int64_t whole_qk_norm;        // 1: q_norm and k_norm span the whole projection, before the head view (OLMoE)
    float clip;                   // > 0: q, k and v clamped to [-clip, clip] after those norms (OLMoE's clip_qkv); 0: none
};

namespace {

int dense(const DenseWeight& d, const float* x, int64_t T, float* y, int threads, int q_isa) {
    if (d.w16) return moe_linear_bf16w(x, d.w16, nullptr, T, d.rows, d.k, y, d.rows, threads);
    if (d.w) return moe_linear_f32(x, d.w, nullptr, T, d.rows, d.k, y, d.rows, threads);
    return moe_q_linear(d.q, d.s, d.m, int(d.bits), d.rows, d.k, x, T, y, threads, q_isa);
}

enum Part { EXPERTS, DENSE, ATTENTION, ROUTING };  // seconds[part], for `bench generate --by-part`

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// A pass's scratch, sized once per call.
struct Scratch {
    std::vector<float> x, h, qkv, att, o, logits, mlp, row_w, gate, up, shared, shared_w, q_latent, context;
    std::vector<int64_t> order, ids, offsets, rows;
    std::vector<unsigned char> pages;  // mincore's answer
};

// out [T, H] = down(silu(gate h) · up h): a dense layer among the sparse ones (qwen3_moe's mlp_only_layers, DeepSeek's
// first), or DeepSeek's shared experts
int dense_mlp(const StackLayer& L, const float* h, int64_t T, float* out, Scratch& b, int threads, int q_isa) {
    b.gate.resize(T * L.gate.rows), b.up.resize(T * L.gate.rows);
    if (dense(L.gate, h, T, b.gate.data(), threads, q_isa) || dense(L.up, h, T, b.up.data(), threads, q_isa)) return 1;
    for (size_t i = 0; i < b.gate.size(); ++i) b.gate[i] = b.gate[i] / (1.f + std::exp(-b.gate[i])) * b.up[i];
    return dense(L.down_proj, b.gate.data(), T, out, threads, q_isa);
}

// mlp [T, H] += the shared experts of h: DeepseekV2Moe's added as they are, Qwen2MoeSparseMoeBlock's shared expert times
// sigmoid(shared_expert_gate h) per token (transformers' order: scaled, then added)
int add_shared(const StackLayer& L, const float* h, int64_t T, int64_t H, float* mlp, Scratch& b, int threads, int q_isa) {
    b.shared.resize(T * H), b.shared_w.assign(T, 1.f);
    if (dense_mlp(L, h, T, b.shared.data(), b, threads, q_isa)) return 1;
    if (L.shared_gate.rows > 0) {
        if (L.shared_gate.rows != 1 || dense(L.shared_gate, h, T, b.shared_w.data(), threads, q_isa)) return 1;
        for (float& g : b.shared_w) g = 1.f / (1.f + std::exp(-g));
    }
    for (int64_t t = 0; t < T; ++t)  // (an ungated one times 1: its own bits)
        for (int64_t i = 0; i < H; ++i) mlp[t * H + i] += b.shared_w[t] * b.shared[t * H + i];
    return 0;
}

// q [T, nq] and k, v [T, nkv] (rows q_stride and kv_stride apart) += bias [nq + nkv]: Qwen2-MoE's q/k/v biases, one fp32
// add per output after the product, as quant/dense.py's FusedQuantLinear adds them (int4's two products: q's part, then
// k and v's)
void add_qkv_bias(const float* bias, float* q, int64_t q_stride, int64_t nq, float* kv, int64_t kv_stride, int64_t nkv,
                  int64_t T) {
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t i = 0; i < nq; ++i) q[t * q_stride + i] += bias[i];
        for (int64_t i = 0; i < nkv; ++i) kv[t * kv_stride + i] += bias[nq + i];
    }
}

// OLMoE's q and k norms over the whole projection (transformers' q_norm(q_proj(h)) before the head view), then its
// clip_qkv on q, k and v, in place: q [T, H_q D] and k, v [T, H_kv D] each, rows q_stride and kv_stride apart
void whole_qk_norm(const StackShape& s, const StackLayer& L, float* q, int64_t q_stride, float* kv, int64_t kv_stride,
                   int64_t T) {
    const int64_t nq = s.Hq * s.D, nk = s.Hkv * s.D;
    for (int64_t t = 0; t < T; ++t) {
        float *qt = q + t * q_stride, *kt = kv + t * kv_stride;
        moe_add_rms_norm(qt, nullptr, L.q_norm, s.head_eps, 1, nq, qt);
        moe_add_rms_norm(kt, nullptr, L.k_norm, s.head_eps, 1, nk, kt);
        if (s.clip > 0.f) {
            for (int64_t i = 0; i < nq; ++i) qt[i] = std::min(std::max(qt[i], -s.clip), s.clip);
            for (int64_t i = 0; i < 2 * nk; ++i) kt[i] = std::min(std::max(kt[i], -s.clip), s.clip);  // k, then v
        }
    }
}

// DeepSeek's rotary on interleaved pairs, (x0 + i x1)(cos + i sin) as transformers' complex product: x, y [rope]
void rotate_pairs(const float* x, const float* cos, const float* sin, float* y, int64_t rope) {
    for (int64_t j = 0; j < rope / 2; ++j) {
        const float x0 = x[2 * j], x1 = x[2 * j + 1];
        y[2 * j] = x0 * cos[j] - x1 * sin[j];
        y[2 * j + 1] = x0 * sin[j] + x1 * cos[j];
    }
}

// DeepSeek-V2's absorbed latent attention (engine/model/mla.py) for T positions after `past`: q [T, H_q (nope + rope)]
// (its rope parts rotated in place) and c_kpe [T, R + rope], rows q_stride and kv_stride apart -> att [T, H_q v]; the
// normed latents and rotated rope keys written to the cache. cos, sin [T, rope / 2].
int mla_attention(const StackShape& s, const StackLayer& L, float* q, int64_t q_stride, const float* c_kpe, int64_t kv_stride,
                  int64_t T, int64_t past, const float* cos, const float* sin, float* att, Scratch& b, int threads) {
    const int64_t R = s.R, nope = s.nope, rope = s.rope, Dq = nope + rope, H = s.Hq, half = rope / 2;
    const int64_t w_g = (nope + s.vdim) * R;  // kv_b's rows per head: W_uk [nope, R], then W_uv [v, R]
    for (int64_t t = 0; t < T; ++t) {
        const float* row = c_kpe + t * kv_stride;
        if (moe_add_rms_norm(const_cast<float*>(row), nullptr, L.kv_a_norm, s.head_eps, 1, R, L.k_cache + (past + t) * R))
            return 1;  // (x is not written without a residual)
        rotate_pairs(row + R, cos + t * half, sin + t * half, L.v_cache + (past + t) * rope, rope);
        for (int64_t h = 0; h < H; ++h) {
            float* pe = q + t * q_stride + h * Dq + nope;
            rotate_pairs(pe, cos + t * half, sin + t * half, pe, rope);
        }
    }
    b.q_latent.resize(T * H * R), b.context.resize(T * H * R);
    const auto* w16 = static_cast<const uint16_t*>(L.kv_b);
    const auto* w32 = static_cast<const float*>(L.kv_b);
    // q_latent [T, H, R] = q_nope[h, t] · W_uk[h]
    if (L.kv_b_bf16 ? moe_head_bf16w(0, q, Dq, q_stride, w16, w_g, T, H, R, nope, b.q_latent.data(), threads)
                    : moe_head_f32(0, q, Dq, q_stride, w32, w_g, T, H, R, nope, b.q_latent.data(), threads))
        return 2;
    // context [T, H, R] = softmax(scale (q_latent cᵀ + q_pe k_peᵀ)) c over the cache, causal after the past
    if (moe_latent_attention(b.q_latent.data(), H * R, R, q + nope, q_stride, Dq, L.k_cache, R, L.v_cache, rope, T, H, R, rope,
                             past, s.scale, b.context.data(), threads))
        return 3;
    // att [T, H, v] = context[t, h] · W_uv[h]ᵀ
    const int64_t off = nope * R;
    return (L.kv_b_bf16 ? moe_head_bf16w(1, b.context.data(), R, H * R, w16 + off, w_g, T, H, s.vdim, R, att, threads)
                        : moe_head_f32(1, b.context.data(), R, H * R, w32 + off, w_g, T, H, s.vdim, R, att, threads)) ? 4 : 0;
}

// Whether every page of [p, p + bytes) is in the page cache (mincore, ~1 µs a call); Linux only (elsewhere: yes).
bool resident(const void* p, int64_t bytes, std::vector<unsigned char>& pages) {
#if defined(__linux__)
    static const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
    const uintptr_t first = uintptr_t(p) & ~(page - 1), span = uintptr_t(p) + uintptr_t(bytes) - first;
    pages.resize((span + page - 1) / page);
    return mincore(reinterpret_cast<void*>(first), span, pages.data()) != 0 ||
           std::all_of(pages.begin(), pages.end(), [](unsigned char v) { return v & 1; });
#else
    (void)p, (void)bytes, (void)pages;
    return true;
#endif
}

// Ask the kernel to read [p, p + bytes) of a mapped file now, exactly those pages in one request, unless all are in the
// page cache (asking walks the page cache even where every page is there). Without it a cold range came in by page
// faults, each reading the device's read-around window (8 MiB on some disks) of mostly other experts.
void will_need(const void* p, int64_t bytes, std::vector<unsigned char>& pages) {
#if defined(__linux__)
    if (resident(p, bytes, pages)) return;
    static const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
    const uintptr_t first = uintptr_t(p) & ~(page - 1);
    madvise(reinterpret_cast<void*>(first), uintptr_t(p) + uintptr_t(bytes) - first, MADV_WILLNEED);  // advice only
#else
    (void)p, (void)bytes, (void)pages;
#endif
}

// The disk tier: the routed experts of layer L (ids[0..groups)) asked for before the kernel reads them. A quantized
// expert is six ranges of its cache file (q, scale and minimum of gate_up and down, each field stacked over the experts),
// a float one two. One mincore per expert on warm steps: its gate_up (the largest range, its bytes read with the rest
// each time it is routed) stands for all; only where it is missing are the others checked and asked for.
void read_experts_ahead(const StackShape& s, const StackLayer& L, const int64_t* ids, int64_t groups, Scratch& b) {
    const int64_t H = s.H, I = s.I, bits = L.expert_bits, Hp = (H + 31) / 32 * 32, Ip = (I + 31) / 32 * 32;
    const int64_t w_size = L.w_dtype == F32 ? 4 : 2, gu_q = 2 * I * Hp * bits / 8, gu_s = 2 * I * Hp / 32;
    const int64_t dn_q = H * Ip * bits / 8, dn_s = H * Ip / 32;  // bytes, elements (fp16) per expert
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t e = ids[g];
        if (!bits) {
            const auto* gate_up = static_cast<const char*>(L.gate_up) + e * 2 * I * H * w_size;
            if (!resident(gate_up, 2 * I * H * w_size, b.pages)) {
                will_need(gate_up, 2 * I * H * w_size, b.pages);
                will_need(static_cast<const char*>(L.down) + e * H * I * w_size, H * I * w_size, b.pages);
            }
            continue;
        }
        if (resident(L.gu_q + e * gu_q, gu_q, b.pages)) continue;
        will_need(L.gu_q + e * gu_q, gu_q, b.pages);
        will_need(L.dn_q + e * dn_q, dn_q, b.pages);
        for (const uint16_t* gu : {L.gu_s, L.gu_m})
            if (gu) will_need(gu + e * gu_s, gu_s * 2, b.pages);
        for (const uint16_t* dn : {L.dn_s, L.dn_m})
            if (dn) will_need(dn + e * dn_s, dn_s * 2, b.pages);
    }
}

// mlp [T, H] = the routed experts' weighted sum; experts/weights [T, k] the router's choice
int moe_block(const StackShape& s, const StackLayer& L, const float* h, int64_t T, int64_t* experts, float* weights,
              int64_t* counts, Scratch& b, double* seconds, int threads) {
    const int64_t k = s.k, S = T * k;
    const double t_route = now();
    if (moe_router_topk(h, L.router, T, s.E, s.H, k, int(s.normalize), b.logits.data(), weights, experts, threads)) return 1;
    if (s.routed_scale != 1.f)
        for (int64_t a = 0; a < S; ++a) weights[a] *= s.routed_scale;  // transformers' topk_weights * routed_scaling_factor
    // activations grouped by expert id, ascending, stable: each token's experts summed in ascending id, whatever T
    for (int64_t a = 0; a < S; ++a) b.order[a] = a;
    std::stable_sort(b.order.begin(), b.order.end(), [&](int64_t x, int64_t y) { return experts[x] < experts[y]; });
    int64_t groups = 0;
    for (int64_t p = 0; p < S; ++p) {
        const int64_t a = b.order[p], e = experts[a];
        if (p == 0 || e != b.ids[groups - 1]) b.offsets[groups] = p, b.ids[groups++] = e;
        b.rows[p] = a / k;
        b.row_w[p] = weights[a];
    }
    b.offsets[groups] = S;
    for (int64_t g = 0; g < groups; ++g) counts[b.ids[g]] = b.offsets[g + 1] - b.offsets[g];
    std::fill(b.mlp.begin(), b.mlp.end(), 0.f);
    const double t0 = now();
    seconds[ROUTING] += t0 - t_route;
    if (L.read_ahead) read_experts_ahead(s, L, b.ids.data(), groups, b);
    const int rc = L.expert_bits
        ? moe_expert_ffn_q(groups, b.ids.data(), b.offsets.data(), L.gu_q, L.gu_s, L.gu_m, L.dn_q, L.dn_s, L.dn_m,
                           int(L.expert_bits), s.H, s.I, h, F32, b.rows.data(), b.rows.data(), b.row_w.data(), b.mlp.data(),
                           threads, int(s.q_isa))
        : moe_expert_ffn(groups, b.ids.data(), b.offsets.data(), L.gate_up, L.down, int(L.w_dtype), s.H, s.I, h, F32,
                         b.rows.data(), b.row_w.data(), b.mlp.data(), threads, int(s.float_isa));
    seconds[EXPERTS] += now() - t0;
    return rc ? 2 : 0;
}

}  // namespace

// x [T, H]: the embeddings in, the residual stream out; or null, with ids [T] rows of embed [vocab, H] (fp32, or bf16
// where embed_bf16) gathered into scratch instead (out-of-range ids: 3); h_out [T, H]: final_norm(x), or null; with `head` (else
// null), logits [keep, V] = head(final_norm(x)) of the last `keep` rows: the pass and its head in one call;
// experts_out / weights_out [layers, T, k]: each layer's routing (for the counters; -1 in a dense layer); counts_out
// [layers, E]: activations per expert (0 in a dense layer), also added to counts_sum [layers, E] unless null (the
// step's counters, where their rows are the stack's layers: no torch call to add them); cos, sin [>= past + T, D]
// tables from position 0, rows past.. read (MLA: [.., rope / 2], the rotation's real and imaginary parts); seconds[4] += the experts', the dense products' (the head's too),
// attention's and the routing's seconds.
// Returns 0, or (layer + 1) * 16 + the failing stage (the head: layer = layers).
API int moe_decode_stack(const StackShape* shape, const StackLayer* layers, int64_t T, int64_t past, const float* cos,
                         const float* sin, const int64_t* ids, const void* embed, int64_t vocab, int64_t embed_bf16,
                         float* x,
                         const float* final_norm, float* h_out, const DenseWeight* head, int64_t keep, float* logits,
                         int64_t* experts_out, float* weights_out, int64_t* counts_out, int64_t* counts_sum,
                         double* seconds, int threads) {
    const StackShape& s = *shape;
    const bool mla = s.R > 0;
    const int64_t H = s.H, k = s.k, S = T * k;
    const int64_t Aq = mla ? s.Hq * (s.nope + s.rope) : s.Hq * s.D;     // q's width
    const int64_t Wqkv = Aq + (mla ? s.R + s.rope : 2 * s.Hkv * s.D);  // with k and v (MLA: the compressed KV and k_pe)
    const int64_t A = mla ? s.Hq * s.vdim : Aq;                         // attention's output
    if (T <= 0 || s.layers <= 0 || k <= 0 || k > s.E || (head ? keep <= 0 || keep > T || !logits : !h_out)) return 1;
    const int64_t rotary = mla ? s.rope / 2 : s.D;  // the tables' row width
    cos += past * rotary, sin += past * rotary;
    Scratch b;
    if (embed) {  // the pass's embeddings gathered here: the residual stream in scratch
        b.x.resize(T * H), x = b.x.data();
        for (int64_t t = 0; t < T; ++t) {
            if (ids[t] < 0 || ids[t] >= vocab) return 3;
            if (embed_bf16) {  // widened: the fp32 table's numbers
                const uint16_t* row = static_cast<const uint16_t*>(embed) + ids[t] * H;
                for (int64_t i = 0; i < H; ++i) {
                    const uint32_t bits = uint32_t(row[i]) << 16;
                    std::memcpy(x + t * H + i, &bits, 4);
                }
            } else {
                const float* row = static_cast<const float*>(embed) + ids[t] * H;
                std::copy(row, row + H, x + t * H);
            }
        }
    }
    b.h.resize(T * H), b.qkv.resize(T * Wqkv), b.att.resize(T * A), b.o.resize(T * H), b.logits.resize(T * s.E);
    b.mlp.resize(T * H), b.row_w.resize(S), b.order.resize(S), b.ids.resize(S), b.offsets.resize(S + 1), b.rows.resize(S);
    float* h = b.h.data();
    if (moe_add_rms_norm(x, nullptr, layers[0].input_norm, s.eps, T, H, h)) return 2;
    for (int64_t l = 0; l < s.layers; ++l) {
        const StackLayer& L = layers[l];
        const int fail = int((l + 1) * 16), q_isa = int(s.q_isa);
        // one product: [T, Wqkv] rows of q heads, k heads, v heads; two: q [T, Aq], then k and v [T, 2 H_kv D]
        float* q = b.qkv.data();
        const int64_t split = L.kv.rows > 0, q_stride = split ? Aq : Wqkv, kv_stride = split ? Wqkv - Aq : Wqkv;
        float* kv = split ? q + T * Aq : q + Aq;
        const double t0 = now();
        if (dense(L.qkv, h, T, q, threads, q_isa)) return fail + 1;
        if (split && dense(L.kv, h, T, kv, threads, q_isa)) return fail + 1;
        if (L.qkv_bias) add_qkv_bias(L.qkv_bias, q, q_stride, Aq, kv, kv_stride, Wqkv - Aq, T);
        const double t1 = now();
        if (s.whole_qk_norm) whole_qk_norm(s, L, q, q_stride, kv, kv_stride, T);
        const float *q_norm = s.whole_qk_norm ? nullptr : L.q_norm, *k_norm = s.whole_qk_norm ? nullptr : L.k_norm;
        if (L.kv_a_norm ? mla_attention(s, L, q, q_stride, kv, kv_stride, T, past, cos, sin, b.att.data(), b, threads)
                        : moe_attention_step(q, q_stride, kv, kv_stride, kv + s.Hkv * s.D, kv_stride, T, s.Hq, s.Hkv, s.D,
                                             q_norm, k_norm, s.head_eps, cos, sin, L.k_cache, L.v_cache, L.capacity, past,
                                             L.window, s.scale, b.att.data(), A, threads))
            return fail + 2;
        const double t2 = now();
        if (dense(L.o, b.att.data(), T, b.o.data(), threads, q_isa)) return fail + 3;
        const double t3 = now();
        seconds[DENSE] += (t1 - t0) + (t3 - t2);
        seconds[ATTENTION] += t2 - t1;
        if (moe_add_rms_norm(x, b.o.data(), L.post_norm, s.eps, T, H, h)) return fail + 4;
        int64_t* experts = experts_out + l * S;  // [T, k]
        float* weights = weights_out + l * S;
        int64_t* counts = counts_out + l * s.E;  // [E]
        std::fill(counts, counts + s.E, int64_t(0));
        if (!L.router) {
            std::fill(experts, experts + S, int64_t(-1));
            std::fill(weights, weights + S, 0.f);
            const double t4 = now();
            if (dense_mlp(L, h, T, b.mlp.data(), b, threads, q_isa)) return fail + 5;
            seconds[DENSE] += now() - t4;
        } else if (int rc = moe_block(s, L, h, T, experts, weights, counts, b, seconds, threads)) {
            return fail + 5 + rc;
        } else if (L.gate.rows > 0) {  // shared experts: routed + shared
            const double t4 = now();
            if (add_shared(L, h, T, H, b.mlp.data(), b, threads, q_isa)) return fail + 9;
            seconds[DENSE] += now() - t4;
        }
        if (counts_sum)
            for (int64_t e = 0; e < s.E; ++e) counts_sum[l * s.E + e] += counts[e];
        const bool last = l + 1 == s.layers;
        if (moe_add_rms_norm(x, b.mlp.data(), last ? final_norm : layers[l + 1].input_norm, s.eps, T, H,
                             last && h_out ? h_out : h))
            return fail + 8;
    }
    if (!head) return 0;
    const double t0 = now();  // the head reads the last `keep` rows of final_norm(x)
    const float* normed = (h_out ? h_out : h) + (T - keep) * H;
    if (dense(*head, normed, keep, logits, threads, int(s.q_isa))) return int((s.layers + 1) * 16 + 1);
    seconds[DENSE] += now() - t0;
    return 0;
}
