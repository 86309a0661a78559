// The extension's own worker threads: tmpool::parallel_for is what every kernel here calls
// instead of at::parallel_for.
//
// Why not OpenMP's team: a decode step makes a few hundred short parallel calls (each matmul,
// attention, norm), a few to a few tens of microseconds apart. OpenMP's idle threads either
// spin at every barrier, which collapses on a machine whose cores are shared (a spinning thread
// holds the core that a preempted one needs; see tokenmill.utils.default_thread_policy), or
// sleep, and then every call pays a wake-up (on a 2-core AMD EPYC, single-stream decode ran
// 15% faster on these workers: benchmarks/thread_pool_ab.py). These workers do both, by the
// situation:
//   - after a call, a worker spins for the next one for at most the spin time (default 200
//     microseconds, 0: never; the engine's --kernel-spin-us, Pool::set_spin_ns below, or
//     `TOKENMILL_SPIN_US` before the pool starts), then sleeps on a condition variable;
//   - a worker does not spin while its core is contended: when the kernel kept it waiting
//     for a CPU for more than 1/8 of the last 2 ms (its own run-queue delay, from
//     /proc/thread-self/schedstat: another process, or more of this process's threads than
//     cores), it sleeps at once for the next 20 ms, so on a shared machine the pool behaves as
//     a sleeping one. Its own delay sees what a container's CPU limits and cpuset do, where the
//     machine-wide count of runnable threads (/proc/loadavg, the fallback where schedstat is
//     missing) counts other containers' threads too;
//   - the range is cut into a few chunks per thread, taken first come first served from one
//     atomic ticket, and the caller takes chunks too: a worker that wakes late or is
//     preempted costs its share of the work, not a stall of the whole call.
// Every chunk is computed by the kernel's own loop over its indices, so a result never depends
// on which thread computed it or how the range was cut (the batch invariance of
// `--deterministic` holds).
//
// One call at a time runs on the workers; a call made while another thread's call is running,
// or from inside a chunk, runs on the calling thread alone. The pool is rebuilt in a child
// process after fork (its threads do not survive it). TOKENMILL_THREAD_POOL=0: OpenMP's
// threads (at::parallel_for) instead.
#pragma once

