// A parallel-for for edgebuild's CPU kernels that never waits for a thread that is not running.
//
// Why: at::parallel_for (OpenMP) ends each region at a barrier, so the caller waits until every
// thread of the team has been scheduled and has passed it. On a 2-core host whose other core is
// busy (another process, a compile), the second OpenMP thread gets the core only at the next
// time slice, and a decode step's ~120 linear calls each waited for one: int4 decode fell from
// 51 to 2.9 tok/s at 2 threads (bench/README.md, issue 26 item 4). Here the caller claims
// chunks itself from a shared counter and the workers help when they run: at the end the caller
// waits only for chunks a worker has already started. A worker that never woke costs nothing.
//
// Results never depend on which thread ran a chunk (each chunk writes its own outputs), so the
// kernels stay bit-identical at any thread count.
//
// Protocol: a job lives in one of two slots (generation parity). The caller fills the slot,
// then publishes ticket = generation << 32 (release). A worker claims chunk i by a CAS of the
// ticket from (g, i) to (g, i + 1) and runs it only when that CAS succeeds, so a worker that
// read a slot while it was being refilled for a later job always fails its CAS and drops what
// it read. Workers spin 2 ms after their last chunk (a decode step's calls come tens of us
// apart; a 50 us spin let them fall asleep between calls: bf16 2-thread step 36 against 27 ms),
// then sleep on a condition variable until the next job.
//
// Measured (1-row SmolLM2 steps, 2 threads, bench/README.md): with the other core busy, int4
// 28 ms here against 305 ms (median) through OpenMP; on a quiet host ~8% slower than OpenMP's
// static split (bf16 27.6 / 26.0 ms, int4 19.1 / 17.9 ms).
#pragma once

#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace eb_pool {

inline void pause() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

using ChunkFn = void (*)(void* ctx, int64_t begin, int64_t end);

struct Slot {
  std::atomic<ChunkFn> fn{nullptr};
  std::atomic<void*> ctx{nullptr};
  std::atomic<int64_t> n{0}, total{0}, per{1};  // chunks, items, items per chunk
  std::atomic<int64_t> done{0};                // chunks finished
  std::exception_ptr error;                    // the first chunk's exception (under error_mutex)
  std::mutex error_mutex;
};

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: workers may outlive static teardown
    return *pool;
  }

  // Runs fn(ctx, b, e) over [0, total) in chunks of `per` items with `threads` threads at most.
  void run(int64_t total, int64_t per, int threads, ChunkFn fn, void* ctx) {
    const int64_t chunks = (total + per - 1) / per;
    if (threads <= 1 || chunks <= 1) {
      fn(ctx, 0, total);
      return;
    }
    std::lock_guard<std::mutex> caller(call_mutex_);  // one job at a time
    ensure_workers(threads - 1);
    const uint64_t gen = ++gen_;
    Slot& s = slots_[gen & 1];
    s.fn.store(fn, std::memory_order_relaxed);
    s.ctx.store(ctx, std::memory_order_relaxed);
    s.n.store(chunks, std::memory_order_relaxed);
    s.total.store(total, std::memory_order_relaxed);
    s.per.store(per, std::memory_order_relaxed);
    s.done.store(0, std::memory_order_relaxed);
    s.error = nullptr;
    ticket_.store(gen << 32, std::memory_order_release);
    if (sleepers_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    while (claim_and_run(gen)) {
    }
    while (s.done.load(std::memory_order_acquire) < chunks) pause();  // started chunks
    if (s.error) std::rethrow_exception(s.error);  // a TORCH_CHECK in a chunk: the caller's
  }

 private:
  Pool() = default;

  // Claims one chunk of job `gen` and runs it; false when the job has none left (or is over).
  bool claim_and_run(uint64_t gen) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if ((t >> 32) != gen) return false;
      Slot& s = slots_[gen & 1];
      const int64_t i = static_cast<int64_t>(t & 0xffffffffu);
      const int64_t n = s.n.load(std::memory_order_relaxed);
      const ChunkFn fn = s.fn.load(std::memory_order_relaxed);
      void* ctx = s.ctx.load(std::memory_order_relaxed);
      const int64_t total = s.total.load(std::memory_order_relaxed);
      const int64_t per = s.per.load(std::memory_order_relaxed);
      if (i >= n) return false;
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
        try {
          fn(ctx, i * per, std::min(total, (i + 1) * per));
        } catch (...) {  // never let it kill a worker: the caller rethrows it
          std::lock_guard<std::mutex> lock(s.error_mutex);
          if (!s.error) s.error = std::current_exception();
        }
        s.done.fetch_add(1, std::memory_order_release);
        return true;
      }
    }
  }

  void ensure_workers(int want) {
    while (static_cast<int>(workers_.size()) < want)
      workers_.emplace_back([this] { loop(); });
  }

  void loop() {
    for (;;) {
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(2000);
      bool worked = false;
      while (std::chrono::steady_clock::now() < spin_until) {
        const uint64_t gen = ticket_.load(std::memory_order_acquire) >> 32;
        if (gen != 0 && claim_and_run(gen)) {
          worked = true;
          break;
        }
        pause();
      }
      if (worked) continue;
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      sleepers_.fetch_add(1, std::memory_order_acq_rel);
      const uint64_t now = gen_.load(std::memory_order_acquire);
      wake_.wait(lock, [&] { return gen_.load(std::memory_order_acquire) != now; });
      sleepers_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex call_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> gen_{0}, ticket_{0};
  std::atomic<int> sleepers_{0};
  Slot slots_[2];
  std::vector<std::thread> workers_;
};

// parallel_for(0, total, per, f) with f(begin, end): on the pool with at::get_num_threads()
// threads, serially inside an OpenMP / pool region or with one thread.
template <typename F>
void parallel_for(int64_t total, int64_t per, const F& f) {
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  auto call = [](void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); };
  // at least `per` items a chunk, and about 2 chunks a thread: a chunk pays a fixed cost (the
  // AMX kernels load and release the tile configuration), and the caller can still take over
  // the chunks of a worker that is not running
  per = std::max<int64_t>({per, 1, (total + 2 * threads - 1) / (2 * threads)});
  Pool::get().run(total, per, threads, call,
                  const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace eb_pool
