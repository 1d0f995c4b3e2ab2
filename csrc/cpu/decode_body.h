// The bodies of decode_ops.cpp's kernels, included once per instruction set (inside a namespace and a
// target region), so one source serves the portable build and the AVX2+FMA build. No includes here.
// Every reduction runs in 16 lanes (vector types), summed in one fixed order, so a row's bits never depend
// on the other rows of its call.

typedef float vec8 __attribute__((vector_size(32)));  // one AVX2 register; two SSE registers elsewhere

inline vec8 load8(const float* p) {
    vec8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

// bf16 weights: the high half of an fp32, widened exactly, so a product equals the fp32 weight's bit for bit
inline vec8 load8(const uint16_t* p) {
#ifdef MOE_BODY_AVX2  // one vpmovzxwd from memory and a shift; GCC builds the generic form below from two halves
    return vec8(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16)));
#else
    typedef uint16_t u16x8 __attribute__((vector_size(16)));
    typedef uint32_t u32x8 __attribute__((vector_size(32)));
    u16x8 h;
    __builtin_memcpy(&h, p, sizeof h);
    const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    vec8 v;
    __builtin_memcpy(&v, &w, sizeof v);
    return v;
#endif
}

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
    const uint32_t u = uint32_t(v) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

template <typename W>
inline float dot(const float* a, const W* b, int64_t n) {
    vec8 lo = {}, hi = {};  // 16 lanes in two independent chains
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        lo += load8(a + i) * load8(b + i);
        hi += load8(a + i + 8) * load8(b + i + 8);
    }
    const vec8 acc = lo + hi;
    float s = 0.f;
    for (int l = 0; l < 8; ++l) s += acc[l];
    for (; i < n; ++i) s = std::fma(a[i], widen(b[i]), s);  // explicitly fused: the compiler's contraction varies by loop
    return s;
}

// dot() of one a with 4 rows of b (`stride` apart) at once: each x load serves 4 rows and 8 chains hide the adds'
// latency; every row's sum runs in dot()'s order (its own two chains, the same lanes, the same tail)
template <typename W>
inline void dot4(const float* a, const W* b, int64_t stride, int64_t n, float* out) {
    vec8 lo[4] = {}, hi[4] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const vec8 x0 = load8(a + i), x1 = load8(a + i + 8);
        for (int j = 0; j < 4; ++j) {
            __builtin_prefetch(b + (4 + j) * stride + i, 0, 2);  // the next 4 rows into L2 (locality 2): see x86_tiles.h
            lo[j] += x0 * load8(b + j * stride + i);
            hi[j] += x1 * load8(b + j * stride + i + 8);
        }
    }
    for (int j = 0; j < 4; ++j) {
        const vec8 acc = lo[j] + hi[j];
        float s = 0.f;
        for (int l = 0; l < 8; ++l) s += acc[l];
        for (int64_t k = i; k < n; ++k) s = std::fma(a[k], widen(b[j * stride + k]), s);
        out[j] = s;
    }
}

inline float sum_squares(const float* a, int64_t n) { return dot(a, a, n); }

// y = w * (x * rsqrt(mean(x^2) + eps)), transformers' RMSNorm order; y may be x
inline void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
    const float r = 1.f / std::sqrt(sum_squares(x, n) / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

// x[n] -> x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]) (apply_rotary_pos_emb)
inline void rotate_row(float* x, const float* cos, const float* sin, int64_t n, float* tmp) {
    const int64_t half = n / 2;
    for (int64_t i = 0; i < half; ++i) tmp[i] = x[i] * cos[i] - x[i + half] * sin[i];
    for (int64_t i = half; i < n; ++i) tmp[i] = x[i] * cos[i] + x[i - half] * sin[i];
    for (int64_t i = 0; i < n; ++i) x[i] = tmp[i];
}

typedef int32_t ivec8 __attribute__((vector_size(32)));

// exp(x) for x <= 0 in 8 lanes (softmax after subtracting the max), within 2 ulp: x = n·ln2 + r, |r| <= ln2/2, a
// degree-6 polynomial for e^r, 2^n from the exponent bits
inline vec8 exp_nonpositive8(vec8 x) {
    x = x < -87.f ? vec8{} - 87.f : x;  // e^-87 ~ 1.6e-38: the smallest normal float; below it the term is 0 for softmax
    const vec8 half = x < 0.f ? vec8{} - 0.5f : vec8{} + 0.5f;
    const vec8 n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504f + half, ivec8), vec8);  // round(x/ln2)
    const vec8 r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // ln2 split in two: exact first product
    vec8 p = vec8{} + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    ivec8 bits;
    __builtin_memcpy(&bits, &p, sizeof bits);
    bits += __builtin_convertvector(n, ivec8) << 23;  // p in [0.7, 1.42], n >= -126: the result stays normal
    __builtin_memcpy(&p, &bits, sizeof p);
    return p;
}

