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

inline vec8 splat8(float x) { return vec8{x, x, x, x, x, x, x, x}; }  // a broadcast; vec8{} + x would add (0 + -0 is +0)

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

// p[0..n) -> exp(p - top) in place, top = max(p) (> -inf: n >= 1); returns Σ exp. The exponentials run 8 lanes at a
// time (the last n % 8 in a padded vector), their sum in 8 running lanes, then hsum8, then the tail in order: every step
// depends on n alone, so a row's bits do not
inline float exp_row(float* p, int64_t n, float* top_out) {
    vec8 top8 = splat8(-INFINITY), sum8 = {};
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
    vec8 tail = splat8(top);  // padding: exp(0), never stored nor summed
    __builtin_memcpy(&tail, p + j, (n - j) * sizeof(float));
    tail = exp_nonpositive8(tail - top);
    float total = hsum8(sum8);
    for (int64_t m = j; m < n; ++m) total += (p[m] = tail[m - j]);
    *top_out = top;
    return total;
}

// out[i] = hsum8(v[i]) for 8 vectors, bit for bit (each sum in hsum8's order; a + b == b + a exactly): in AVX2 one
// transpose-and-add tree for the 8 (21 instructions instead of about 48)
inline void hsum8x8(const vec8* v, float* out) {
#ifdef MOE_BODY_AVX2
    __m256 x[8], half[4], quarter[2];
    for (int i = 0; i < 8; ++i) x[i] = __m256(v[i]);
    for (int i = 0; i < 4; ++i)  // [v(0+4), v(1+5), v(2+6), v(3+7)] of vectors 2i | 2i+1
        half[i] = _mm256_add_ps(_mm256_permute2f128_ps(x[2 * i], x[2 * i + 1], 0x20),
                                _mm256_permute2f128_ps(x[2 * i], x[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i)  // [left, right, left', right'] of vectors 4i, 4i+2 | 4i+1, 4i+3: left = (0+4) + (2+6)
        quarter[i] = _mm256_add_ps(_mm256_shuffle_ps(half[2 * i], half[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(half[2 * i], half[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(quarter[0], quarter[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm256_shuffle_ps(quarter[0], quarter[1], _MM_SHUFFLE(3, 1, 3, 1)));  // 0 2 4 6 | 1 3 5 7
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    for (int i = 0; i < 8; ++i) out[i] = hsum8(v[i]);
#endif
}

// acc[i·NK + j] += a[i][0..n8) · b[j·stride..] lane by lane, n8 = n rounded down to 8: rows a[i] against rows of b
template <int NR, int NK>
inline void dot_lanes(const float* const* a, const float* b, int64_t stride, int64_t n, vec8* acc) {
    const float* ar[NR];
    for (int i = 0; i < NR; ++i) ar[i] = a[i];
    for (int64_t k = 0; k + 8 <= n; k += 8) {
        vec8 bv[NK];
        for (int j = 0; j < NK; ++j) bv[j] = load8(b + j * stride + k);
        for (int i = 0; i < NR; ++i) {
            const vec8 av = load8(ar[i] + k);
            for (int j = 0; j < NK; ++j) acc[i * NK + j] += av * bv[j];
        }
    }
}

// out[i·NK + j] = a[i] · b[j·stride..] over n (+ a2[i] · b2[j·stride2..] over n2 where a2 is given: MLA's rotary part),
// for NR rows a[i] and NK rows of b: one 8-lane chain over both parts' whole 8-blocks, summed by hsum8, then each part's
// scalar tail in order, so every (i, j) has the bits of a 1 × 1 block whatever its company
template <int NR, int NK>
inline void dot_block(const float* const* a, const float* b, int64_t stride, int64_t n, const float* const* a2,
                      const float* b2, int64_t stride2, int64_t n2, float* out) {
    vec8 acc[NR * NK] = {};
    dot_lanes<NR, NK>(a, b, stride, n, acc);
    if (a2) dot_lanes<NR, NK>(a2, b2, stride2, n2, acc);
    int i0 = 0;
    for (; i0 + 8 <= NR * NK; i0 += 8) hsum8x8(acc + i0, out + i0);
    for (; i0 < NR * NK; ++i0) out[i0] = hsum8(acc[i0]);
    for (int i = 0; i < NR; ++i)
        for (int j = 0; j < NK; ++j) {
            float& o = out[i * NK + j];
            for (int64_t m = n / 8 * 8; m < n; ++m) o = std::fma(a[i][m], b[j * stride + m], o);
            for (int64_t m = n2 / 8 * 8; a2 && m < n2; ++m) o = std::fma(a2[i][m], b2[j * stride2 + m], o);
        }
}

// out[i·out_stride + 8v..] (NV vectors) = Σ_{0 <= s < n} p[i][s] · c[s·stride + 8v..] for NR rows: each output one
// running sum over s in order, in registers
template <int NR, int NV>
inline void weighted_block(const float* const* p, const float* c, int64_t stride, int64_t n, float* out, int64_t out_stride) {
    vec8 acc[NR][NV] = {};
    for (int64_t s = 0; s < n; ++s) {
        vec8 cv[NV];
        for (int v = 0; v < NV; ++v) cv[v] = load8(c + s * stride + 8 * v);
        for (int i = 0; i < NR; ++i) {
            const vec8 pv = splat8(p[i][s]);
            for (int v = 0; v < NV; ++v) acc[i][v] += pv * cv[v];
        }
    }
    for (int i = 0; i < NR; ++i) __builtin_memcpy(out + i * out_stride, acc[i], sizeof acc[i]);
}

// Attention runs per chunk of KEY_CHUNK keys at fixed positions [KEY_CHUNK·c, KEY_CHUNK·(c+1)) (flash decoding): a chunk's
// keys and values are read from memory once for all the query heads that share them and stay in L2 between its scores
// and its weighted sums, and threads split the keys, not only the heads. Each chunk leaves, per row, its own maximum m,
// l = Σ exp(score - m) and acc = Σ exp(score - m)·V; a row's chunks are then folded left to right in chunk order. The
// boundaries are fixed and every sum runs in one fixed order, so a row's bits depend neither on T nor on the threads.
constexpr int64_t KEY_CHUNK = 128;  // MLA: 128 keys of 576 floats, 295 KB: in L2 with the row blocks passing over them

// Keys of up to 128 floats (Qwen3's 512 B) are prefetched 6 ahead; MLA's 2.3 KB latents the hardware prefetcher streams
// alone, and prefetching them measured slower (csrc/probes/attention_core.cpp on a Zen 3: 0.75 against 0.95 ms at 1500)
constexpr int64_t PREFETCH_KEYS = 6, PREFETCH_KEY_FLOATS = 128;

inline void prefetch_row(const float* p, int64_t n) {  // every cache line of p[0..n)
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 3);
}

struct ChunkRows {  // one task's rows of one KV head: q, q2 (may be null), their keys, and per row its partial slot
    const float* const* q;
    const float* const* q2;
    const int64_t* keys;  // keys[r]: the row attends to keys lo[r]..keys[r]-1 (both non-decreasing in r)
    const int64_t* lo;    // 0, or where a sliding window starts
    float* const* acc;  // acc[r] [Dv]: Σ exp(score - m)·V over the chunk
    float *m, *l;  // [rows]
    int64_t rows;
};

// dot_block of NR rows against nk (1-3) keys
template <int NR>
inline void dot_keys(int nk, const float* const* q, const float* k, int64_t k_stride, int64_t D, const float* const* q2,
                     const float* k2, int64_t k2_stride, int64_t D2, float* out) {
    if (nk == 3) dot_block<NR, 3>(q, k, k_stride, D, q2, k2, k2_stride, D2, out);
    else if (nk == 2) dot_block<NR, 2>(q, k, k_stride, D, q2, k2, k2_stride, D2, out);
    else dot_block<NR, 1>(q, k, k_stride, D, q2, k2, k2_stride, D2, out);
}

// Scores of rows [0, rows) against keys [s0, s1), scaled, into p[r][s - s0]: blocks of 4 rows × 3 keys (12 chains:
// 1.5× the rate of 4 × 2 on a Zen 3; a row block's queries stay in L1 while it passes over the chunk's keys in L2);
// every (row, key) has a 1 × 1 block's bits. next[0..next_floats): the thread's next chunk, prefetched into L2 a slice
// per block of the later row blocks (or none).
inline void chunk_scores(const ChunkRows& a, const KeyRows& c, float scale, int64_t s0, int64_t s1, float* const* p,
                         const float* next, int64_t next_floats) {
    float dots[12];
    const int64_t lines = next_floats / 16, blocks = std::max<int64_t>(1, (a.rows / 4 - 1) * ((s1 - s0 + 2) / 3));
    int64_t line = 0;
    for (int64_t r = 0; r < a.rows;) {
        const int nr = a.rows - r >= 4 ? 4 : 1;
        const int64_t end = std::min(s1, a.keys[r + nr - 1]);  // keys past the block's last row's are never read
        for (int64_t s = std::max(s0, a.lo[r]); s < end; s += 3) {  // nor those before its first row's window
            const int nk = int(std::min<int64_t>(3, end - s));
            if (r == 0)  // the first row block pulls the chunk from memory: short keys PREFETCH_KEYS ahead, values as keys pass
                for (int64_t k = s; k < std::min(s + 3, s1); ++k) {
                    if (c.D + c.D2 <= PREFETCH_KEY_FLOATS && k + PREFETCH_KEYS < s1)
                        prefetch_row(c.K + (k + PREFETCH_KEYS) * c.k_stride, c.D);
                    if (c.V != c.K) prefetch_row(c.V + k * c.v_stride, c.Dv);
                }
            for (const int64_t stop = r ? std::min(lines, line + (lines + blocks - 1) / blocks) : 0; line < stop; ++line)
                __builtin_prefetch(next + 16 * line, 0, 2);
            const float *const *q = a.q + r, *const *q2 = c.K2 ? a.q2 + r : nullptr;
            const float *k = c.K + s * c.k_stride, *k2 = c.K2 ? c.K2 + s * c.k2_stride : nullptr;
            if (nr == 4) dot_keys<4>(nk, q, k, c.k_stride, c.D, q2, k2, c.k2_stride, c.D2, dots);
            else dot_keys<1>(nk, q, k, c.k_stride, c.D, q2, k2, c.k2_stride, c.D2, dots);
            for (int i = 0; i < nr; ++i)
                for (int j = 0; j < nk; ++j) p[r + i][s - s0 + j] = dots[i * nk + j] * scale;
        }
        r += nr;
    }
}

// acc[r] = Σ_{s0(r) <= s < s1(r)} p[r][s - s0]·V[s], s0(r) = max(s0, lo[r]), s1(r) = min(s1, keys[r]): rows with the
// same keys (a position's heads) in blocks of SUM_ROWS or 2 rows, their columns in blocks of 8 accumulators (4 rows × 16
// columns, 2 × 32, 1 × 32), then 8 columns at a time, the last Dv % 8 one by one; each output one running sum over the
// keys in order.
inline void chunk_sums(const ChunkRows& a, const KeyRows& c, int64_t s0, int64_t s1, float* const* rows_p) {
    const int64_t Dv = c.Dv, vs = c.v_stride;
    const float* p[4];  // the block's rows from their first key
    for (int64_t r = 0; r < a.rows;) {
        const int64_t skip = std::max<int64_t>(0, a.lo[r] - s0), n = std::min(s1, a.keys[r]) - s0 - skip;
        const float* v = c.V + (s0 + skip) * vs;
        int nr = 1;
        for (const int want : {SUM_ROWS, 2}) {
            bool block = r + want <= a.rows;
            for (int i = 1; block && i < want; ++i) block = a.keys[r + i] == a.keys[r] && a.acc[r + i] == a.acc[r] + i * Dv;
            if (block) { nr = want; break; }
        }
        for (int i = 0; i < nr; ++i) p[i] = rows_p[r + i] + skip;  // (same keys: the same window)
        int64_t c0 = 0;
        if (nr == 4)
            for (; c0 + 16 <= Dv; c0 += 16) weighted_block<4, 2>(p, v + c0, vs, n, a.acc[r] + c0, Dv);
        else if (nr == 2)
            for (; c0 + 32 <= Dv; c0 += 32) weighted_block<2, 4>(p, v + c0, vs, n, a.acc[r] + c0, Dv);
        else
            for (; c0 + 32 <= Dv; c0 += 32) weighted_block<1, 4>(p, v + c0, vs, n, a.acc[r] + c0, Dv);
        for (; c0 + 8 <= Dv; c0 += 8)
            for (int i = 0; i < nr; ++i) weighted_block<1, 1>(p + i, v + c0, vs, n, a.acc[r + i] + c0, Dv);
        for (int i = 0; i < nr; ++i)
            for (int64_t d = c0; d < Dv; ++d) {
                float sum = 0.f;
                for (int64_t k = 0; k < n; ++k) sum = std::fma(p[i][k], v[k * vs + d], sum);
                a.acc[r + i][d] = sum;
            }
        r += nr;
    }
}

// One chunk [s0, s1) of one KV head for rows that all attend to at least one of its keys (keys[0] > s0, lo[rows - 1] <
// s1): scores, exponentials against the row's maximum over the chunk, their sum, and the weighted sums of V.
// p [rows][KEY_CHUNK].
inline void attend_chunk(const ChunkRows& a, const KeyRows& c, float scale, int64_t s0, int64_t s1, float* const* p,
                         const float* next = nullptr, int64_t next_floats = 0) {
    chunk_scores(a, c, scale, s0, s1, p, next, next_floats);
    for (int64_t r = 0; r < a.rows; ++r) {
        const int64_t skip = std::max<int64_t>(0, a.lo[r] - s0);
        a.l[r] = exp_row(p[r] + skip, std::min(s1, a.keys[r]) - s0 - skip, a.m + r);
    }
    chunk_sums(a, c, s0, s1, p);
}

// Folds chunk partials (m, l, acc), in chunk order, into a row's running (top, total, out): out and total are scaled to
// the larger maximum, each by one exponential. first: out, top and total start from this chunk; last: out /= total.
inline void fold_chunk(float m, float l, const float* acc, int64_t Dv, bool first, bool last, float* top, float* total,
                       float* out) {
    int64_t d = 0;
    if (first) {
        *top = m, *total = l;
        if (out != acc) std::memcpy(out, acc, Dv * sizeof(float));
    } else {
        const float next = std::max(*top, m), a = std::exp(*top - next), b = std::exp(m - next);
        *top = next, *total = *total * a + l * b;
        const vec8 av = splat8(a), bv = splat8(b);
        for (; d + 8 <= Dv; d += 8) {
            const vec8 y = load8(out + d) * av + load8(acc + d) * bv;
            __builtin_memcpy(out + d, &y, sizeof y);
        }
        for (; d < Dv; ++d) out[d] = out[d] * a + acc[d] * b;
    }
    if (!last) return;
    const vec8 inv = splat8(1.f / *total);
    for (d = 0; d + 8 <= Dv; d += 8) {
        const vec8 y = load8(out + d) * inv;
        __builtin_memcpy(out + d, &y, sizeof y);
    }
    for (; d < Dv; ++d) out[d] *= inv[0];
}

// The first key position t of a pass attends to: with a sliding window, keys (p - window, p] at p = past + t
// (transformers' sliding_window_overlay); else 0
inline int64_t first_key(const HeadRows& a, int64_t t) {
    return a.window > 0 ? std::max<int64_t>(0, a.past + t + 1 - a.window) : 0;
}

// One task's rows: KV head g's query heads [h0, h1) at positions t0..t1-1, position-major (a position's heads side by side),
// with their queries, keys and outputs; acc and the fold's state as the schedule wants them.
struct TaskRows {
    std::vector<const float*> q, q2;
    std::vector<float*> out, acc, p;
    std::vector<int64_t> keys, lo, index;  // index: the row's number t·Hq + h
    std::vector<float> m, l, top, total, scores;
    int64_t rows = 0;

    TaskRows& size(int64_t most, int64_t Dv_partial) {  // room for `most` rows (a thread's buffers grow, never shrink)
        for (auto* v : {&q, &q2}) v->resize(std::max<size_t>(v->size(), most));
        for (auto* v : {&out, &acc, &p}) v->resize(std::max<size_t>(v->size(), most));
        for (auto* v : {&keys, &lo, &index}) v->resize(std::max<size_t>(v->size(), most));
        for (auto* v : {&m, &l, &top, &total}) v->resize(std::max<size_t>(v->size(), most));
        scores.resize(std::max<size_t>(scores.size(), most * (KEY_CHUNK + Dv_partial)));
        return *this;
    }

    void fill(const HeadRows& a, int64_t g, int64_t h0, int64_t h1, int64_t t0, int64_t t1) {
        rows = 0;
        for (int64_t t = t0; t < t1; ++t)
            for (int64_t h = g * (a.Hq / a.Hkv) + h0; h < g * (a.Hq / a.Hkv) + h1; ++h, ++rows) {
                q[rows] = a.q + t * a.q_t + h * a.q_h, q2[rows] = a.q2 ? a.q2 + t * a.q2_t + h * a.q2_h : nullptr;
                out[rows] = a.out + t * a.out_t + h * a.out_h, keys[rows] = a.past + t + 1, index[rows] = t * a.Hq + h;
                lo[rows] = first_key(a, t);
                p[rows] = scores.data() + rows * KEY_CHUNK;
            }
    }
    ChunkRows from(int64_t r0, int64_t r1) {  // rows r0..r1-1 (those that reach a chunk: a run, rows being position-major)
        return ChunkRows{q.data() + r0, q2.data() + r0, keys.data() + r0, lo.data() + r0, acc.data() + r0, m.data() + r0,
                         l.data() + r0, r1 - r0};
    }
};

// Rows (t, h), t < T, h < Hq, attend over keys first_key(t)..past+t of KV head g = h / (Hq / Hkv) (its cache: `cache(g)`),
// in one of two schedules with the same bits: where many rows share a key (a verification: 40 query rows per KV head at 5
// positions of Qwen3, 80 of MLA's) the work is arithmetic, so a task takes some of a KV head's query heads over every
// chunk in order, folding each into the outputs as it goes; where few do (a decode step), memory and latency count, so a
// task takes one chunk of one KV head for all its rows, and the chunks' partial sums, held in waves of about g_wave_bytes,
// are folded afterwards. With one chunk in all, the partials are the outputs. A sliding window's rows skip the chunks
// before it: each row's chunks are fixed by its position alone, so its bits still depend neither on T nor on the threads.
template <typename Cache>
inline void attend_heads(const HeadRows& a, Cache cache, int threads) {
    const int64_t group = a.Hq / a.Hkv, S = a.past + a.T, chunks = (S + KEY_CHUNK - 1) / KEY_CHUNK, nrows = a.T * a.Hq;
    const int64_t c_first = first_key(a, 0) / KEY_CHUNK, span = chunks - c_first;  // the chunks any row reaches
    const KeyRows c0 = cache(0);
    const int64_t Dv = c0.Dv, n = threads_for(threads, 4.0 * a.Hkv * (S - c_first * KEY_CHUNK) * (c0.D + c0.D2 + c0.Dv));
    if (group * a.T >= 32 || span == 1) {  // a task: heads [i0, i1) of KV head g, every chunk
        const int64_t parts = std::min(group, (n + a.Hkv - 1) / a.Hkv), tasks = a.Hkv * parts;
        std::atomic<int64_t> next{0};
        g_pool->run(int(std::min(n, tasks)), [&](int) {
            thread_local TaskRows rows_of_thread;
            TaskRows& tr = rows_of_thread.size((group / parts + 1) * a.T, span == 1 ? 0 : Dv);
            for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
                const int64_t g = task / parts, part = task % parts;
                tr.fill(a, g, group * part / parts, group * (part + 1) / parts, 0, a.T);
                for (int64_t r = 0; r < tr.rows; ++r)  // one chunk: straight into the outputs
                    tr.acc[r] = span == 1 ? tr.out[r] : tr.scores.data() + tr.rows * KEY_CHUNK + r * Dv;
                for (int64_t ci = c_first, r0 = 0, r1 = 0; ci < chunks; ++ci) {
                    const int64_t s0 = ci * KEY_CHUNK, s1 = std::min(S, s0 + KEY_CHUNK);
                    while (tr.keys[r0] <= s0) ++r0;  // rows whose keys end before the chunk
                    while (r1 < tr.rows && tr.lo[r1] < s1) ++r1;  // rows whose window starts before its end
                    attend_chunk(tr.from(r0, r1), cache(g), a.scale, s0, s1, tr.p.data() + r0);
                    for (int64_t r = r0; r < r1; ++r)
                        fold_chunk(tr.m[r], tr.l[r], tr.acc[r], Dv, ci == tr.lo[r] / KEY_CHUNK,
                                   (tr.keys[r] + KEY_CHUNK - 1) / KEY_CHUNK == ci + 1, &tr.top[r], &tr.total[r], tr.out[r]);
                }
            }
        });
        return;
    }
    // a task: chunk ci of KV head g for all its rows; partials m, l [chunk][row], acc [chunk][row][Dv] per wave
    const double wave_bytes = g_wave_bytes.load(std::memory_order_relaxed);
    const int64_t most_wave = std::clamp<int64_t>(int64_t(wave_bytes / (4.0 * nrows * (Dv + 2))), 1, span);
    thread_local std::vector<float> partial;  // the calling thread's, kept between calls
    partial.resize(most_wave * nrows * (Dv + 2));
    float *pm = partial.data(), *pl = pm + most_wave * nrows, *pacc = pl + most_wave * nrows;
    std::vector<float> top(nrows), total(nrows);
    for (int64_t w0 = c_first; w0 < chunks; w0 += most_wave) {
        const int64_t wc = std::min(most_wave, chunks - w0), tasks = wc * a.Hkv, nt = std::min(n, tasks);
        g_pool->run(int(nt), [&](int tid) {  // thread tid takes tasks tid, tid + nt, ...: it knows its next chunk
            thread_local TaskRows rows_of_thread;
            TaskRows& tr = rows_of_thread.size(group * a.T, 0);
            for (int64_t task = tid; task < tasks; task += nt) {
                const int64_t ci = task / a.Hkv, g = task % a.Hkv, s0 = (w0 + ci) * KEY_CHUNK, s1 = std::min(S, s0 + KEY_CHUNK);
                // the positions that reach the chunk: their keys end after s0, their window (if any) starts before s1
                const int64_t t1 = a.window > 0 ? std::min(a.T, s1 + a.window - a.past - 1) : a.T;
                tr.fill(a, g, 0, group, std::max<int64_t>(0, s0 - a.past), t1);
                for (int64_t r = 0; r < tr.rows; ++r) tr.acc[r] = pacc + (ci * nrows + tr.index[r]) * Dv;
                // MLA's latents (values = keys) only the hardware prefetcher fetches: prefetch the next chunk's rows
                const int64_t nx = task + nt, ns0 = (w0 + nx / a.Hkv) * KEY_CHUNK;
                const KeyRows nc = cache(nx % a.Hkv);
                const bool ahead = nx < tasks && nc.V == nc.K;
                const int64_t next_floats = ahead ? (std::min(S, ns0 + KEY_CHUNK) - ns0) * nc.k_stride : 0;
                attend_chunk(tr.from(0, tr.rows), cache(g), a.scale, s0, s1, tr.p.data(),
                             ahead ? nc.K + ns0 * nc.k_stride : nullptr, next_floats);
                for (int64_t r = 0; r < tr.rows; ++r)
                    pm[ci * nrows + tr.index[r]] = tr.m[r], pl[ci * nrows + tr.index[r]] = tr.l[r];
            }
        });
        const int64_t nf = threads_for(int(n), 4.0 * wc * nrows * Dv);
        g_pool->run(int(nf), [&](int tid) {  // fold the wave's chunks into each row, in chunk order
            for (int64_t row = nrows * tid / nf; row < nrows * (tid + 1) / nf; ++row) {
                const int64_t t = row / a.Hq, h = row % a.Hq, reach = (a.past + t + KEY_CHUNK) / KEY_CHUNK;
                const int64_t first = first_key(a, t) / KEY_CHUNK;
                for (int64_t ci = std::max(w0, first); ci < std::min(w0 + wc, reach); ++ci)
                    fold_chunk(pm[(ci - w0) * nrows + row], pl[(ci - w0) * nrows + row], pacc + ((ci - w0) * nrows + row) * Dv,
                               Dv, ci == first, ci + 1 == reach, &top[row], &total[row], a.out + t * a.out_t + h * a.out_h);
            }
        });
    }
}

// linear() where one weight row at a time reads faster (moe_rows::one_row_tokens, AMD's CPUs): the experts' AVX-512 tiles
// (x86_tiles.h) over blocks of 32 rows, one row a tile at 1-2 tokens, four from 3: each (row, token) sums its row's two
// halves in one order (tile_avx512), so its bits depend neither on T nor on which tile took it; bf16 rows widened
// exactly as fp32's. Blocks go out in runs (pool.h's Items): each thread streams its own stretch of rows.
template <typename W>
inline void linear_tiles(const float* x, const W* w, const float* b, int64_t T, int64_t R, int64_t K, float* y,
                         int64_t y_stride, int threads) {
    constexpr int64_t BLOCK = 32;
    const int64_t n = threads_for(threads, double(sizeof(W)) * T * R * K), blocks = (R + BLOCK - 1) / BLOCK;
    Items items(blocks, int(n));
    g_pool->run(int(n), [&](int) {
        Items::Cursor cursor;
        for (int64_t blk; (blk = items.next(cursor)) >= 0;) {
            const int64_t r0 = blk * BLOCK, nr = std::min(BLOCK, R - r0);
            mat_avx512<W>({w + r0 * K, K, nr, K, x, K, int(T), y + r0, y_stride});
            for (int64_t t = 0; b && t < T; ++t)
                for (int64_t r = r0; r < r0 + nr; ++r) y[t * y_stride + r] += b[r];
        }
    });
}

// y[t, r] = x[t] · W[r] (+ b[r]) for x [T, K], W [R, K], y rows y_stride apart: each output by dot() alone, so its
// bits do not depend on T; each weight row is read once for all T tokens. Threads take runs of row quads from a
// counter (a quarter of an even share each), so a core the VM slows for a while does not hold the others at the end.
// The AVX-512 build on AMD's CPUs takes linear_tiles instead (its own bits, alike at every T).
template <typename W>
inline void linear(const float* x, const W* w, const float* b, int64_t T, int64_t R, int64_t K, float* y,
                   int64_t y_stride, int threads) {
#ifdef MOE_BODY_AVX512
    if (moe_rows::one_row_tokens() > 0) return linear_tiles(x, w, b, T, R, K, y, y_stride, threads);
#endif
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
                        acc += splat8(xk) * load8(wk + 8 * v);
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
    // 2. each KV head's query heads attend to keys 0..past+t (a sliding window's last `window`) together (K and V read
    // once for them)
    const HeadRows rows{a.q, nullptr, a.out, a.q_stride, D, 0, 0, a.out_stride, D, a.T, a.Hq, a.Hkv, a.past, a.scale,
                        a.window};
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
            for (int64_t e = 0; e < E; ++e)  // a NaN (a NaN or infinite logit) is a candidate: k real experts, NaN weights
                if (!(p[e] < 0.f) && (best < 0 || p[e] > p[best])) best = e;
            experts[t * k + j] = best;
            weights[t * k + j] = p[best] / total;
            kept += weights[t * k + j];
            p[best] = -1.f;  // taken
        }
        if (normalize)
            for (int64_t j = 0; j < k; ++j) weights[t * k + j] /= kept;
    }
}
