// nelssa-node's emulated PNM devices as native worker threads (nelssa/node/storage.py, "Devices").
//
// The contract:
//   1. DeviceGroup(cores): one worker thread per device, pinned to that device's cores (an empty list:
//      not pinned). A call's thread team (host_team.cpp) is started from the worker, so it inherits the mask.
//   2. run(calls): calls[i] (a prepared HostCall, host_call.cpp, or None) goes to device i's queue;
//      run returns once every call given has returned, without the GIL: no Python thread hands a call
//      over or back (the node's Python device threads cost ~100-200 us per device and job in GIL
//      hand-offs, bench_node.py on the H200 host). Jobs of several clients may run concurrently: each
//      device takes its calls in order of arrival.
//   3. A call never throws (HostCall::run keeps a failure as its state and error, writing NaN); run
//      throws only on misuse (more calls than devices, a call not in state "prepared", a closed group).
//      The caller reads each call's state, error and seconds afterwards.
//   4. close() (also the destructor) lets the workers finish their queues and joins them.
//   6. submit(calls, done): as run, but it returns once the calls are queued; ``done`` runs on the worker
//      that finishes the last of them (at once on the caller's thread when there is none). So a caller
//      that answers a job (node_plane.cpp's responder) has it answered by that worker, without a
//      wake-up of its own between the kernels' end and the answer (H100, hol run 65: "dispatch", the
//      node's time beyond its kernels, was 54 us of a call's 142 outside them). ``done`` must not throw
//      (an exception from it is dropped).
//   5. Hand-offs spin before they sleep (a condition variable's wake-up costs ~30-40 us on a VM, twice
//      per call; decode jobs come every ~1 ms): an idle worker pinned to cores of its own polls its
//      queue for ``spin_us`` after its last call (an unpinned one shares the machine's cores: it
//      sleeps at once; spinning there halved a vLLM engine's speed beside the node on 2 cores), and
//      run() polls its calls' completion for at most ``kCallerSpinUs`` (an empty job's time) before it
//      waits on a condition variable: the caller is not a device and must not hold a core through a
//      kernel call. spin_us 0: always sleep.
#include "common.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace nelssa {

namespace {

constexpr int64_t kCallerSpinUs = 50;

struct Batch {
  std::mutex m;
  std::condition_variable cv;
  std::atomic<int> left{0};
  std::function<void()> done;  // submit (6): run by the worker that finishes the last call; else cv
};

struct Worker {
  std::vector<int> cores;
  int64_t spin_us = 0;
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::pair<std::shared_ptr<HostCall>, std::shared_ptr<Batch>>> queue;
  std::atomic<int64_t> queued{0};  // queue.size(), readable without the mutex (5)
  bool stop = false;
  std::thread thread;

  void loop() {
    if (!cores.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int c : cores) CPU_SET(c, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);  // best effort, as os.sched_setaffinity
    }
    for (;;) {
      spin_until(spin_us, [&] { return queued.load(std::memory_order_acquire) > 0; });
      std::pair<std::shared_ptr<HostCall>, std::shared_ptr<Batch>> item;
      {
        std::unique_lock<std::mutex> lk(m);
        cv.wait(lk, [&] { return stop || !queue.empty(); });
        if (queue.empty()) return;  // stop, and nothing left
        item = std::move(queue.front());
        queue.pop_front();
        queued.fetch_sub(1, std::memory_order_relaxed);
      }
      item.first->run();
      Batch& b = *item.second;
      if (b.left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        if (b.done) {  // (6)
          try {
            b.done();
          } catch (...) {
          }
        } else {
          std::lock_guard<std::mutex> lk(b.m);  // a caller past its spin waits on cv
          b.cv.notify_all();
        }
      }
    }
  }
};

}  // namespace

struct DeviceGroup::Impl {
  std::vector<std::unique_ptr<Worker>> workers;
  int64_t spin_us = 0;
  bool closed = false;
};

DeviceGroup::DeviceGroup(const std::vector<std::vector<int64_t>>& cores, int64_t spin_us)
    : impl(std::make_unique<Impl>()) {
  TORCH_CHECK(!cores.empty(), "a device group needs at least one device");
  TORCH_CHECK(spin_us >= 0, "spin_us must be >= 0");
  impl->spin_us = spin_us;
  for (const auto& c : cores) {
    auto w = std::make_unique<Worker>();
    w->spin_us = c.empty() ? 0 : spin_us;
    for (int64_t x : c) {
      TORCH_CHECK(x >= 0 && x < CPU_SETSIZE, "core ", x, " outside [0, ", CPU_SETSIZE, ")");
      w->cores.push_back(static_cast<int>(x));
    }
    impl->workers.push_back(std::move(w));
  }
  for (auto& w : impl->workers) {
    Worker* p = w.get();
    p->thread = std::thread([p] { p->loop(); });
  }
}

DeviceGroup::~DeviceGroup() { close(); }

int64_t DeviceGroup::size() const { return static_cast<int64_t>(impl->workers.size()); }

void DeviceGroup::close() {
  if (impl->closed) return;
  impl->closed = true;
  for (auto& w : impl->workers) {
    std::lock_guard<std::mutex> lk(w->m);
    w->stop = true;
    w->cv.notify_all();
  }
  for (auto& w : impl->workers)
    if (w->thread.joinable()) w->thread.join();
}

namespace {
// the calls taken (state prepared -> running) as one batch, or a misuse thrown (3)
std::shared_ptr<Batch> take(const std::vector<std::shared_ptr<HostCall>>& calls, size_t devices, bool closed) {
  TORCH_CHECK(!closed, "the device group is closed");
  TORCH_CHECK(calls.size() <= devices, calls.size(), " calls for ", devices, " devices");
  auto batch = std::make_shared<Batch>();
  for (const auto& c : calls) {
    if (!c) continue;
    int expected = 0;  // prepared
    TORCH_CHECK(c->state.compare_exchange_strong(expected, 1), "a host call runs once");
    ++batch->left;
  }
  return batch;
}
}  // namespace

void DeviceGroup::enqueue(const std::vector<std::shared_ptr<HostCall>>& calls, const std::shared_ptr<void>& b) {
  auto batch = std::static_pointer_cast<Batch>(b);
  for (size_t i = 0; i < calls.size(); ++i) {
    if (!calls[i]) continue;
    Worker& w = *impl->workers[i];
    std::lock_guard<std::mutex> lk(w.m);
    w.queue.emplace_back(calls[i], batch);
    w.queued.fetch_add(1, std::memory_order_release);
    w.cv.notify_one();
  }
}

void DeviceGroup::submit(const std::vector<std::shared_ptr<HostCall>>& calls, std::function<void()> done) {
  auto batch = take(calls, impl->workers.size(), impl->closed);
  if (batch->left.load() == 0) return done();
  batch->done = std::move(done);  // before any worker can finish the batch
  enqueue(calls, batch);
}

void DeviceGroup::run(const std::vector<std::shared_ptr<HostCall>>& calls) {
  auto batch = take(calls, impl->workers.size(), impl->closed);
  if (batch->left.load() == 0) return;
  enqueue(calls, batch);
  auto done = [&] { return batch->left.load(std::memory_order_acquire) == 0; };
  if (spin_until(std::min(impl->spin_us, kCallerSpinUs), done)) return;
  std::unique_lock<std::mutex> lk(batch->m);
  batch->cv.wait(lk, done);
}

}  // namespace nelssa
