// The kernels' thread pool: one per process, shared by every kernel of the library (expert_ffn.cpp,
// quant_ffn.cpp, decode_ops.cpp, decode_stack.cpp), so that no two pools' threads fight for the cores.
//
// A decode step makes dozens of parallel calls a few microseconds apart (per layer: q/k/v, attention,
// output, router, experts). Waking a sleeping worker costs 12-40 us on a VM (a futex and, after a pause,
// an idle vCPU's wake-up), more than most of those calls take. So a worker that finishes a call spins
// (pause instruction) for up to SPIN_US for the next one before it sleeps on the condition variable,
// and the caller spins the same while it waits for the workers: within one native decode pass every
// call after the first is handed over through two atomics. Between passes (Python runs) the workers
// sleep after SPIN_US, leaving the core to PyTorch and the UI.
#pragma once

#include <chrono>

#include "common.h"

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

#if defined(__GLIBCXX__) && !defined(_GLIBCXX_HAS_GTHREADS)  // MinGW-w64's g++ before GCC 13 built with win32 threads
#error "this g++ has no std::thread: use a MinGW-w64 g++ with posix threads (WinLibs' POSIX build, MSYS2's) or GCC 13 or later"
#endif

namespace moe_pool {

constexpr double SPIN_US = 100.0;  // how long a worker or the caller spins before it sleeps

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

inline double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Pool {
public:
    // Runs fn(tid) for tid in [0, n) and returns when all are done. One call at a time.
    void run(int n, const std::function<void(int)>& fn) {
        std::lock_guard<std::mutex> call(call_mutex_);
        n = std::min(n, 1 << 15);
        if (n <= 1) return fn(0);
        while (started_ < n - 1)  // grow on demand; workers are detached and live as long as the process
            std::thread(&Pool::worker, this, started_++, generation_.load()).detach();  // the calls before it are not its
        job_ = &fn;  // read only by this call's workers, each before it counts itself done: no later call overwrites it early
        remaining_.store(n - 1, std::memory_order_relaxed);
        {
            std::lock_guard<std::mutex> lk(m_);  // a worker deciding to sleep holds m_: it sees this generation or the notify
            // the call's worker count travels in the same word as its generation: a worker that sat out earlier calls
            // and wakes late reads the count of the call it sees, never a count written for the next one
            const uint64_t next = (generation_.load(std::memory_order_relaxed) >> 16) + 1;
            generation_.store(next << 16 | uint64_t(n - 1), std::memory_order_release);
        }
        cv_.notify_all();  // no system call when every worker is spinning
        fn(0);
        const double t0 = now_us();
        while (remaining_.load(std::memory_order_acquire) != 0) {
            if (now_us() - t0 > SPIN_US) {
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
            uint64_t g = generation_.load(std::memory_order_acquire);
            const double t0 = now_us();
            while (g == seen && now_us() - t0 < SPIN_US) {
                cpu_relax();
                g = generation_.load(std::memory_order_acquire);
            }
            if (g == seen) {
                std::unique_lock<std::mutex> lk(m_);
                cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
                g = generation_.load(std::memory_order_acquire);
            }
            seen = g;
            if (uint64_t(id) >= (g & 0xFFFF)) continue;  // this call uses fewer threads
            (*job_)(id + 1);
            if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
                std::lock_guard<std::mutex> lk(m_);  // the caller may have gone to sleep on done_
                done_.notify_one();
            }
        }
    }

    std::mutex call_mutex_, m_;
    std::condition_variable cv_, done_;
    const std::function<void(int)>* job_ = nullptr;
    std::atomic<uint64_t> generation_{0};  // call number << 16 | its worker count
    std::atomic<int> remaining_{0};
    int started_ = 0;
};

// How many of `threads` a call reading about `bytes` should use: one per PER_THREAD_BYTES (a spinning
// hand-off costs about a microsecond, what one thread reads of these in a few).
constexpr double PER_THREAD_BYTES = 64 * 1024;
inline int threads_for(int threads, double bytes) {
    return int(std::max(1.0, std::min(double(threads), bytes / PER_THREAD_BYTES)));
}

// Work items handed out in runs of consecutive ones (a quarter of an even share), so that a thread streams long stretches
// of one matrix's rows, what the hardware prefetcher follows, instead of every other small block: two threads taking
// 128 KB blocks in turn read DRAM at 43 GB/s where each streaming its own 1 MB reads at 50 (Zen 4, fast phase,
// docs/benchmarks.md "Runs of rows"); and a core the VM slows for a while still leaves its last runs to the others.
class Items {
public:
    Items(int64_t n, int threads) : n_(n), run_(std::max<int64_t>(1, n / (4 * int64_t(std::max(1, threads))))) {}
    struct Cursor {
        int64_t at = 0, end = 0;  // the run taken: items at..end-1 still to do
    };
    bool next_run(Cursor& c) {  // a whole run into c; false: none left
        c.at = next_.fetch_add(run_);
        c.end = std::min(n_, c.at + run_);
        return c.at < c.end;
    }
    int64_t next(Cursor& c) {  // the next item, one at a time; -1: none left
        if (c.at >= c.end && !next_run(c)) return -1;
        return c.at++;
    }
    static int64_t ahead(const Cursor& c) { return c.at < c.end ? c.at : -1; }  // what next(c) gives without a claim, else -1

private:
    int64_t n_, run_;
    std::atomic<int64_t> next_{0};
};

inline Pool* g_pool = new Pool;  // never destroyed: detached workers may still wait on it at exit

#if defined(__unix__) || defined(__APPLE__)
// A forked child has none of the parent's threads (nor a sane mutex state): start a fresh pool.
struct ForkGuard {
    ForkGuard() { pthread_atfork(nullptr, nullptr, [] { g_pool = new Pool; }); }
};
inline ForkGuard g_fork_guard;
#endif

}  // namespace moe_pool

using moe_pool::g_pool;
using moe_pool::Items;
using moe_pool::threads_for;
