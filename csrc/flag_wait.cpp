// Host attention calls the device waits for through flags in pinned memory (CUDA stream memory
// operations), run by a thread of ours instead of the CUDA driver's (host_call.cpp's launch runs them as
// CUDA host functions, on the driver's worker thread; config ``lane_host_wait``).
//
// The contract (the long lane's per-layer host job, nelssa/vllm_plugin/lane_host.py):
//   1. launch_flags(call, stream, arm): the call gets a slot — two 32-bit flags, ``ready`` and ``done``, in
//      pinned, device-mapped memory — for its lifetime (a captured graph's replays reuse it), and the
//      stream gets three memory operations: write ready = 1 (after the stream's earlier work, the
//      queries' copies: the write carries a memory fence), wait until done == 1, write done = 0. While
//      the stream captures, these become a graph's memory-operation nodes, replayed as they are.
//   2. One poller thread per process sees ready == 1, clears it, runs the call (HostCall::run: never
//      throws; a failure is kept as state and NaN outputs, host_call.cpp 3), then sets done = 1 and the
//      stream goes on (the results' copies). Nothing of the host attention runs on the driver's worker
//      thread, which also runs other host functions and stages pageable copies for every stream.
//   3. arm: the call becomes "launched" and counts as armed (not yet run); rearm_host_call re-arms a
//      captured call before each replay. The poller spins while calls are armed, at most 200 ms after
//      its last call or arm, and otherwise scans every 1 ms: a call is never missed, only later.
//      A capture passes arm = false (the capture runs nothing; the replays are armed).
//   1b. ops splits 1's operations in two launches on the same stream: 1 the ready write (and 3's arming),
//      2 the wait and the reset. Work the stream gets between them runs while the call runs (the lane's
//      estimate and window attention, lane_host.py 3); the call's outputs are read only after the wait.
//   4. A slot returns to the free list when its call is destroyed: its owner drops it only after the
//      stream passed the call (lane_host.py 4). A ready flag whose call is gone still gets done = 1: the
//      device never waits on us forever.
//   1a. make_host_call_flags(): the flags are made at their first use, by cuMemHostAlloc, which a stream
//      capture forbids (it fails there, and the flags stay unmapped for the process: H100 hol runs 87/88);
//      the lane calls this at engine start, outside any capture, so its first batch may be captured.
//   5. Without a CUDA driver (CPU builds, tests) the flags live in ordinary memory and launch_flags
//      fails; arm_flags_for_test gives a call a slot and returns the flags' host addresses, so a test
//      can play the device's part.
#include "common.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace nelssa {
namespace {

constexpr int kSlots = 8192;
constexpr auto kSpinAfter = std::chrono::milliseconds(200);

template <typename F>
F sym(const char* name, const char* fallback = nullptr) {
  return reinterpret_cast<F>(cuda_driver_symbol(name, fallback));
}

using MemHostAlloc = int (*)(void** pp, size_t bytes, unsigned int flags);
using HostDevPtr = int (*)(uint64_t* dptr, void* p, unsigned int flags);
using StreamValue = int (*)(void* stream, uint64_t addr, uint32_t value, unsigned int flags);
constexpr unsigned kHostAllocPortable = 0x01, kHostAllocDeviceMap = 0x02;
constexpr unsigned kWaitEq = 0x1;

class Flags {
 public:
  static Flags& get() {
    static Flags* f = new Flags();  // never destroyed: its thread runs until the process exits
    return *f;
  }

  // a slot for call (3: armed or not)
  int acquire(const std::shared_ptr<HostCall>& call) {
    std::lock_guard<std::mutex> lk(m_);
    TORCH_CHECK(!free_.empty() || high_.load() < kSlots, "no free host-call flag slot (", kSlots, " in use)");
    int s;
    if (!free_.empty()) {
      s = free_.back();
      free_.pop_back();
    } else {
      s = high_.load(std::memory_order_relaxed);
      high_.store(s + 1, std::memory_order_release);
    }
    ready_[s] = 0, done_[s] = 0;
    table_[s] = call;
    return s;
  }

  void release(int s) {
    if (s < 0) return;
    std::lock_guard<std::mutex> lk(m_);
    table_[s].reset();
    ready_[s] = 0, done_[s] = 0;
    free_.push_back(s);
  }

  void arm() {
    armed_.fetch_add(1, std::memory_order_acq_rel);
    last_arm_ns_.store(now_ns(), std::memory_order_release);
    start();
    cv_.notify_one();
  }

  void start() {
    std::call_once(started_, [this] { std::thread(&Flags::loop, this).detach(); });
  }

  volatile int32_t* ready(int s) { return ready_ + s; }
  volatile int32_t* done(int s) { return done_ + s; }
  uint64_t dev_ready(int s) const { return dev_ + 4ull * s; }
  uint64_t dev_done(int s) const { return dev_ + 4ull * (kSlots + s); }
  bool mapped() const { return dev_ != 0; }

