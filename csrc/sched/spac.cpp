// MoE-SpAc's per-layer scheduling in one object: the utility estimator, the workload balancer, the
// tie-break rate, the prefetch queues and the ranking of the residents (the Python twin, decision
// for decision: engine/sched/utility.py, balancer.py, prefetch.py, spac.py). A layer's step is one
// call: observe f, update utilities, choose τ, re-rank, queue, and plan the transfers. The table's
// bookkeeping and the copies stay in Python: a plan is a list of actions (evict a victim, load an
// expert at a level) that the caller applies in order, exactly as the Python drain would have made
// them. Floating point: the same double operations in the same order as the twin (built with
// -ffp-contract=off: no fused multiply-adds), ŝ's float32 arithmetic as torch does it.
// Plain C ABI for ctypes (loaded with PyDLL: calls hold the GIL, no thread switch per call).

#include <cmath>

#include "prefetch.h"

#define API extern "C" __attribute__((visibility("default")))

namespace {

using namespace moechat_sched;

enum Phase { PREFILL = 0, VERIFY = 1 };

// ŝ for one expert: as torch computes counts (long) + unseen (a Python float) * s (long) — in
// float32, the scalar rounded to float32 first — then rounds half to even; clamped to K
inline int64_t expected_one(double unseen, int64_t c, int64_t v, int K) {
    float x = float(c) + float(unseen) * float(v);
    return std::min<int64_t>(int64_t(std::nearbyint(x)), K);
}

struct Params {  // as the Python wrapper packs them (engine/sched/native_spac.py: PARAMS)
    double lam, level_up, level_down, variant_level, draft_len, cpu_s, device_s, io_s, draft_s,
        cpu_activations, alpha, demote_zero, lookahead, top_k, rate_smoothing;
};

struct Core : Prefetch {
    Params p;
    // estimator [L*E]
    std::vector<int64_t> s, prev, up, down;
    // balancer [L*(K+1)], [L]
    std::vector<double> cpu, dev;
    std::vector<int64_t> seen;
    std::vector<int> btau;
    // tie-break rate and rate / (rate + 1) [L*E]
    std::vector<double> rate, fine;
    // the draft phase: its summed counts, what it loaded and how much of that the verification used
    std::vector<int64_t> dcounts;
    std::vector<uint8_t> draft_loaded, drafted;
    int64_t lookahead_loads = 0, lookahead_hits = 0;
    // a step stopped before its update (copies may be cancelled first): its layer, s and τ
    int held_li = -1, held_tau = 0;
    std::vector<int64_t> held_s;
    // scratch, allocated once: per level (K+2) and per expert (E)
    std::vector<int64_t> lv_a, lv_b, lv_c, lv_d, ex_a, ex_b;
    std::vector<double> lv_x, lv_y, lv_z;
    std::vector<uint8_t> lv_ok;

    Core(int L_, int E_, int K_, const Params& p_)
        : Prefetch(L_, E_, K_), p(p_), s(L_ * E_), prev(L_ * E_), up(L_ * E_), down(L_ * E_), cpu(L_ * (K_ + 1)),
          dev(L_ * (K_ + 1)), seen(L_), btau(L_, K_), rate(L_ * E_), fine(L_ * E_), dcounts(L_ * E_),
          draft_loaded(L_ * E_), drafted(L_), held_s(E_), lv_a(K_ + 2), lv_b(K_ + 2), lv_c(K_ + 2), lv_d(K_ + 2),
          ex_a(E_), ex_b(E_), lv_x(K_ + 1), lv_y(K_ + 1), lv_z(K_ + 1), lv_ok(K_ + 1) {
        bool level = p.variant_level != 0;
        int64_t start = std::max<int64_t>(1, int64_t(p.draft_len) / 2);
        std::fill(up.begin(), up.end(), level ? int64_t(p.level_up) : start);
        std::fill(down.begin(), down.end(), level ? int64_t(p.level_down) : start);
    }

    // --- estimator (utility.py) ----------------------------------------------------------------
    void estimate(int li, const int64_t* f) {
        int64_t* sv = &s[li * E];
        int64_t *pv = &prev[li * E], *uv = &up[li * E], *dv = &down[li * E];
        if (p.variant_level != 0) {
            int64_t u = int64_t(p.level_up), d = int64_t(p.level_down);
            for (int e = 0; e < E; ++e) {
                int64_t c = f[e], v = sv[e];
                sv[e] = c - v >= u ? (v < K ? v + 1 : K) : (v - c >= d ? (v > 0 ? v - 1 : 0) : v);
            }
        } else {
            double lam = p.lam, keep = 1 - p.lam;
            for (int e = 0; e < E; ++e) {
                int64_t d = f[e] - pv[e];
                if (d == 0) continue;
                int64_t v = sv[e];
                if (d >= uv[e]) sv[e] = std::min<int64_t>(v + 1, K);
                else if (-d >= dv[e]) sv[e] = std::max<int64_t>(v - 1, 0);
                if (d > 0) uv[e] = std::max<int64_t>(1, int64_t(std::floor(keep * double(uv[e]) + lam * double(d) + 1e-9)));
                else dv[e] = std::max<int64_t>(1, int64_t(std::floor(keep * double(dv[e]) + lam * double(-d) + 1e-9)));
            }
        }
        std::memcpy(pv, f, sizeof(int64_t) * E);
    }