#include <ATen/Parallel.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TOKENMILL_POOL_PAUSE() _mm_pause()
#else
#define TOKENMILL_POOL_PAUSE() std::this_thread::yield()
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace tokenmill {
namespace tmpool {

using ChunkFn = void (*)(void* ctx, int64_t begin, int64_t end);

// The pool's settings: tokenmill.envs reads TOKENMILL_THREAD_POOL, TOKENMILL_SPIN_US and
// TOKENMILL_POOL_CHUNKS and hands them over through configure_pool when the extension loads,
// before the pool's first call (the extension reads no environment of its own).
struct PoolSettings {
  // false sends every call to at::parallel_for (OpenMP) instead: the way back if these
  // workers misbehave somewhere, and the baseline of benchmarks/thread_pool_ab.py.
  bool enabled = true;
  int64_t spin_ns = 200'000;
  int64_t chunks_per_thread = 2;  // see below
};

inline PoolSettings& pool_settings() {
  static PoolSettings settings;
  return settings;
}

// Chunks per thread: enough that a thread that starts late, or runs slower on a shared core,
// leaves the others work to take; few enough that each chunk stays a long contiguous run of the
// kernel's loop and the calls of a decode step (a few microseconds each at batch 1) do not pay
// for many claims of the shared ticket. 2 (`TOKENMILL_POOL_CHUNKS` before the pool starts):
// against 4, a batch-1 decode step -3.2% and a batch-32 one -1.3% (switched within one
// process), with the same speed under `bench contention` (one core of two busy: 260.6 vs 252.6
// tok/s single stream, 635.1 vs 634.4 at 32 streams); 1 was faster still on a quiet machine
// but lost 11% of the 32-stream throughput under contention.
// A worker that saw its core contended does not spin for this long afterwards.
constexpr int64_t kBackoffNs = 20'000'000;
// How often a worker checks whether its core is contended.
constexpr int64_t kLoadCheckNs = 2'000'000;
// Contended: the worker waited for a CPU for more than this share of the time since its last
// check (1 / kContendedShare).
constexpr int64_t kContendedShare = 8;
// The caller spins this long for the last chunks, then yields its core between checks.
constexpr int64_t kCallerSpinNs = 50'000;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// True on the pool's workers, and on a caller while it computes chunks: a parallel_for from
// there runs inline.
inline thread_local bool t_in_pool = false;

// True while this thread's calls go to OpenMP's team instead (RouteToOpenMP): in steps whose
// heavy work is PyTorch's own parallel ops (prefill's dense matmuls), so that the pool's
// workers do not spin for the next call while OpenMP's threads need the cores.
inline thread_local bool t_route_to_openmp = false;

class RouteToOpenMP {
 public:
  RouteToOpenMP() : saved_(t_route_to_openmp) { t_route_to_openmp = true; }
  ~RouteToOpenMP() { t_route_to_openmp = saved_; }
  RouteToOpenMP(const RouteToOpenMP&) = delete;
  RouteToOpenMP& operator=(const RouteToOpenMP&) = delete;

 private:
  bool saved_;
};

class Pool {
 public:
  static Pool& get() { return *instance(); }

  // How the workers waited since the pool started: the calls run on the workers, waits that
  // ended while spinning, waits that ended asleep, and waits that skipped the spin because the
  // machine looked busy.
  struct Stats {
    std::atomic<int64_t> calls{0}, caught_spinning{0}, woken{0}, backed_off{0};
  };
  const Stats& stats() const { return stats_; }

  // How long a worker spins for the next call before it sleeps (0: never); takes effect at
  // each worker's next wait.
  void set_spin_ns(int64_t ns) {
    spin_ns_.store(std::max<int64_t>(0, ns), std::memory_order_relaxed);
  }
  int64_t spin_ns() const { return spin_ns_.load(std::memory_order_relaxed); }

  // f(ctx, b, e) over [begin, end) cut into chunks of at least `grain` indices.
  void run(int64_t begin, int64_t end, int64_t grain, ChunkFn fn, void* ctx) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    grain = std::max<int64_t>(1, grain);
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    if (threads == 1 || n <= grain || t_in_pool) {
      fn(ctx, begin, end);
      return;
    }
    if (!enabled_ || t_route_to_openmp) {
      at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { fn(ctx, b, e); });
      return;
    }
    std::unique_lock<std::mutex> running(run_mu_, std::try_to_lock);
    if (!running.owns_lock()) {  // another thread's call holds the workers
      fn(ctx, begin, end);
      return;
    }
    const int64_t wanted = std::min<int64_t>((n + grain - 1) / grain, threads * pool_settings().chunks_per_thread);
    const int64_t chunk = (n + wanted - 1) / wanted;
    ensure_workers(threads - 1);
    stats_.calls.fetch_add(1, std::memory_order_relaxed);
    const uint64_t epoch = publish(begin, end, chunk, threads - 1, fn, ctx);
    t_in_pool = true;
    work(epoch);
    t_in_pool = false;
    wait_done(jobs_[epoch & 1], (n + chunk - 1) / chunk);
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(error_mu_);
      std::swap(error, error_);
    }
    running.unlock();
    if (error) std::rethrow_exception(error);
  }

 private:
  struct Job {
    std::atomic<ChunkFn> fn{nullptr};
    std::atomic<void*> ctx{nullptr};
    std::atomic<int64_t> begin{0}, end{0}, chunk{1}, chunks{0}, workers{0}, done{0};
  };

  // Write the next epoch's job, open its ticket and wake sleeping workers; returns the epoch.
  uint64_t publish(int64_t begin, int64_t end, int64_t chunk, int64_t workers, ChunkFn fn,
                   void* ctx) {
    const uint64_t epoch = ((ticket_.load(std::memory_order_relaxed) >> 32) + 1) & 0xffffffffu;
    Job& job = jobs_[epoch & 1];
    job.fn.store(fn, std::memory_order_relaxed);
    job.ctx.store(ctx, std::memory_order_relaxed);
    job.begin.store(begin, std::memory_order_relaxed);
    job.end.store(end, std::memory_order_relaxed);
    job.chunk.store(chunk, std::memory_order_relaxed);
    job.chunks.store((end - begin + chunk - 1) / chunk, std::memory_order_relaxed);
    job.workers.store(workers, std::memory_order_relaxed);
    job.done.store(0, std::memory_order_relaxed);
    ticket_.store(epoch << 32, std::memory_order_release);
    std::lock_guard<std::mutex> lock(sleep_mu_);
    if (sleepers_ > 0) wake_.notify_all();
    return epoch;
  }

  // The caller, its own chunks done, waits for the workers' last ones.
  static void wait_done(const Job& job, int64_t chunks) {
    const int64_t start = now_ns();
    while (job.done.load(std::memory_order_acquire) < chunks) {
      if (now_ns() - start < kCallerSpinNs) {
        TOKENMILL_POOL_PAUSE();
      } else {
        std::this_thread::yield();  // a preempted worker may be waiting for this core
      }
    }
  }

  // The pool of this process: a new one in a fork's child (the parent's threads are gone
  // there, and its locks may be held by them). Never destroyed: workers may outlive main().
  static Pool*& instance() {
    static Pool* pool = [] {
      pthread_atfork(nullptr, nullptr, [] { instance() = new Pool(); });
      return new Pool();
    }();
    return pool;
  }

  Pool()
      : enabled_(pool_settings().enabled), spin_ns_(pool_settings().spin_ns),
        cores_(usable_cores()) {}

  void ensure_workers(int64_t count) {
    while (num_workers_ < count) {
      const int64_t id = num_workers_++;
      std::thread([this, id] { worker_main(id); }).detach();
    }
  }

  // Take and compute chunks of `epoch` until none is left (or a newer call has started).
  void work(uint64_t epoch) {
    Job& job = jobs_[epoch & 1];
    while (true) {
      uint64_t t = ticket_.load(std::memory_order_acquire);
      // The slot is rewritten only for epoch + 2, after epoch + 1 began: while the ticket
      // still names `epoch`, its fields are this call's.
      if ((t >> 32) != epoch) return;
      const int64_t i = static_cast<int64_t>(t & 0xffffffffu);
      if (i >= job.chunks.load(std::memory_order_relaxed)) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
      const int64_t b = job.begin.load(std::memory_order_relaxed) +
                        i * job.chunk.load(std::memory_order_relaxed);
      const int64_t e = std::min(job.end.load(std::memory_order_relaxed),
                                 b + job.chunk.load(std::memory_order_relaxed));
      try {
        job.fn.load(std::memory_order_relaxed)(job.ctx.load(std::memory_order_relaxed), b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  // What a worker remembers between its contention checks.
  struct LoadWatch {
    int64_t last_check = 0;  // steady clock, ns
    int64_t last_delay = -1;  // its run-queue delay then (ns), -1: not read yet
    int64_t quiet_after = 0;  // no spinning before this time
    bool rebase = false;  // a back-off ended: take a new baseline before judging again
  };

  // Whether this worker's core looks contended (see the top of this file). Checked at most
  // every kLoadCheckNs; a contended reading stops spinning for kBackoffNs. While it backs off
  // the worker sleeps and is woken for every call, and the kernel counts each wake-up's
  // latency as run-queue delay too: the window after a back-off starts afresh, or those
  // wake-ups alone would keep it backing off on a quiet machine.
  bool busy(int64_t now, LoadWatch& w) {
    if (now < w.quiet_after) return true;
    if (w.rebase) {
      w.rebase = false;
      w.last_check = now;
      w.last_delay = own_run_delay_ns();
      return false;
    }
    if (now - w.last_check < kLoadCheckNs) return false;
    const int64_t since = now - w.last_check;
    w.last_check = now;
    const int64_t delay = own_run_delay_ns();
    bool contended;
    if (delay >= 0) {
      contended = w.last_delay >= 0 && (delay - w.last_delay) * kContendedShare > since;
      w.last_delay = delay;
    } else {
      contended = runnable_threads() > cores_;  // -1 (unreadable) is never contended
    }
    if (contended) {
      w.quiet_after = now + kBackoffNs;
      w.rebase = true;
    }
    return contended;
  }

  // The calling thread's time spent runnable but waiting for a CPU, in ns (the second field
  // of /proc/thread-self/schedstat), or -1 where the kernel does not keep it.
  static int64_t own_run_delay_ns() { return int_field("/proc/thread-self/schedstat", 1); }

  // The "running" half of /proc/loadavg's fourth field (e.g. "2/75"), or -1 where unreadable.
  static int64_t runnable_threads() { return int_field("/proc/loadavg", 3); }

  // The integer that starts space-separated field `index` (from 0) of a one-line file under
  // /proc, or -1 where the file or the field is missing.
  static int64_t int_field(const char* path, int index) {
    const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    char buf[128];
    const ssize_t got = ::read(fd, buf, sizeof(buf) - 1);
    ::close(fd);
    if (got <= 0) return -1;
    buf[got] = '\0';
    const char* p = buf;
    for (int field = 0; field < index && p != nullptr; ++field) {
      p = std::strchr(p, ' ');
      if (p != nullptr) ++p;
    }
    if (p == nullptr) return -1;
    char* end = nullptr;
    const long long v = std::strtoll(p, &end, 10);
    return end == p ? -1 : static_cast<int64_t>(v);
  }

  static int64_t usable_cores() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
    return std::max<int64_t>(1, std::thread::hardware_concurrency());
  }

  void worker_main(int64_t id) {
    t_in_pool = true;
    uint64_t seen = ticket_.load(std::memory_order_acquire) >> 32;
    LoadWatch watch;
    while (true) {
      const int64_t idle_from = now_ns();
      const int64_t spin_ns = spin_ns_.load(std::memory_order_relaxed);
      bool fresh = false;
      if (spin_ns > 0 && busy(idle_from, watch)) {
        stats_.backed_off.fetch_add(1, std::memory_order_relaxed);
      } else if (spin_ns > 0) {
        int spins = 0;
        while (!(fresh = (ticket_.load(std::memory_order_acquire) >> 32) != seen)) {
          TOKENMILL_POOL_PAUSE();
          if (++spins % 64 == 0 && now_ns() - idle_from > spin_ns) break;
        }
      }
      if (fresh) {
        stats_.caught_spinning.fetch_add(1, std::memory_order_relaxed);
      } else {
        stats_.woken.fetch_add(1, std::memory_order_relaxed);
        std::unique_lock<std::mutex> lock(sleep_mu_);
        ++sleepers_;
        wake_.wait(lock, [&] { return (ticket_.load(std::memory_order_acquire) >> 32) != seen; });
        --sleepers_;
      }
      seen = ticket_.load(std::memory_order_acquire) >> 32;
      // Workers beyond the call's thread count (the count was lowered) sit this one out.
      if (id < jobs_[seen & 1].workers.load(std::memory_order_relaxed)) work(seen);
    }
  }

  const bool enabled_;
  std::atomic<int64_t> spin_ns_;
  const int64_t cores_;
  Stats stats_;
  std::atomic<uint64_t> ticket_{0};  // epoch << 32 | the next chunk to take
  Job jobs_[2];  // by epoch parity
  std::mutex run_mu_;  // held by the caller whose call the workers run
  std::mutex sleep_mu_;
  std::condition_variable wake_;
  int64_t sleepers_ = 0;  // guarded by sleep_mu_
  int64_t num_workers_ = 0;  // guarded by run_mu_
  std::mutex error_mu_;
  std::exception_ptr error_;  // guarded by error_mu_
};

template <typename F>
void trampoline(void* ctx, int64_t begin, int64_t end) {
  (*static_cast<F*>(ctx))(begin, end);
}

// As at::parallel_for: f(b, e) over chunks of [begin, end), each at least `grain` long.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Pool::get().run(begin, end, grain, &trampoline<const F>, const_cast<void*>(
                                                                static_cast<const void*>(&f)));
}

}  // namespace tmpool
}  // namespace tokenmill