// a vector's lanes summed as a tree in one fixed order
inline float hsum8(vec8 v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// p[0..n) = softmax(p) in place: exponentials 8 lanes at a time (the last n % 8 in a padded vector), their sum in 8
// running lanes then hsum8 and the tail in order; every step depends on n alone, so a row's bits do not
inline void softmax_row(float* p, int64_t n) {
    vec8 top8 = vec8{} - INFINITY, sum8 = {};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const vec8 x = load8(p + j);
        top8 = x > top8 ? x : top8;
    }
    float top = -INFINITY;
    for (int l = 0; l < 8; ++l) top = std::max(top, top8[l]);
    for (int64_t m = j; m < n; ++m) top = std::max(top, p[m]);
    for (j = 0; j + 8 <= n; j += 8) {
        const vec8 e = exp_nonpositive8(load8(p + j) - top);
        __builtin_memcpy(p + j, &e, sizeof e);
        sum8 += e;
    }
    vec8 tail = vec8{} + top;  // padding: exp(0), never stored nor summed
    __builtin_memcpy(&tail, p + j, (n - j) * sizeof(float));
    tail = exp_nonpositive8(tail - top);
    float total = hsum8(sum8);
    for (int64_t m = j; m < n; ++m) total += (p[m] = tail[m - j]);
    const vec8 inv = vec8{} + 1.f / total;
    for (j = 0; j + 8 <= n; j += 8) {
        const vec8 y = load8(p + j) * inv;
        __builtin_memcpy(p + j, &y, sizeof y);
    }
    for (; j < n; ++j) p[j] *= inv[0];
}


// out[i·NK + j] = a[i] · b[j·stride..] over n, for NR rows a[i] and NK rows of b: each one 8-lane chain, summed by
// hsum8, then the scalar tail, so every (i, j) has the bits of a 1 × 1 block whatever its company
template <int NR, int NK>
inline void dot_block(const float* const* a, const float* b, int64_t stride, int64_t n, float* out) {
    vec8 acc[NR][NK] = {};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        vec8 bv[NK];
        for (int j = 0; j < NK; ++j) bv[j] = load8(b + j * stride + k);
        for (int i = 0; i < NR; ++i) {
            const vec8 av = load8(a[i] + k);
            for (int j = 0; j < NK; ++j) acc[i][j] += av * bv[j];
        }
    }
    for (int i = 0; i < NR; ++i)
        for (int j = 0; j < NK; ++j) {
            float s = hsum8(acc[i][j]);
            for (int64_t m = k; m < n; ++m) s = std::fma(a[i][m], b[j * stride + m], s);
            out[i * NK + j] = s;
        }
}

// out[i·out_stride + 8v..] (NV vectors) += Σ_{s0 <= s < s1} p[i][s] · c[s·stride + 8v..] for NR rows: each output a
// running sum over s in order, in registers within the call, in memory between calls (first: from 0)
template <int NR, int NV>
inline void weighted_block(const float* const* p, const float* c, int64_t stride, int64_t s0, int64_t s1, float* out,
                           int64_t out_stride, bool first) {
    vec8 acc[NR][NV];
    for (int i = 0; i < NR; ++i)
        for (int v = 0; v < NV; ++v) acc[i][v] = first ? vec8{} : load8(out + i * out_stride + 8 * v);
    for (int64_t s = s0; s < s1; ++s) {
        vec8 cv[NV];
        for (int v = 0; v < NV; ++v) cv[v] = load8(c + s * stride + 8 * v);
        for (int i = 0; i < NR; ++i) {
            const vec8 pv = vec8{} + p[i][s];
            for (int v = 0; v < NV; ++v) acc[i][v] += pv * cv[v];
        }
    }
    for (int i = 0; i < NR; ++i) __builtin_memcpy(out + i * out_stride, acc[i], sizeof acc[i]);
}

