// A small fixed pool of worker threads for data-parallel host copies.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace lmc {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(i) for i in [0, n) on the pool and the calling thread; returns when all are done.
  // Calls from several threads are served one after another. The first exception is rethrown.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void worker_loop();
  void run_items();

  std::vector<std::thread> workers_;
  std::mutex job_mutex_;  // one job at a time
  std::mutex mu_;
  std::condition_variable cv_start_, cv_done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t next_ = 0;
  int active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

// The process-wide pool used by CPU transfers (created on first use; shared so that a resize
// never pulls it from under a running copy).
std::shared_ptr<ThreadPool> cpu_pool();
// Resizes the process-wide pool (n <= 0: one thread per core, at most 16).
void set_cpu_threads(int n);

}  // namespace lmc
