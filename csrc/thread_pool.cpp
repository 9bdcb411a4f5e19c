#include "thread_pool.h"

#include <algorithm>
#include <memory>

namespace lmc {

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < std::max(1, num_threads); ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_start_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_items() {
  for (;;) {
    int64_t i;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (next_ >= n_ || error_) return;
      i = next_++;
    }
    try {
      (*fn_)(i);
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_start_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      ++active_;
    }
    run_items();
    {
      std::lock_guard<std::mutex> lk(mu_);
      --active_;
    }
    cv_done_.notify_all();
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> job(job_mutex_);
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    error_ = nullptr;
    ++generation_;
  }
  cv_start_.notify_all();
  run_items();
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lk(mu_);
    // Items are claimed under mu_, so once next_ reaches n_ and no worker is inside run_items,
    // every item has finished.
    cv_done_.wait(lk, [&] { return active_ == 0 && (next_ >= n_ || error_); });
    n_ = 0;
    fn_ = nullptr;
    err = error_;
  }
  if (err) std::rethrow_exception(err);
}

namespace {
std::mutex g_pool_mu;
std::shared_ptr<ThreadPool> g_pool;

int default_threads() {
  unsigned hc = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp<unsigned>(hc == 0 ? 1 : hc, 1, 16));
}
}  // namespace

std::shared_ptr<ThreadPool> cpu_pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (!g_pool) g_pool = std::make_shared<ThreadPool>(default_threads());
  return g_pool;
}

void set_cpu_threads(int n) {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  g_pool = std::make_shared<ThreadPool>(n <= 0 ? default_threads() : n);
}

}  // namespace lmc
