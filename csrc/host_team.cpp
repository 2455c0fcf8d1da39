// The host attention call's thread team (sparse_attention.cpp): the calling thread and pool().threads - 1
// workers of its own, kept between calls, in place of an OpenMP parallel region.
//
// Why: in a vLLM engine process libgomp throttles its spinning (more OpenMP threads than cores: torch's
// own team counts), so every region start and every barrier of a call is a futex wake-up, 30-60 us on a
// VM. On the H200 host (hol run 60) a lane batch's host call spent fork 105, tables 47, wait 54 and
// combine 53 us around its 425-us pass: ~8 ms of a 56-ms long token. The contract:
//
//   1. host_team(): the calling thread's team (thread_local), built on first use and rebuilt when pool()
//      changes (threads, cores, spin: set_pool) or in a forked child (which has none of the workers).
//      Member 0 is the caller; workers are members 1..n-1. With pool().cores each member pins itself to
//      cores[member % n] (the caller too, as the OpenMP master was).
//   2. run(fn): every member runs fn(member); run returns once all have. fn must not throw.
//   3. Between runs a worker waits for the next one spinning for pool().spin_us after its last run, then
//      on a condition variable (spin_us 0: at once, as libgomp throttled; a spinning worker holds its
//      core, so only for workers on cores of their own). The caller takes the mutex to wake sleepers only.
//   4. barrier(): the members of the current run meet (a generation barrier); a waiting member spins
//      ~50 us, then yields its core between checks (a member descheduled on a busy machine).
//   5. Dynamic scheduling is the caller's own atomics (sparse_attention.cpp's loops).
//   6. The destructor (the thread's exit) stops and joins the workers.
#include "common.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace nelssa {
namespace {

using Clock = std::chrono::steady_clock;

// 4: spin, then yield, until pred()
template <typename P>
void wait_until(P pred) {
  const auto spin_end = Clock::now() + std::chrono::microseconds(50);
  for (int i = 0; !pred(); ++i) {
    if (i < 64 || Clock::now() < spin_end) {
      for (int k = 0; k < 32; ++k) cpu_relax();
    } else {
      sched_yield();
    }
  }
}

void pin_to(const std::vector<int>& cores, int member) {
  if (cores.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cores[static_cast<size_t>(member) % cores.size()], &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort
}

}  // namespace

class HostTeam {
 public:
  HostTeam(int n, std::vector<int> cores, int64_t spin_us, int generation)
      : n_(n), cores_(std::move(cores)), spin_us_(spin_us), generation_(generation), pid_(getpid()) {
    pin_to(cores_, 0);
    for (int m = 1; m < n_; ++m) workers_.emplace_back([this, m] { loop(m); });
  }

  ~HostTeam() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_.store(true, std::memory_order_seq_cst);
      cv_.notify_all();
    }
    for (auto& t : workers_) t.join();
  }

  bool current(const PoolSettings& p) const {
    return generation_ == p.generation && pid_ == getpid();
  }
  bool forked() const { return pid_ != getpid(); }
  int size() const { return n_; }

  void run(const std::function<void(int)>& fn) {
    if (n_ == 1) return fn(0);
    fn_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    run_gen_.fetch_add(1, std::memory_order_seq_cst);  // publishes fn_ (3: the sleepers' check below pairs
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {  // with a worker's before it waits)
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    fn(0);
    wait_until([&] { return done_.load(std::memory_order_acquire) == n_ - 1; });
    fn_ = nullptr;
  }

  void barrier() {
    if (n_ == 1) return;
    const uint64_t g = bar_gen_.load(std::memory_order_acquire);
    if (bar_count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      bar_count_.store(0, std::memory_order_relaxed);
      bar_gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    wait_until([&] { return bar_gen_.load(std::memory_order_acquire) != g; });
  }

 private:
  void loop(int member) {
    pin_to(cores_, member);
    uint64_t seen = 0;
    for (;;) {
      auto ready = [&] {
        return run_gen_.load(std::memory_order_seq_cst) != seen || stop_.load(std::memory_order_seq_cst);
      };
      if (!spin_until(spin_us_, ready)) {  // 3: spin for the next run, then sleep
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lk, ready);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      if (stop_.load(std::memory_order_seq_cst)) return;
      seen = run_gen_.load(std::memory_order_acquire);
      (*fn_)(member);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  const int n_;
  const std::vector<int> cores_;
  const int64_t spin_us_;
  const int generation_;
  const pid_t pid_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> run_gen_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> done_{0};
  const std::function<void(int)>* fn_ = nullptr;
  std::atomic<int> bar_count_{0};
  std::atomic<uint64_t> bar_gen_{0};
};

HostTeam& host_team() {
  thread_local std::unique_ptr<HostTeam> team;
  const PoolSettings& p = pool();
  if (!team || !team->current(p)) {
    if (team && team->forked()) (void)team.release();  // 1: its threads are the parent's: left as they are
    team.reset();
    team = std::make_unique<HostTeam>(p.threads, p.cores, p.spin_us, p.generation);
  }
  return *team;
}

void team_run(HostTeam& t, const std::function<void(int)>& fn) { t.run(fn); }
void team_barrier(HostTeam& t) { t.barrier(); }
int team_size(const HostTeam& t) { return t.size(); }

}  // namespace nelssa