    // --- balancer (balancer.py) ----------------------------------------------------------------
    int bin(int64_t v) const { return v >= 0 ? int(std::min<int64_t>(v, K)) + 1 : 0; }  // index: min(v, K) + 1, 0 below 0
    void observe(int li, const int64_t* s_before, const int64_t* f) {
        std::vector<int64_t>&used = lv_a, &acts = lv_b;
        std::fill(used.begin(), used.end(), 0);
        std::fill(acts.begin(), acts.end(), 0);
        int64_t n_used = 0, n_acts = 0;
        for (int e = 0; e < E; ++e)
            if (f[e] > 0) {
                int b = bin(s_before[e]);
                ++used[b], acts[b] += f[e], ++n_used, n_acts += f[e];
            }
        double a = seen[li] == 0 ? 1.0 : p.alpha;
        double *cu = &cpu[li * (K + 1)], *du = &dev[li * (K + 1)];
        int64_t dv = 0, dacts = 0;
        for (int t = K; t >= 0; --t) {
            dv += used[t + 1], dacts += acts[t + 1];
            int64_t c = p.cpu_activations != 0 ? n_acts - dacts : n_used - dv;
            cu[t] += a * (double(c) - cu[t]);
            du[t] += a * (double(dv) - du[t]);
        }
        ++seen[li];
    }
    int choose(int li, const int64_t* sv, int free_count) {
        std::vector<int64_t>&cold = lv_a, &held = lv_b, &n = lv_c, &reclaimable = lv_d;  // n, reclaimable: 0..K
        std::fill(cold.begin(), cold.end(), 0);
        std::fill(held.begin(), held.end(), 0);
        for (int e = 0; e < E; ++e) {
            int b = bin(sv[e]);
            if (!res[li * E + e]) ++cold[b];
            else ++held[b];
        }
        int64_t acc = 0;
        for (int t = K; t >= 0; --t) acc += cold[t + 1], n[t] = acc;
        acc = held[0];
        for (int t = 0; t <= K; ++t) reclaimable[t] = acc, acc += held[t + 1];
        const double* cu = &cpu[li * (K + 1)];
        const double* du = &dev[li * (K + 1)];
        std::vector<double>&t_cpu = lv_x, &t_gpu = lv_y, &diff = lv_z;
        for (int t = 0; t <= K; ++t) t_cpu[t] = cu[t] * p.cpu_s, t_gpu[t] = du[t] * p.device_s;
        int now = btau[li];
        double a = t_cpu[now], b = t_gpu[now];
        double window = (b > a ? b : a) + p.draft_len * p.draft_s / double(L);
        std::vector<uint8_t>& ok = lv_ok;
        ok[0] = 0;
        int lo = -1, hi = -1;
        for (int t = 1; t <= K; ++t) {
            ok[t] = double(n[t]) * p.io_s <= window + 1e-12 && n[t] <= free_count + reclaimable[t];
            if (ok[t]) hi = t, lo = lo < 0 ? t : lo;
        }
        if (lo < 0) return btau[li] = K;
        for (int t = 0; t <= K; ++t) diff[t] = t_cpu[t] - t_gpu[t];
        int cands[4] = {lo, hi, -1, -1};
        double cross;
        if (crossing(diff, cross)) cands[2] = int(std::floor(cross)), cands[3] = int(std::ceil(cross));
        int tau = -1;
        for (int t : cands) {
            if (t < lo || t > hi || !ok[t]) continue;
            if (tau < 0 || std::fabs(diff[t]) < std::fabs(diff[tau]) || (std::fabs(diff[t]) == std::fabs(diff[tau]) && t < tau)) tau = t;
        }
        return btau[li] = tau;
    }
    bool crossing(const std::vector<double>& diff, double& at) const {
        for (int t = 1; t < K; ++t) {
            double a = diff[t], b = diff[t + 1];
            if (a == 0) return at = t, true;
            if ((a < 0 && 0 < b) || (a > 0 && 0 > b)) return at = t + a / (a - b), true;
        }
        if (diff[K] == 0) return at = K, true;
        return false;
    }