// One KV head's attention for `rows` query rows: out[r] = softmax(scale · (K q[r] + K2 q2[r]))ᵀ V over the first keys[r]
// rows of the cache (keys non-decreasing in r). K2 and q2, a second part of each key and query (MLA's rotary part), may
// be null. K (and K2) and V are read once for all the rows (grouped query heads share them): scores in blocks of 4 rows
// × 2 keys, sums per tile of V (about 128 KB) in blocks of a position's heads. p [rows, max keys] scratch. A row's bits
// do not depend on which rows come with it.
inline void attend_group(const float* const* q, const float* const* q2, float* const* out, const int64_t* keys,
                         int64_t rows, const KeyRows& c, float scale, float* const* p) {
    const int64_t S = keys[rows - 1], Dv = c.Dv;
    float dots[8], dots2[8];
    for (int64_t s = 0; s < S; s += 2) {
        const int nk = S - s >= 2 ? 2 : 1;
        for (int64_t r = 0; r < rows;) {
            const int nr = rows - r >= 4 ? 4 : 1;
            for (int part = 0; part < (c.K2 ? 2 : 1); ++part) {
                const float* const* a = part ? q2 + r : q + r;
                const float* b = part ? c.K2 + s * c.k2_stride : c.K + s * c.k_stride;
                const int64_t stride = part ? c.k2_stride : c.k_stride, n = part ? c.D2 : c.D;
                float* o = part ? dots2 : dots;
                if (nr == 4 && nk == 2) dot_block<4, 2>(a, b, stride, n, o);
                else if (nr == 4) dot_block<4, 1>(a, b, stride, n, o);
                else if (nk == 2) dot_block<1, 2>(a, b, stride, n, o);
                else dot_block<1, 1>(a, b, stride, n, o);
            }
            for (int i = 0; i < nr; ++i)
                for (int j = 0; j < nk; ++j)
                    p[r + i][s + j] = (c.K2 ? dots[i * nk + j] + dots2[i * nk + j] : dots[i * nk + j]) * scale;
            r += nr;
        }
    }
    for (int64_t r = 0; r < rows; ++r) softmax_row(p[r], keys[r]);
    // Sums: per tile of keys, per block of a position's heads (4, 2 or 1 rows: same keys, outputs Dv apart), its columns
    // in blocks of 8 accumulators (4 rows × 16 columns, 2 × 32, 1 × 32), then 8 columns at a time. A tile of V is
    // about 128 KB, so it stays in L2 while the row blocks pass over it.
    const int64_t tile = std::max<int64_t>(32, 32768 / std::max<int64_t>(Dv, 1));
    for (int64_t s0 = 0; s0 < S; s0 += tile)
        for (int64_t r = 0; r < rows;) {
            int nr = 1;
            for (const int want : {SUM_ROWS, 2}) {
                bool block = r + want <= rows;
                for (int i = 1; block && i < want; ++i) block = keys[r + i] == keys[r] && out[r + i] == out[r] + i * Dv;
                if (block) { nr = want; break; }
            }
            const int64_t s1 = std::min(keys[r], s0 + tile);
            if (s0 < s1) {
                const float* v = c.V;
                const int64_t vs = c.v_stride;
                const bool first = s0 == 0;
                int64_t c0 = 0;
                if (nr == 4)
                    for (; c0 + 16 <= Dv; c0 += 16) weighted_block<4, 2>(p + r, v + c0, vs, s0, s1, out[r] + c0, Dv, first);
                else if (nr == 2)
                    for (; c0 + 32 <= Dv; c0 += 32) weighted_block<2, 4>(p + r, v + c0, vs, s0, s1, out[r] + c0, Dv, first);
                else
                    for (; c0 + 32 <= Dv; c0 += 32) weighted_block<1, 4>(p + r, v + c0, vs, s0, s1, out[r] + c0, Dv, first);
                for (; c0 + 8 <= Dv; c0 += 8)
                    for (int i = 0; i < nr; ++i) weighted_block<1, 1>(p + r + i, v + c0, vs, s0, s1, out[r + i] + c0, Dv, first);
            }
            r += nr;
        }
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 8 * (Dv / 8); d < Dv; ++d) {  // the last Dv % 8 columns
            float sum = 0.f;
            for (int64_t s = 0; s < keys[r]; ++s) sum = std::fma(p[r][s], c.V[s * c.v_stride + d], sum);
            out[r][d] = sum;
        }
}

