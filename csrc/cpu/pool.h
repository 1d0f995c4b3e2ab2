// The kernels' thread pool.
#pragma once

#include "common.h"

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

namespace {

// ---- thread pool: the caller is thread 0; workers spin briefly between calls, then sleep ------------
// A decode step makes dozens of kernel calls a few hundred microseconds apart: waking a sleeping worker
// through the kernel costs tens of microseconds each time, so a worker spins SPIN_US on the call word first.
#ifndef MOE_POOL_SPIN_US
#define MOE_POOL_SPIN_US 200
#endif

inline void cpu_relax() {
#ifdef MOE_X86
    _mm_pause();
#else
    std::this_thread::yield();
#endif
}

class Pool {
public:
    // Runs fn(tid) for tid in [0, n) and returns when all are done. One call at a time.
    void run(int n, const std::function<void(int)>& fn) {
        std::lock_guard<std::mutex> call(call_mutex_);
        if (n <= 1) return fn(0);
        remaining_.store(n - 1, std::memory_order_relaxed);
        job_ = &fn;
        {
            std::lock_guard<std::mutex> lk(m_);
            while (started_ < n - 1)  // grow on demand; a new worker waits for the generation after this one
                std::thread(&Pool::worker, this, started_++, word_.load(std::memory_order_relaxed) >> 16).detach();
            // one word: a worker that sees this generation sees its thread count too (and job_, written before)
            word_.store(((word_.load(std::memory_order_relaxed) >> 16) + 1) << 16 | uint64_t(n - 1), std::memory_order_release);
        }
        cv_.notify_all();
        fn(0);
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(MOE_POOL_SPIN_US);
        for (int i = 0; remaining_.load(std::memory_order_acquire) != 0; i++) {
            if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) {
                std::unique_lock<std::mutex> lk(m_);
                done_.wait(lk, [&] { return remaining_.load(std::memory_order_acquire) == 0; });
                break;
            }
            cpu_relax();
        }
        job_ = nullptr;
    }

private:
    void worker(int id, uint64_t seen) {
        for (;;) {
            uint64_t word = word_.load(std::memory_order_acquire);
            const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(MOE_POOL_SPIN_US);
            for (int i = 0; (word >> 16) == seen; i++) {
                if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) {
                    std::unique_lock<std::mutex> lk(m_);
                    cv_.wait(lk, [&] { return (word_.load(std::memory_order_acquire) >> 16) != seen; });
                }
                cpu_relax();
                word = word_.load(std::memory_order_acquire);
            }
            seen = word >> 16;
            if (id >= int(word & 0xFFFF)) continue;  // this call uses fewer threads
            (*job_)(id + 1);
            if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                std::lock_guard<std::mutex> lk(m_);  // the caller may be asleep on done_
                done_.notify_one();
            }
        }
    }

    std::mutex call_mutex_, m_;
    std::condition_variable cv_, done_;
    const std::function<void(int)>* job_ = nullptr;
    std::atomic<uint64_t> word_{0};  // generation << 16 | threads the current call uses beside the caller
    std::atomic<int> remaining_{0};
    int started_ = 0;
};

Pool* g_pool = new Pool;  // never destroyed: detached workers may still wait on it at exit

#if defined(__unix__) || defined(__APPLE__)
// A forked child has none of the parent's threads (nor a sane mutex state): start a fresh pool.
struct ForkGuard {
    ForkGuard() { pthread_atfork(nullptr, nullptr, [] { g_pool = new Pool; }); }
} g_fork_guard;
#endif

}  // namespace
