// The helper threads the CPU kernels (qmatmul_cpu.cc, attention_cpu.cc) share a call's work
// with: a crew of threads of their own, rather than tasks on XLA's intra-op pool.
//
// Why not XLA's pool: a program XLA runs on its client thread (a plain decoding loop) calls
// the kernels from outside the pool. Each `pool.Schedule` from there also wakes a sleeping
// pool worker that finds nothing to do (the pool's spinning worker has taken the task), so a
// third thread keeps getting onto the two cores of a small machine, ~120 times a decoding
// step. The same kernels called from a pool worker (XLA moves a program with independent
// thunks there) ran 10-25 % faster a step (benchmarks/cpu_kernel_threads.py measures both).
//
// A crew thread spins for a short while after each job (the next kernel call follows within
// microseconds in a decoding loop), then sleeps until the next. A job is published, not
// queued: helpers take the newest, and the caller runs whatever chunks no helper took, so a
// call's result never waits on a helper that did not come (several devices' programs calling
// at once, a forked child with no crew threads, a machine whose pool is one thread). A helper
// runs a job in the caller's floating-point environment (XLA's threads flush subnormals to
// zero), so a unit's result does not depend on the thread that computes it.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cfenv>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPECJAX_CREW_PAUSE() _mm_pause()
#else
#define SPECJAX_CREW_PAUSE() std::this_thread::yield()
#endif

namespace specjax_crew {

// How long an idle crew thread spins for the next job before it sleeps.
constexpr std::chrono::microseconds kSpin{200};

class Crew;
inline std::atomic<Crew*> current{nullptr};   // the process's crew (reset in a forked child)
inline std::atomic<bool> enabled{true};       // false: the kernels use XLA's pool (specjax_crew_enable)

class Crew {
 public:
  // The process's crew, grown to at least `helpers` threads. Call through `specjax_crew_with`,
  // which both kernel libraries share.
  static Crew& with(int64_t helpers) {
    Crew* crew = current.load(std::memory_order_acquire);
    if (crew != nullptr && crew->size_.load(std::memory_order_acquire) >= helpers) return *crew;
    static std::mutex made_lock;
    static bool fork_handled = false;
    std::lock_guard<std::mutex> lock(made_lock);
    if (!fork_handled) {  // a forked child has none of the parent's threads: it makes its own crew
      pthread_atfork(nullptr, nullptr, [] { current.store(nullptr, std::memory_order_relaxed); });
      fork_handled = true;
    }
    crew = current.load(std::memory_order_acquire);
    if (crew == nullptr) crew = new Crew();  // leaked: its threads outlive static teardown
    crew->grow(helpers);
    current.store(crew, std::memory_order_release);
    return *crew;
  }

  // Hands `job` to every crew thread (each runs it once, if it sees it before a newer one);
  // returns its generation (for `retire`).
  uint64_t publish(std::function<void()> job) {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = std::move(job);
    const uint64_t generation = generation_.fetch_add(1, std::memory_order_release) + 1;
    if (sleepers_ > 0) wake_.notify_all();
    return generation;
  }

  // Drops the published job (what it holds) if it is still the newest.
  void retire(uint64_t generation) {
    std::lock_guard<std::mutex> lock(mu_);
    if (generation_.load(std::memory_order_relaxed) == generation) job_ = nullptr;
  }

 private:
  void grow(int64_t helpers) {
    while (size_.load(std::memory_order_relaxed) < helpers) {
      std::thread([this] { serve(); }).detach();
      size_.fetch_add(1, std::memory_order_release);
    }
  }

  void serve() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const auto since = std::chrono::steady_clock::now();
      for (uint32_t spins = 1; generation_.load(std::memory_order_acquire) == seen; ++spins) {
        SPECJAX_CREW_PAUSE();
        if ((spins & 255) == 0 && std::chrono::steady_clock::now() - since > kSpin) {
          std::unique_lock<std::mutex> lock(mu_);
          ++sleepers_;
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
          --sleepers_;
          break;
        }
      }
      std::function<void()> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = generation_.load(std::memory_order_relaxed);
        job = job_;
      }
      if (job) job();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::function<void()> job_;  // guarded by mu_
  std::atomic<uint64_t> generation_{0};
  int sleepers_ = 0;  // guarded by mu_
  std::atomic<int64_t> size_{0};  // threads started (grown under Crew::with's lock)
};

}  // namespace specjax_crew