// Rows (t, h), t < T, h < Hq, attend over keys 0..past+t of KV head g = h / (Hq / Hkv) (its cache: `cache(g)`). Threads
// take a KV head, or a part of its query heads where threads outnumber KV heads; each row is computed whole by one thread,
// so its bits depend neither on T nor on the thread count.
template <typename Cache>
inline void attend_heads(const HeadRows& a, Cache cache, int threads) {
    const int64_t group = a.Hq / a.Hkv, S = a.past + a.T;
    const KeyRows c0 = cache(0);
    const int64_t n = threads_for(threads, 4.0 * a.Hkv * S * (c0.D + c0.D2 + c0.Dv));
    const int64_t parts = std::min(group, (n + a.Hkv - 1) / a.Hkv), tasks = a.Hkv * parts;
    std::atomic<int64_t> next{0};
    g_pool->run(int(n), [&](int) {
        const int64_t most = (group / parts + 1) * a.T;  // rows of a task at most
        std::vector<float> scores(most * S);
        std::vector<const float*> q(most), q2(most);
        std::vector<float*> out(most), p(most);
        std::vector<int64_t> keys(most);
        for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
            const int64_t g = task / parts, i0 = group * (task % parts) / parts, i1 = group * (task % parts + 1) / parts;
            int64_t rows = 0;
            for (int64_t t = 0; t < a.T; ++t)  // rows position-major: one position's heads side by side
                for (int64_t h = g * group + i0; h < g * group + i1; ++h, ++rows) {
                    q[rows] = a.q + t * a.q_t + h * a.q_h, out[rows] = a.out + t * a.out_t + h * a.out_h;
                    q2[rows] = a.q2 ? a.q2 + t * a.q2_t + h * a.q2_h : nullptr;
                    p[rows] = scores.data() + rows * S, keys[rows] = a.past + t + 1;
                }
            attend_group(q.data(), q2.data(), out.data(), keys.data(), rows, cache(g), a.scale, p.data());
        }
    });
}

// y[t, r] = x[t] · W[r] (+ b[r]) for x [T, K], W [R, K], y rows y_stride apart: each output by dot() alone, so its
// bits do not depend on T; each weight row is read once for all T tokens. Threads take runs of row quads from a
// counter (a quarter of an even share each), so a core the VM slows for a while does not hold the others at the end.
template <typename W>
inline void linear(const float* x, const W* w, const float* b, int64_t T, int64_t R, int64_t K, float* y,
                   int64_t y_stride, int threads) {
    const int64_t n = threads_for(threads, double(sizeof(W)) * T * R * K);
    const int64_t quads = R / 4;  // rows 4q..4q+3 through dot4, the last R % 4 through dot: a row's path depends on r alone
    const int64_t run = std::max<int64_t>(1, quads / (4 * n));
    std::atomic<int64_t> next{0};
    g_pool->run(int(n), [&](int) {
        for (int64_t q0; (q0 = next.fetch_add(run)) < quads;)
            for (int64_t q = q0; q < std::min(quads, q0 + run); ++q)
                for (int64_t t = 0; t < T; ++t) {
                    float* yt = y + t * y_stride + 4 * q;
                    dot4(x + t * K, w + 4 * q * K, K, K, yt);
                    for (int j = 0; j < 4; ++j) yt[j] += b ? b[4 * q + j] : 0.f;
                }
    });
    for (int64_t r = 4 * quads; r < R; ++r)
        for (int64_t t = 0; t < T; ++t) y[t * y_stride + r] = dot(x + t * K, w + r * K, K) + (b ? b[r] : 0.f);
}