 private:
  Flags() {
    auto alloc = sym<MemHostAlloc>("cuMemHostAlloc");
    auto devptr = sym<HostDevPtr>("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer");
    void* p = nullptr;
    if (alloc && devptr && alloc(&p, 2 * kSlots * sizeof(int32_t), kHostAllocPortable | kHostAllocDeviceMap) == 0) {
      uint64_t d = 0;
      TORCH_CHECK(devptr(&d, p, 0) == 0, "cuMemHostGetDevicePointer failed for the host-call flags");
      dev_ = d;
    } else {  // no driver or no context: ordinary memory, for tests (5)
      p = std::calloc(2 * kSlots, sizeof(int32_t));
      TORCH_CHECK(p != nullptr, "out of memory for the host-call flags");
    }
    ready_ = static_cast<volatile int32_t*>(p);
    done_ = ready_ + kSlots;
    for (int i = 0; i < 2 * kSlots; ++i) ready_[i] = 0;
    table_.resize(kSlots);
  }

  // the scan takes no lock while nothing is ready (the lane thread re-arms calls holding the GIL)
  void loop() {
    int64_t last_seen = now_ns();
    constexpr int64_t spin_after = std::chrono::duration_cast<std::chrono::nanoseconds>(kSpinAfter).count();
    for (;;) {
      bool ran = false;
      const int high = high_.load(std::memory_order_acquire);
      for (int s = 0; s < high; ++s) {
        if (ready_[s] != 1) continue;
        ready_[s] = 0;
        std::shared_ptr<HostCall> c;
        {
          std::lock_guard<std::mutex> lk(m_);
          c = table_[s].lock();
        }
        if (c) {
          c->run();
          armed_.fetch_sub(1, std::memory_order_acq_rel);
        }
        std::atomic_thread_fence(std::memory_order_seq_cst);  // the outputs before done (x86: stores in order)
        done_[s] = 1;
        c.reset();  // may destroy the call (4): after done, outside the lock
        ran = true;
      }
      const int64_t now = now_ns();
      if (ran) {
        last_seen = now;
        continue;
      }
      const int64_t last_arm = last_arm_ns_.load(std::memory_order_acquire);
      if (armed_.load(std::memory_order_acquire) > 0 && now - std::max(last_seen, last_arm) < spin_after) {
        std::this_thread::yield();
        continue;
      }
      std::unique_lock<std::mutex> lk(m_);
      cv_.wait_for(lk, std::chrono::milliseconds(1));
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::vector<std::weak_ptr<HostCall>> table_;
  std::vector<int> free_;
  std::atomic<int> high_{0};
  std::once_flag started_;
  std::atomic<int64_t> armed_{0};
  std::atomic<int64_t> last_arm_ns_{0};
  volatile int32_t* ready_ = nullptr;
  volatile int32_t* done_ = nullptr;
  uint64_t dev_ = 0;
};

int slot_of(const std::shared_ptr<HostCall>& call) {
  if (call->flag_slot < 0) call->flag_slot = Flags::get().acquire(call);
  return call->flag_slot;
}

}  // namespace

void launch_host_call_flags(const std::shared_ptr<HostCall>& call, int64_t stream, bool arm, int64_t ops) {
  TORCH_CHECK(ops >= 1 && ops <= 3, "launch_flags: ops is 1 (ready), 2 (wait) or 3 (both), got ", ops);
  static StreamValue write = sym<StreamValue>("cuStreamWriteValue32_v2", "cuStreamWriteValue32");
  static StreamValue wait = sym<StreamValue>("cuStreamWaitValue32_v2", "cuStreamWaitValue32");
  TORCH_CHECK(write != nullptr && wait != nullptr,
              "CUDA stream memory operations are not available: no CUDA driver (libcuda.so.1) in this process");
  Flags& f = Flags::get();
  TORCH_CHECK(f.mapped(), "the host-call flags are not device-mapped (no CUDA context when they were made)");
  const int s = slot_of(call);
  void* st = reinterpret_cast<void*>(stream);
  int r = 0;
  if (ops & 1) r = write(st, f.dev_ready(s), 1, 0);
  if (r == 0 && (ops & 2)) r = wait(st, f.dev_done(s), 1, kWaitEq);
  if (r == 0 && (ops & 2)) r = write(st, f.dev_done(s), 0, 0);
  TORCH_CHECK(r == 0, "a stream memory operation failed (CUresult ", r, ")");
  if (!(ops & 1)) return;  // the wait alone: armed (or not) with its ready write
  if (arm) {
    mark_launched(*call);
    f.arm();
  } else {
    f.start();
  }
}

void rearm_flags(HostCall& call) {
  if (call.flag_slot >= 0) Flags::get().arm();
}

void release_flag_slot(int slot) {
  if (slot >= 0) Flags::get().release(slot);
}

bool make_host_call_flags() { return Flags::get().mapped(); }

std::pair<int64_t, int64_t> arm_flags_for_test(const std::shared_ptr<HostCall>& call) {
  Flags& f = Flags::get();
  const int s = slot_of(call);
  mark_launched(*call);
  f.arm();
  return {reinterpret_cast<int64_t>(f.ready(s)), reinterpret_cast<int64_t>(f.done(s))};
}

}  // namespace nelssa
