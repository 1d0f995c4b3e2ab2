// MoE-SpAc's prefetch queues and the ranking of the residents (twin: engine/sched/prefetch.py,
// decision for decision), the part of csrc/sched/spac.cpp that plans transfers. The table itself
// (slots, copies) stays in Python: a plan is a list of actions (evict a victim, load an expert at a
// level) that the caller applies in order, as the twin's drain would have made them; this side keeps
// a mirror of which experts are resident, resynchronised from the table's slot_of whenever the
// table's version is not the one its last plan left.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <vector>

namespace moechat_sched {

struct Cand {  // (rank, layer, expert) of a resident; rank = (tier, score); the lowest goes first
    int tier;
    double score;
    int li, e;
    bool operator<(const Cand& o) const {
        if (tier != o.tier) return tier < o.tier;
        if (score != o.score) return score < o.score;
        if (li != o.li) return li < o.li;
        return e < o.e;
    }
};
constexpr Cand NONE{3, 0.0, -1, -1};  // a layer with no candidate: above every real one

enum { NEED_CANCEL = -2, BAD_LEVEL = -3 };

struct Prefetch {
    int L, E, K;
    // latest utilities, tie-breaks and τ per layer (the ranking), queues, demoted experts
    std::vector<int64_t> levels;
    std::vector<double> pfine;
    std::vector<int> taus, queued;
    std::vector<std::deque<int>> queues;  // key = layer * E + expert
    std::vector<uint8_t> demoted;
    int n_demoted = 0;
    std::vector<Cand> low;  // per layer: its lowest-ranked resident
    std::vector<int> below;  // per layer: residents with s < τ
    std::vector<uint8_t> stale;  // per layer: low needs recomputing
    // the table as last seen (slot_of >= 0), kept in step with the plans handed out
    const int64_t* slot_of = nullptr;
    std::vector<uint8_t> res;
    int64_t expect = -1;  // table version the mirror matches
    int free_slots = 0;
    uint8_t* frozen = nullptr;  // [L*E] experts in use (only frozen layers' bits), this call only
    // the plan being built: (layer, expert, level, victim layer, victim expert) per load
    std::vector<int32_t> actions;
    int n_actions = 0;
    bool logging = false;  // within a draft scheduling: first change per expert (1 load, 2 evict)
    std::vector<uint8_t> first;
    std::vector<int> touched;

    Prefetch(int L_, int E_, int K_)
        : L(L_), E(E_), K(K_), levels(L_ * E_), pfine(L_ * E_), taus(L_, K_), queued(L_ * E_, -1), queues(K_ + 1),
          demoted(L_ * E_), low(L_, NONE), below(L_), stale(L_), res(L_ * E_), actions(5 * (L_ * E_ + 1)),
          first(L_ * E_) {}

    // --- the table -----------------------------------------------------------------------------
    void sync(int64_t version, int free_count) {
        free_slots = free_count;
        if (version == expect) return;
        for (int k = 0; k < L * E; ++k) res[k] = slot_of[k] >= 0;
        for (int li = 0; li < L; ++li) refresh(li, false);
        std::fill(stale.begin(), stale.end(), 0);
        expect = version;
    }
    bool is_frozen(int li, int e) const { return frozen && e >= 0 && frozen[li * E + e]; }
    void log(int key, uint8_t what) {
        if (!logging || first[key]) return;
        first[key] = what;
        touched.push_back(key);
    }