// linear() per group (attention head) g, each with its own inputs and weight: y[t, g, r] = x_g[t] · W_g[r], where
// x_g[t] = x + g·x_g + t·x_t, W_g = w + g·w_g with rows K apart, y [T, G, R] contiguous. Every output is dot()'s or
// dot4()'s lane, as in linear(), so its bits depend neither on T nor on G (MLA's absorbed heads, mla.py).
template <typename W>
inline void head_linear(const float* x, int64_t x_g, int64_t x_t, const W* w, int64_t w_g, int64_t T, int64_t G,
                        int64_t R, int64_t K, float* y, int threads) {
    const int64_t n = threads_for(threads, double(sizeof(W)) * T * G * R * K);
    const int64_t quads = R / 4, tasks = G * quads;  // a task: one head's rows 4q..4q+3
    const int64_t run = std::max<int64_t>(1, tasks / (4 * n));
    std::atomic<int64_t> next{0};
    g_pool->run(int(n), [&](int) {
        for (int64_t a0; (a0 = next.fetch_add(run)) < tasks;)
            for (int64_t a = a0; a < std::min(tasks, a0 + run); ++a) {
                const int64_t g = a / quads, q = a % quads;
                for (int64_t t = 0; t < T; ++t)
                    dot4(x + g * x_g + t * x_t, w + g * w_g + 4 * q * K, K, K, y + (t * G + g) * R + 4 * q);
            }
    });
    for (int64_t g = 0; g < G; ++g)
        for (int64_t r = 4 * quads; r < R; ++r)
            for (int64_t t = 0; t < T; ++t) y[(t * G + g) * R + r] = dot(x + g * x_g + t * x_t, w + g * w_g + r * K, K);
}

// head_linear's other form, y[t, g, :] = x_g[t] · W_g with W_g [K, R] rows R apart (W_g = w + g·w_g): every output one
// lane's sum over k = 0..K-1 in order, so its bits depend neither on T nor on G. A thread takes a head and streams its
// rows once, each row added into the T outputs (in cache) of that head.
template <typename W>
inline void head_matmul(const float* x, int64_t x_g, int64_t x_t, const W* w, int64_t w_g, int64_t T, int64_t G,
                        int64_t R, int64_t K, float* y, int threads) {
    const int64_t n = threads_for(threads, double(sizeof(W)) * T * G * R * K), vecs = R / 8;
    std::atomic<int64_t> next{0};
    g_pool->run(int(n), [&](int) {
        for (int64_t g; (g = next.fetch_add(1)) < G;) {
            for (int64_t t = 0; t < T; ++t) std::fill_n(y + (t * G + g) * R, R, 0.f);
            for (int64_t k = 0; k < K; ++k) {
                const W* wk = w + g * w_g + k * R;
                for (int64_t t = 0; t < T; ++t) {
                    const float xk = x[g * x_g + t * x_t + k];
                    float* yt = y + (t * G + g) * R;
                    for (int64_t v = 0; v < vecs; ++v) {
                        vec8 acc = load8(yt + 8 * v);
                        acc += (vec8{} + xk) * load8(wk + 8 * v);
                        __builtin_memcpy(yt + 8 * v, &acc, sizeof acc);
                    }
                    for (int64_t c = 8 * vecs; c < R; ++c) yt[c] = std::fma(xk, widen(wk[c]), yt[c]);
                }
            }
        }
    });
}

// x[t] += r[t] (r may be null), then y[t] = RMSNorm(x[t]) · w, for `rows` rows of n
inline void add_rms_norm(float* x, const float* r, const float* w, float eps, int64_t rows, int64_t n, float* y) {
    for (int64_t t = 0; t < rows; ++t) {
        float* xt = x + t * n;
        if (r)
            for (int64_t i = 0; i < n; ++i) xt[i] += r[t * n + i];
        rms_norm_row(xt, w, eps, n, y + t * n);
    }
}

