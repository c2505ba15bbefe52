#include "threadpool.h"

#include <chrono>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HM_SPIN_PAUSE() _mm_pause()
#else
#define HM_SPIN_PAUSE() std::this_thread::yield()
#endif

namespace hm {
namespace {

// How long a wait spins before it blocks: longer than the gaps between a decode step's calls
// (Python work, ~10-100 us), short enough that an idle pool is asleep within a fraction of a ms.
constexpr auto kSpin = std::chrono::microseconds(200);

template <class Ready>
bool spin_until(Ready ready) {
    const auto deadline = std::chrono::steady_clock::now() + kSpin;
    for (;;) {
        for (int i = 0; i < 64; ++i) {
            if (ready()) return true;
            HM_SPIN_PAUSE();
        }
        if (std::chrono::steady_clock::now() > deadline) return ready();
    }
}

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
    for (int tid = 1; tid < num_threads; ++tid) threads_.emplace_back([this, tid] { worker_loop(tid); });
}

ThreadPool::~ThreadPool() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    start_cv_.notify_all();
    for (auto& t : threads_) t.join();
}

void ThreadPool::run(Job job, void* ctx) {
    if (threads_.empty()) {
        job(ctx, 0);
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        job_ = job;
        ctx_ = ctx;
        pending_.store(int(threads_.size()), std::memory_order_relaxed);
        generation_.fetch_add(1, std::memory_order_release);
    }
    start_cv_.notify_all();
    job(ctx, 0);
    if (spin_until([this] { return pending_.load(std::memory_order_acquire) == 0; })) return;
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
}

void ThreadPool::worker_loop(int tid) {
    uint64_t seen = 0;
    auto ready = [&] { return stop_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen; };
    for (;;) {
        if (!spin_until(ready)) {
            std::unique_lock<std::mutex> lock(mu_);
            start_cv_.wait(lock, ready);
        }
        if (stop_.load(std::memory_order_acquire)) return;
        Job job;
        void* ctx;
        {
            std::lock_guard<std::mutex> lock(mu_);
            seen = generation_.load(std::memory_order_relaxed);
            job = job_;
            ctx = ctx_;
        }
        job(ctx, tid);
        if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
            std::lock_guard<std::mutex> lock(mu_);
            done_cv_.notify_one();
        }
    }
}

}  // namespace hm
