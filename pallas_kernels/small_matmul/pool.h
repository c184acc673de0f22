// The persistent thread pool of the CPU small-M kernels (`cpu_kernel.cc`, `cpu_bf16_kernel.cc`).
// Included by both; cpu.py keys their builds on this file too.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>

namespace bitdelta_small {

// A persistent pool: run(f, n) calls f(i) for every i in [0, n), the caller taking part.
// It is never destroyed (its threads are detached and simply end with the process).
class Pool {
 public:
  static Pool& get() {
    static Pool* p = new Pool;
    return *p;
  }
  int size() const { return int(workers_) + 1; }
  void run(const std::function<void(int)>& f, int n) {
    if (n <= 1 || workers_ == 0) {
      for (int i = 0; i < n; ++i) f(i);
      return;
    }
    // One run at a time: XLA runs independent custom calls (q/k/v projections, two engines'
    // steps) on several threads at once, and a second caller would reset job_ / done_ under
    // the first, letting it return while workers still write into its (reused) output buffer.
    std::lock_guard<std::mutex> one_at_a_time(run_mu_);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &f; njobs_ = n; done_ = 0; gen = ++gen_;
      next_.store((gen & 0xffffffffu) << 32);
    }
    cv_.notify_all();
    int i, mine = 0;
    while ((i = claim(gen, n)) >= 0) { f(i); ++mine; }
    std::unique_lock<std::mutex> lk(mu_);
    done_ += mine;
    done_cv_.wait(lk, [&] { return done_ >= n; });
  }

 private:
  Pool() {
    int n = int(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("BITDELTA_CPU_THREADS")) n = std::atoi(env);
    n = std::max(1, std::min(n, 64));
    for (int i = 1; i < n; ++i) std::thread([this] { loop(); }).detach();
    workers_ = n - 1;
  }
  // the next index of run `gen`, or -1: a claim never crosses into another run
  int claim(uint64_t gen, int n) {
    uint64_t cur = next_.load();
    for (;;) {
      if ((cur >> 32) != (gen & 0xffffffffu) || int(cur & 0xffffffffu) >= n) return -1;
      if (next_.compare_exchange_weak(cur, cur + 1)) return int(cur & 0xffffffffu);
    }
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job;
      int n;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return gen_ != seen; });
        seen = gen_;
        job = job_;
        n = njobs_;
      }
      int i, mine = 0;
      while ((i = claim(seen, n)) >= 0) { (*job)(i); ++mine; }
      if (mine) {
        std::lock_guard<std::mutex> lk(mu_);
        done_ += mine;
        done_cv_.notify_all();
      }
    }
  }
  int workers_ = 0;
  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<uint64_t> next_{0};
  int njobs_ = 0, done_ = 0;
  uint64_t gen_ = 0;
};

}  // namespace bitdelta_small