inline void attention_step(const AttentionStep& a, int threads) {
    const int64_t D = a.D;
    // 1. per position: q and k heads normed (Qwen3's per-head norm) and rotated in place; k, v appended to the cache
    std::vector<float> tmp(D);
    for (int64_t t = 0; t < a.T; ++t) {
        const float *cos = a.cos + t * D, *sin = a.sin + t * D;
        for (int64_t h = 0; h < a.Hq; ++h) {
            float* q = a.q + t * a.q_stride + h * D;
            if (a.q_norm) rms_norm_row(q, a.q_norm, a.eps, D, q);
            rotate_row(q, cos, sin, D, tmp.data());
        }
        for (int64_t g = 0; g < a.Hkv; ++g) {
            float* k = a.k + t * a.k_stride + g * D;
            if (a.k_norm) rms_norm_row(k, a.k_norm, a.eps, D, k);
            rotate_row(k, cos, sin, D, tmp.data());
            const int64_t slot = (g * a.capacity + a.past + t) * D;
            std::memcpy(a.k_cache + slot, k, D * sizeof(float));
            std::memcpy(a.v_cache + slot, a.v + t * a.v_stride + g * D, D * sizeof(float));
        }
    }
    // 2. each KV head's query heads attend to keys 0..past+t together (K and V read once for them)
    const HeadRows rows{a.q, nullptr, a.out, a.q_stride, D, 0, 0, a.out_stride, D, a.T, a.Hq, a.Hkv, a.past, a.scale};
    attend_heads(rows, [&](int64_t g) {
        const float *K = a.k_cache + g * a.capacity * D, *V = a.v_cache + g * a.capacity * D;
        return KeyRows{K, nullptr, V, D, 0, D, D, 0, D};
    }, threads);
}

// DeepSeek-V2's absorbed attention (mla.py) over its latent cache: every query head attends to the one shared cache, keys
// [c | k_pe] and values c. Rows (t, h): q_latent (R) and q_pe (Dr) at their strides; out [T, H, R] contiguous.
inline void latent_attention(const HeadRows& rows, const float* latents, int64_t latent_stride, const float* rope_keys,
                             int64_t rope_stride, int64_t R, int64_t Dr, int threads) {
    attend_heads(rows, [&](int64_t) { return KeyRows{latents, rope_keys, latents, latent_stride, rope_stride, latent_stride,
                                                     R, Dr, R}; }, threads);
}

// Router of the llama-like MoE families: probs = softmax(x Wᵀ), the k largest (descending; ties: lower expert
// first), divided by their sum when `normalize`. x [T, H], W [E, H] -> weights [T, k], experts [T, k];
// logits [T, E] is scratch.
inline void router_topk(const float* x, const float* W, int64_t T, int64_t E, int64_t H, int64_t k, bool normalize,
                        float* logits, float* weights, int64_t* experts, int threads) {
    const int64_t tasks = T * E;  // one logit each
    const int64_t n = threads_for(threads, 4.0 * tasks * H);
    g_pool->run(int(n), [&](int tid) {
        for (int64_t task = tasks * tid / n; task < tasks * (tid + 1) / n; ++task)
            logits[task] = dot(x + task / E * H, W + task % E * H, H);
    });
    for (int64_t t = 0; t < T; ++t) {
        float* p = logits + t * E;
        float top = -INFINITY;
        for (int64_t e = 0; e < E; ++e) top = p[e] > top ? p[e] : top;
        float total = 0.f;
        for (int64_t e = 0; e < E; ++e) total += (p[e] = std::exp(p[e] - top));
        float kept = 0.f;
        for (int64_t j = 0; j < k; ++j) {  // k passes: k is small (2-16)
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e)
                if (p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;
            experts[t * k + j] = best;
            weights[t * k + j] = p[best] / total;
            kept += weights[t * k + j];
            p[best] = -1.f;  // taken
        }
        if (normalize)
            for (int64_t j = 0; j < k; ++j) weights[t * k + j] /= kept;
    }
}
