// The persistent thread pool of the project's CPU kernels (small_matmul, delta_matmul,
// paged_attention), one per process.
//
// Every kernel library includes this header (`pallas_kernels/native/build.py` puts its folder on the
// include path and keys every build on it, so all libraries of one process share its layout).
// Each library exports `BitdeltaPoolShare`: `native.build` calls it right after loading a
// library, passing the pool of the libraries loaded before (null for the first), so the first
// library's pool becomes every library's: one set of worker threads per process, whatever the
// number of kernel libraries. `run` works on any library's pool: it only touches the pool's
// data, and the workers run the job through the std::function they are handed.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>

namespace bitdelta_native {

// run(f, n) calls f(i) for every i in [0, n), the caller taking part. Never destroyed (its
// threads are detached and simply end with the process).
class Pool {
 public:
  // This library's pool: the one `share` adopted, else a new one.
  static Pool& get() {
    Pool* p = slot().load(std::memory_order_acquire);
    if (p != nullptr) return *p;
    std::lock_guard<std::mutex> lk(create_mu());
    p = slot().load(std::memory_order_acquire);
    if (p == nullptr) {
      p = new Pool;
      slot().store(p, std::memory_order_release);
    }
    return *p;
  }
  // Adopts `other` (another library's pool) if this library has none yet; returns the pool.
  static Pool* share(Pool* other) {
    if (other != nullptr) {
      std::lock_guard<std::mutex> lk(create_mu());
      if (slot().load(std::memory_order_acquire) == nullptr)
        slot().store(other, std::memory_order_release);
    }
    return &get();
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
      job_ = &f; njobs_ = n; gen = ++gen_;
      done_.store(0);
      next_.store((gen & 0xffffffffu) << 32);
      published_.store(gen, std::memory_order_release);
    }
    cv_.notify_all();
    int i, mine = 0;
    while ((i = claim(gen, n)) >= 0) { f(i); ++mine; }
    done_.fetch_add(mine);
    // The workers' last jobs end microseconds later: spin for them before sleeping (a futex
    // sleep and wake-up cost ~10 µs here, the whole work of a small call).
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
    for (int spin = 0; done_.load() < n; ++spin) {
      pause();
      if (spin % 16 == 0 && std::chrono::steady_clock::now() > until) break;
    }
    if (done_.load() < n) {
      std::unique_lock<std::mutex> lk(mu_);
      // seq_cst against the workers' fetch_add, then load of caller_waiting_: either a worker
      // sees the flag and notifies under the lock, or this predicate sees its count
      caller_waiting_.store(true);
      done_cv_.wait(lk, [&] { return done_.load() >= n; });
      caller_waiting_.store(false);
    }
  }

 private:
  static std::atomic<Pool*>& slot() {  // per library
    static std::atomic<Pool*> p{nullptr};
    return p;
  }
  static std::mutex& create_mu() {
    static std::mutex mu;
    return mu;
  }
  Pool() {
    int n = int(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("BITDELTA_CPU_THREADS")) n = std::atoi(env);
    n = std::max(1, std::min(n, 64));
    if (const char* env = std::getenv("BITDELTA_CPU_SPIN_US")) spin_us_ = std::max(0, std::atoi(env));
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
      // A decode step calls the kernels a few hundred times, microseconds apart: spin a while
      // for the next run before sleeping (a futex wake-up costs more than a small call's work).
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      for (int spin = 0; published_.load(std::memory_order_acquire) == seen; ++spin) {
        pause();
        if (spin % 16 == 0 && std::chrono::steady_clock::now() > until) break;
      }
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
        done_.fetch_add(mine);
        if (caller_waiting_.load()) {
          std::lock_guard<std::mutex> lk(mu_);
          done_cv_.notify_all();
        }
      }
    }
  }
  int workers_ = 0;
  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<uint64_t> next_{0};
  std::atomic<uint64_t> published_{0};  // gen_, readable without the lock (for the spin)
  int spin_us_ = 50;  // $BITDELTA_CPU_SPIN_US
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  int njobs_ = 0;
  std::atomic<int> done_{0};  // jobs of the current run finished
  std::atomic<bool> caller_waiting_{false};  // the caller sleeps on done_cv_
  uint64_t gen_ = 0;
};

}  // namespace bitdelta_native

// For `native.build`: adopt the process's pool (`other`, null for the first library); returns
// the pool every later library should adopt. The header is included once per library (in its
// one translation unit), so this definition is too.
extern "C" __attribute__((visibility("default"))) void* BitdeltaPoolShare(void* other) {
  return bitdelta_native::Pool::share(static_cast<bitdelta_native::Pool*>(other));
}