    // --- the policy (spac.py) ------------------------------------------------------------------
    int64_t reclaim(int li) const {
        int64_t total = 0;
        for (int l = 0; l < L; ++l) total += below[l];
        return total - below[li];
    }
    // choose τ for s [E]; then update and plan, unless copies may need cancelling first (NEED_CANCEL)
    int schedule(int li, const int64_t* sv, bool cancellable, int budget) {
        int tau = choose(li, sv, free_slots + int(reclaim(li)));
        if (cancellable) {
            held_li = li, held_tau = tau;
            std::memcpy(held_s.data(), sv, sizeof(int64_t) * E);
            return NEED_CANCEL;
        }
        int rc = update(li, sv, tau, &fine[li * E]);
        return rc < 0 ? rc : plan(budget);
    }
    int resume(int budget) {  // after the caller cancelled what it could (see forget)
        int li = held_li;
        held_li = -1;
        int rc = update(li, held_s.data(), held_tau, &fine[li * E]);
        return rc < 0 ? rc : plan(budget);
    }
    void begin_log() {
        logging = true;
        touched.clear();
    }
    void end_log() {  // the draft scheduling's new residents: loaded first, still resident
        logging = false;
        for (int k : touched) {
            if (first[k] == 1 && res[k]) draft_loaded[k] = 1, ++lookahead_loads;
            first[k] = 0;
        }
        touched.clear();
    }
    void expected(int li, int64_t* out) {  // ŝ = min(K, round(counts + unseen · s))
        const int64_t* dc = &dcounts[li * E];
        int64_t sum = 0;
        for (int e = 0; e < E; ++e) sum += dc[e];
        int window = int(p.draft_len) + 1;
        int64_t drafted = sum / int64_t(p.top_k);
        double unseen = double(std::max<int64_t>(window - drafted, 0)) / double(window);
        for (int e = 0; e < E; ++e) out[e] = expected_one(unseen, dc[e], s[li * E + e], K);
    }
    int draft(int li, const int64_t* f, bool cancellable, int budget) {
        for (int e = 0; e < E; ++e) dcounts[li * E + e] += f[e];
        drafted[li] = 1;
        int64_t* s_hat = ex_a.data();
        expected(li, s_hat);
        begin_log();
        int rc = schedule(li, s_hat, cancellable, budget);
        if (rc != NEED_CANCEL) end_log();
        return rc;
    }
    int step(int li, const int64_t* counts, int phase, bool cancellable, int budget) {
        if (phase == VERIFY) {
            for (int e = 0; e < E; ++e) {
                int k = li * E + e;
                if (draft_loaded[k]) lookahead_hits += counts[e] > 0 && res[k], draft_loaded[k] = 0;
            }
        }
        int64_t tokens = 0;
        for (int e = 0; e < E; ++e) tokens += counts[e];
        tokens /= int64_t(p.top_k);
        int64_t* f = ex_a.data();
        std::copy(counts, counts + E, f);
        int window = int(p.draft_len) + 1;
        if (phase == PREFILL && tokens > window)  // a long prompt: its frequencies on the γ+1 scale
            for (int e = 0; e < E; ++e) f[e] = (f[e] * window + tokens / 2) / tokens;
        observe(li, &levels[li * E], f);
        for (int e = 0; e < E; ++e) {
            int k = li * E + e;
            rate[k] = rate[k] + p.rate_smoothing * (double(f[e]) - rate[k]);
            fine[k] = rate[k] / (rate[k] + 1);
        }
        estimate(li, f);
        int64_t* sv = ex_b.data();
        std::copy(&s[li * E], &s[li * E] + E, sv);
        return schedule(li, sv, cancellable, budget);
    }
};

Params unpack(const double* v) {
    Params p;
    std::memcpy(&p, v, sizeof(Params));
    return p;
}

}  // namespace

// --- C ABI: the handle, the table, and per call the table's version and free slots -----------------
API void* spac_create(int L, int E, int K, const double* params) { return new Core(L, E, K, unpack(params)); }
API void spac_destroy(void* h) { delete static_cast<Core*>(h); }
API void spac_bind(void* h, const int64_t* slot_of) { static_cast<Core*>(h)->slot_of = slot_of, static_cast<Core*>(h)->expect = -1; }
API int32_t* spac_actions(void* h) { return static_cast<Core*>(h)->actions.data(); }

// One layer's verification (phase 1) or prefill (0) counts [E]; budget < 0 drains the queues, 0 leaves
// them to the transfer thread. Returns the number of actions, NEED_CANCEL, or BAD_LEVEL.
API int spac_step(void* h, int li, const int64_t* counts, int phase, int64_t version, int free_count,
                  uint8_t* frozen, int cancellable, int budget) {
    Core& c = *static_cast<Core*>(h);
    c.sync(version, free_count);
    c.frozen = frozen;
    int rc = c.step(li, counts, phase, cancellable != 0, budget);
    return rc >= 0 ? c.handed_out(version) : rc;
}

