// Persistent worker pool with passive waits (condition variables, no spinning), so our workers
// never burn a core that torch's intra-op pool or another process needs.
#pragma once
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
    uint64_t generation_ = 0;
    int pending_ = 0;
    bool stop_ = false;
};

}  // namespace hm
