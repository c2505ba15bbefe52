#include "threadpool.h"

namespace hm {

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
        pending_ = int(threads_.size());
        ++generation_;
    }
    start_cv_.notify_all();
    job(ctx, 0);
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return pending_ == 0; });
}

void ThreadPool::worker_loop(int tid) {
    uint64_t seen = 0;
    for (;;) {
        Job job;
        void* ctx;
        {
            std::unique_lock<std::mutex> lock(mu_);
            start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
            if (stop_) return;
            seen = generation_;
            job = job_;
            ctx = ctx_;
        }
        job(ctx, tid);
        std::lock_guard<std::mutex> lock(mu_);
        if (--pending_ == 0) done_cv_.notify_one();
    }
}

}  // namespace hm