// One layer's draft-phase demand [E] (summed over the phase's draft tokens so far).
API int spac_draft(void* h, int li, const int64_t* counts, int64_t version, int free_count, uint8_t* frozen,
                   int cancellable, int budget) {
    Core& c = *static_cast<Core*>(h);
    c.sync(version, free_count);
    c.frozen = frozen;
    int rc = c.draft(li, counts, cancellable != 0, budget);
    return rc >= 0 ? c.handed_out(version) : rc;
}

// After NEED_CANCEL: the experts whose queued copies the table cancelled (their slots freed), then the update and plan.
API int spac_resume(void* h, const int32_t* cancelled, int n, int64_t version, int free_count, uint8_t* frozen, int budget) {
    Core& c = *static_cast<Core*>(h);
    int li = c.held_li;
    for (int i = 0; i < n; ++i) {
        int k = li * c.E + cancelled[i];
        if (c.demoted[k]) c.demoted[k] = 0, --c.n_demoted;
        c.log(k, 2);
    }
    c.sync(version, free_count);
    c.frozen = frozen;
    int rc = c.resume(budget);
    if (c.logging) c.end_log();
    return rc >= 0 ? c.handed_out(version) : rc;
}
API int64_t spac_expected(double unseen, int64_t c, int64_t v, int K) { return expected_one(unseen, c, v, K); }
API int spac_held_tau(void* h) { return static_cast<Core*>(h)->held_tau; }
API const int64_t* spac_held_s(void* h) { return static_cast<Core*>(h)->held_s.data(); }

// The prefetcher alone (Prefetcher.update_row): s [E], τ, tie-breaks [E] (NULL: zeros); no plan.
API int spac_update(void* h, int li, const int64_t* s, int tau, const double* fine, int64_t version, int free_count,
                    uint8_t* frozen) {
    Core& c = *static_cast<Core*>(h);
    c.sync(version, free_count);
    c.frozen = frozen;
    return c.update(li, s, tau, fine);
}
API int spac_plan(void* h, int64_t version, int free_count, uint8_t* frozen, int budget) {
    Core& c = *static_cast<Core*>(h);
    c.sync(version, free_count);
    c.frozen = frozen;
    c.plan(budget);
    return c.handed_out(version);
}
API void spac_demote(void* h, int li, const int64_t* counts) { static_cast<Core*>(h)->demote(li, counts); }
API void spac_forget(void* h, int li, int e) {  // a cancelled copy (Prefetcher.update_row's cancel path)
    Core& c = *static_cast<Core*>(h);
    int k = li * c.E + e;
    if (c.demoted[k]) c.demoted[k] = 0, --c.n_demoted;
}
API void spac_forward_end(void* h) {  // a verification or prefill ended: the draft counts start over
    Core& c = *static_cast<Core*>(h);
    for (int li = 0; li < c.L; ++li)
        if (c.drafted[li]) std::fill(&c.dcounts[li * c.E], &c.dcounts[li * c.E] + c.E, 0), c.drafted[li] = 0;
}

// State for readers outside the hot path: `what` names an array, copied into out.
API int spac_read(void* h, int what, void* out) {
    Core& c = *static_cast<Core*>(h);
    auto put = [&](const auto& v) { std::memcpy(out, v.data(), v.size() * sizeof(v[0])); return int(v.size()); };
    switch (what) {
        case 0: return put(c.levels);
        case 1: return put(c.pfine);
        case 2: return put(c.taus);
        case 3: return put(c.queued);
        case 4: return put(c.demoted);
        case 5: return put(c.s);
        case 6: return put(c.prev);
        case 7: return put(c.up);
        case 8: return put(c.down);
        case 9: return put(c.cpu);
        case 10: return put(c.dev);
        case 11: return put(c.btau);
        case 12: return put(c.seen);
        case 13: {
            int64_t* o = static_cast<int64_t*>(out);
            o[0] = c.lookahead_loads, o[1] = c.lookahead_hits;
            return 2;
        }
        case 15: {  // how many ints case 14 writes
            int n = 0;
            for (const auto& q : c.queues) n += 1 + int(q.size());
            return n;
        }
        case 14: {  // the queues: per level its length, then its keys
            int32_t* o = static_cast<int32_t*>(out);
            int n = 0;
            for (const auto& q : c.queues) {
                o[n++] = int32_t(q.size());
                for (int k : q) o[n++] = k;
            }
            return n;
        }
        default: return -1;
    }
}
