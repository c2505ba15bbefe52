// Persistent worker pool. Waits spin briefly, then block on condition variables: decode calls come
// back to back (tens of microseconds apart), and waking a blocked thread costs ~50-100 us on a VM,
// while a bounded spin never holds a core that torch or another process needs for long.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace hm {

class ThreadPool {
  public:
    using Job = void (*)(void* ctx, int tid);
    explicit ThreadPool(int num_threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;
    int size() const { return int(threads_.size()) + 1; }
    // Runs job(ctx, tid) on every thread, the caller being tid 0; returns when all have finished.
    void run(Job job, void* ctx);

  private:
    void worker_loop(int tid);
    std::vector<std::thread> threads_;
    std::mutex mu_;
    std::condition_variable start_cv_, done_cv_;
    Job job_ = nullptr;
    void* ctx_ = nullptr;
    std::atomic<uint64_t> generation_{0};  // bumped (under mu_) after job_ / ctx_ are set
    std::atomic<int> pending_{0};
    std::atomic<bool> stop_{false};
};

}  // namespace hm
