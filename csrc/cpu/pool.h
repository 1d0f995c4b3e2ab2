// The kernels' thread pool.
#pragma once

#include "common.h"

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

namespace {

// ---- thread pool: the caller is thread 0; workers sleep on a condition variable between calls --
class Pool {
public:
    // Runs fn(tid) for tid in [0, n) and returns when all are done. One call at a time.
    void run(int n, const std::function<void(int)>& fn) {
        std::lock_guard<std::mutex> call(call_mutex_);
        if (n <= 1) return fn(0);
        {
            std::lock_guard<std::mutex> lk(m_);
            while (int(started_) < n - 1) {  // grow on demand; workers are detached and live as long as the process
                std::thread(&Pool::worker, this, started_++).detach();
            }
            job_ = &fn;
            want_ = n - 1;
            remaining_ = n - 1;
            generation_++;
        }
        cv_.notify_all();
        fn(0);
        std::unique_lock<std::mutex> lk(m_);
        done_.wait(lk, [&] { return remaining_ == 0; });
        job_ = nullptr;
    }

private:
    void worker(int id) {
        uint64_t seen = 0;
        for (;;) {
            const std::function<void(int)>* job;
            {
                std::unique_lock<std::mutex> lk(m_);
                cv_.wait(lk, [&] { return generation_ != seen; });
                seen = generation_;
                if (id >= want_) continue;  // this call uses fewer threads
                job = job_;
            }
            (*job)(id + 1);
            std::lock_guard<std::mutex> lk(m_);
            if (--remaining_ == 0) done_.notify_one();
        }
    }

    std::mutex call_mutex_, m_;
    std::condition_variable cv_, done_;
    const std::function<void(int)>* job_ = nullptr;
    uint64_t generation_ = 0;
    int want_ = 0, remaining_ = 0, started_ = 0;
};

Pool* g_pool = new Pool;  // never destroyed: detached workers may still wait on it at exit

#if defined(__unix__) || defined(__APPLE__)
// A forked child has none of the parent's threads (nor a sane mutex state): start a fresh pool.
struct ForkGuard {
    ForkGuard() { pthread_atfork(nullptr, nullptr, [] { g_pool = new Pool; }); }
} g_fork_guard;
#endif

}  // namespace