    // --- ranking (prefetch.py) -----------------------------------------------------------------
    Cand rank(int li, int e) const {
        int k = li * E + e;
        if (demoted[k]) return Cand{0, 0.0, li, e};
        int64_t lv = levels[k];
        return Cand{lv >= taus[li] ? 1 : 0, double(lv) + pfine[k], li, e};
    }
    Cand refresh(int li, bool skip_frozen) {
        Cand best = NONE;
        int n_below = 0;
        for (int e = 0; e < E; ++e) {
            int k = li * E + e;
            if (!res[k] || (skip_frozen && is_frozen(li, e))) continue;
            n_below += levels[k] < taus[li];
            Cand c = rank(li, e);
            if (c < best) best = c;
        }
        if (!skip_frozen) low[li] = best, below[li] = n_below;
        return best;
    }
    int update(int li, const int64_t* sv, int tau, const double* fv) {
        for (int e = 0; e < E; ++e)  // a level with no queue (the twin: IndexError)
            if ((sv[e] > K || sv[e] < 0) && sv[e] >= tau && !res[li * E + e]) return BAD_LEVEL;
        std::memcpy(&levels[li * E], sv, sizeof(int64_t) * E);
        if (fv) std::memcpy(&pfine[li * E], fv, sizeof(double) * E);
        else std::fill(&pfine[li * E], &pfine[li * E] + E, 0.0);
        taus[li] = tau;
        bool any_demoted = n_demoted > 0;
        Cand best = NONE;
        int n_below = 0;
        for (int e = 0; e < E; ++e) {
            int k = li * E + e;
            int64_t lv = levels[k];
            if (res[k]) {
                Cand c;
                if (lv < tau) {
                    ++n_below;
                    if (any_demoted && demoted[k] && !is_frozen(li, e)) demoted[k] = 0, --n_demoted;
                    c = Cand{0, double(lv) + pfine[k], li, e};
                } else if (any_demoted && demoted[k]) {
                    c = Cand{0, 0.0, li, e};
                } else {
                    c = Cand{1, double(lv) + pfine[k], li, e};
                }
                if (c < best) best = c;
            } else if (lv >= tau && queued[k] != lv) {
                queued[k] = int(lv);  // an older entry at another level is skipped when it comes up
                queues[lv].push_back(k);
            }
        }
        low[li] = best, below[li] = n_below, stale[li] = 0;
        return 0;
    }

    // --- transfers -----------------------------------------------------------------------------
    bool next(int& li, int& e, int& level) {
        for (level = K; level > 0; --level) {
            std::deque<int>& q = queues[level];
            while (!q.empty()) {
                int k = q.front();
                q.pop_front();
                if (queued[k] != level) continue;  // re-queued at another level, or already served
                queued[k] = -1;
                li = k / E, e = k % E;
                if (level < taus[li] || levels[k] != level || res[k]) continue;
                return true;
            }
        }
        return false;
    }
    Cand victim() {
        for (int li = 0; li < L; ++li)
            if (stale[li]) refresh(li, false), stale[li] = 0;
        Cand best = NONE;
        for (int li = 0; li < L; ++li) {
            Cand c = low[li];
            if (frozen && is_frozen(li, c.e)) c = refresh(li, true);
            if (c < best) best = c;
        }
        return best;
    }
    bool serve_one() {
        int li, e, level;
        if (!next(li, e, level)) return false;
        int k = li * E + e;
        int vl = -1, ve = -1;
        if (free_slots == 0) {
            Cand v = victim();
            Cand newcomer{1, double(level) + pfine[k], -1, -1};  // compared by rank only
            bool lower = v.li >= 0 && (v.tier < newcomer.tier || (v.tier == newcomer.tier && v.score < newcomer.score));
            if (!lower) {  // every resident ranks at least as high: wait at the head of the queue
                queues[level].push_front(k);
                queued[k] = level;
                return false;
            }
            vl = v.li, ve = v.e;
            int vk = vl * E + ve;
            res[vk] = 0;
            if (demoted[vk]) demoted[vk] = 0, --n_demoted;
            below[vl] -= levels[vk] < taus[vl];
            stale[vl] = 1;
            log(vk, 2);
            ++free_slots;
        }
        --free_slots;
        res[k] = 1;
        if (frozen) frozen[k] = 0;  // loaded after its layer froze: not frozen
        Cand c{1, double(level) + pfine[k], li, e};  // level >= τ (see next), never demoted
        if (c < low[li]) low[li] = c;
        log(k, 1);
        int32_t* a = &actions[5 * n_actions++];
        a[0] = li, a[1] = e, a[2] = level, a[3] = vl, a[4] = ve;
        return true;
    }
    int plan(int budget) {  // serve the queues: at most budget loads (< 0: all); the actions to apply
        n_actions = 0;
        while ((budget < 0 || n_actions < budget) && serve_one()) {}
        return n_actions;
    }
    int handed_out(int64_t version_before) {  // the table's version once the caller applied the plan
        int changes = 0;
        for (int i = 0; i < n_actions; ++i) changes += 1 + (actions[5 * i + 3] >= 0);
        expect = version_before + changes;
        return n_actions;
    }

    void demote(int li, const int64_t* counts) {  // "zero": the layer's used residents go to the bottom
        for (int e = 0; e < E; ++e) {
            int k = li * E + e;
            if (counts[e] > 0 && res[k]) {
                if (!demoted[k]) demoted[k] = 1, ++n_demoted;
                stale[li] = 1;
            }
        }
    }
};

}  // namespace moechat_sched