extern "C" void* specjax_crew_with(int64_t helpers);

namespace specjax_crew {

// Runs `take()` on the calling thread and on `helpers` more threads: `take` is each thread's
// loop over the call's shared work (it returns when no unit is left), `finished()` says every
// unit taken has been done. The helpers are the crew's threads, or tasks on XLA's `pool` where
// the crew is switched off (specjax_crew_enable(0)). The caller waits only for units helpers
// took, which they are running: no deadlock, and a helper that comes late finds nothing left.
template <typename Pool, typename Take, typename Finished>
void share(Pool& pool, int64_t helpers, Take take, Finished finished) {
  Crew* crew = nullptr;  // the crew this call published its job to (none: XLA's pool, or alone)
  uint64_t published = 0;
  if (helpers > 0 && enabled.load(std::memory_order_relaxed)) {
    crew = static_cast<Crew*>(specjax_crew_with(helpers));
    std::fenv_t env;  // the caller's floating-point environment (XLA's threads flush subnormals)
    fegetenv(&env);
    published = crew->publish([take, env] {
      fesetenv(&env);  // a unit's result must not depend on the thread that computes it
      take();
    });
  } else {
    for (int64_t t = 0; t < helpers; ++t) pool.Schedule(Take(take));
  }
  take();
  while (!finished()) std::this_thread::yield();
  if (crew != nullptr) crew->retire(published);
}


// Runs body(i) for i in [0, n) on the calling thread and the crew, items handed out one at a
// time to whichever thread asks next. Shared (heap) state, so a helper that comes after the
// call has returned finds no item left and leaves.
struct Items {
  std::function<void(int64_t)> body;
  int64_t n = 0;
  std::atomic<int64_t> next{0}, done{0};
};

inline void run_items(Items& items) {
  for (;;) {
    const int64_t i = items.next.fetch_add(1, std::memory_order_relaxed);
    if (i >= items.n) return;
    items.body(i);
    items.done.fetch_add(1, std::memory_order_release);
  }
}

// shared false: all on the calling thread (a call too small for handing items out to pay).
template <typename Pool>
void parallel_for(Pool& pool, int64_t n, std::function<void(int64_t)> body, bool shared = true) {
  if (n <= 0) return;
  if (!shared) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  auto items = std::make_shared<Items>();
  items->body = std::move(body);
  items->n = n;
  const int64_t threads = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n);
  // Only items other threads took are left when the caller's loop ends, and those threads are
  // running them.
  share(pool, threads - 1, [items] { run_items(*items); },
        [&] { return items->done.load(std::memory_order_acquire) >= n; });
}

}  // namespace specjax_crew

// The crew of the process, one for both kernel libraries (tests/test_cpu_crew.py checks): with
// GCC, `current` is an inline variable, one object in the process (a unique symbol); and the
// libraries are loaded with RTLD_GLOBAL (kernels/cpu_ffi.py), so where a compiler makes no
// unique symbols the dynamic linker still binds both libraries' calls of this function to the
// first one loaded (a default-visibility function of a -fPIC library is called through the
// PLT, and not inlined). Two crews would each keep a thread spinning beside the other's work.
extern "C" __attribute__((visibility("default"), noinline)) void* specjax_crew_with(int64_t helpers) {
  return &specjax_crew::Crew::with(helpers);
}

// Switches the crew on (1, the default) or off (0: helpers are tasks on XLA's pool, as before
// the crew; kernels/cpu_ffi.py `use_crew`, for A/B measurements). Results are the same either
// way: a unit's output does not depend on the thread that computes it.
extern "C" __attribute__((visibility("default"), noinline)) void specjax_crew_enable(int32_t on) {
  specjax_crew::enabled.store(on != 0, std::memory_order_relaxed);
}
