// Host-tier memory: huge-page ranges for the clustered K/V parts, kept for reuse when freed.
//
// A move writes a request's clustered K/V into new host memory (a part of one layer of the
// Llama-3.1-8B shape, 8,192 tokens: 32 MiB; a 100K prompt: ~13 GB), and the request's end frees it.
// Memory never touched before costs its page faults at first write: the kernel zeroes each page, and
// in a VM the hypervisor may have to back it first. Measured on the 2-vCPU Firecracker box (one
// thread): into fresh memory 11 GB/s when the guest still had the pages, 0.3-0.4 GB/s once the
// hypervisor had taken them back, into touched memory 17-25 GB/s; on the H200 host a move's copy into
// host memory ran at ~6-8 GB/s. So:
//
//   1. Ranges: 2 MiB-aligned multiples of 2 MiB of anonymous private memory, MADV_HUGEPAGE (a cluster
//      gather touches a new page per cluster; huge pages keep those walks out of the TLB). Requests
//      under 2 MiB are ordinary torch allocations.
//   2. A tensor's deleter (any thread, no GIL) returns its range to the free ranges: address-ordered,
//      adjacent ones of one reservation (or of none) merged, the best fit by size served first. Free bytes beyond
//      `keep` are unmapped at once (largest free ranges first; never reserved memory). keep = 0 (the
//      default) unmaps every free as before.
//   3. reserve(bytes): maps that much as one range and touches it page by page with `threads`
//      threads, handing it to the free ranges chunk by chunk as it is touched (a caller may allocate
//      from the touched part while the rest is being touched) -> (address, length), e.g. for the
//      caller to register it with CUDA (hostmem.py). Reserved memory is never unmapped, and a range
//      never spans two reservations (each is a registration of its own). Meant for a background
//      thread at start (the engine loads its weights meanwhile).
//   4. Served from free ranges: a hit; a new mapping: a miss. stats() = (bytes in use, bytes free,
//      bytes reserved, hits, misses).
//   5. copy_bytes: a parallel memcpy for the host side of a staged device-to-host copy.
//   6. host_empty_on(sizes, dtype, node): a range of its own bound (MPOL_PREFERRED) to NUMA node `node`
//      before anything touches it, so its pages come from that node (nelssa-node's devices on a machine
//      with several: node/numa.py); not pooled (a freed range is unmapped: the pool's ranges have no
//      node), counted in stats' bytes in use. node < 0: host_empty. A node the kernel refuses (none such)
//      raises. host_page_node(t): the node of the page holding t's first byte (-1 without NUMA support).
#include "common.h"

#include <omp.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

namespace nelssa {
namespace {

constexpr size_t HUGE_PAGE = 2u << 20;

size_t round_up(size_t b) { return (b + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE; }

// `len` (a multiple of HUGE_PAGE) of anonymous memory starting on a huge page, MADV_HUGEPAGE (1)
char* map_aligned(size_t len) {
  // over-map by one huge page to align the start
  void* raw = mmap(nullptr, len + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "host_empty: mmap of ", len, " bytes failed (host memory exhausted?)");
  const uintptr_t a = (reinterpret_cast<uintptr_t>(raw) + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
  const size_t head = a - reinterpret_cast<uintptr_t>(raw);
  if (head) munmap(raw, head);
  if (HUGE_PAGE - head) munmap(reinterpret_cast<char*>(a) + len, HUGE_PAGE - head);
  madvise(reinterpret_cast<void*>(a), len, MADV_HUGEPAGE);
  return reinterpret_cast<char*>(a);
}

// bytes of a tensor of `sizes` and `dtype`
size_t tensor_bytes(at::IntArrayRef sizes, at::ScalarType dtype, const char* who) {
  int64_t n = 1;
  for (int64_t s : sizes) {
    TORCH_CHECK(s >= 0, who, ": negative size");
    n *= s;
  }
  return static_cast<size_t>(n) * c10::elementSize(dtype);
}

struct Range {
  size_t len;
  int region;  // the reservation it belongs to (3), 0: none
};

class HostPool {
 public:
  // (address, length) of a range for `bytes` (rounded up to huge pages), and its reservation (0: none)
  std::tuple<char*, size_t, int> take(size_t bytes) {
    const size_t len = round_up(bytes);
    {
      std::lock_guard<std::mutex> g(mu_);
      // best fit: the smallest free range that holds len
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->second.len >= len && (best == free_.end() || it->second.len < best->second.len)) best = it;
      if (best != free_.end()) {
        char* a = best->first;
        const Range r = best->second;
        free_.erase(best);
        if (r.len > len) free_.emplace(a + len, Range{r.len - len, r.region});
        free_bytes_ -= len;
        used_ += len;
        ++hits_;
        return {a, len, r.region};
      }
    }
    char* a = map_aligned(len);
    std::lock_guard<std::mutex> g(mu_);
    used_ += len;
    ++misses_;
    return {a, len, 0};
  }

  // a range given back (2); unmaps what is beyond `keep` outside the lock
  void give(char* a, size_t len, int region) {
    std::vector<std::pair<char*, size_t>> drop;
    {
      std::lock_guard<std::mutex> g(mu_);
      used_ -= len;
      free_bytes_ += len;
      auto it = free_.emplace(a, Range{len, region}).first;
      if (it != free_.begin()) {  // merge with the range before (one mapping, or two of one kind, never two reservations)
        auto prev = std::prev(it);
        if (prev->first + prev->second.len == a && prev->second.region == region) {
          prev->second.len += it->second.len;
          free_.erase(it);
          it = prev;
        }
      }
      auto next = std::next(it);
      if (next != free_.end() && it->first + it->second.len == next->first && next->second.region == region) {
        it->second.len += next->second.len;
        free_.erase(next);
      }
      trim_locked(&drop);
    }
    for (auto& d : drop) munmap(d.first, d.second);
  }

  void set_keep(size_t keep) {
    std::vector<std::pair<char*, size_t>> drop;
    {
      std::lock_guard<std::mutex> g(mu_);
      keep_ = keep;
      trim_locked(&drop);
    }
    for (auto& d : drop) munmap(d.first, d.second);
  }

  // 3: map and touch `bytes`, handing out `chunk`-sized pieces as they are touched -> (address, length)
  std::pair<char*, size_t> reserve(size_t bytes, int threads, size_t chunk) {
    const size_t len = round_up(bytes);
    if (len == 0) return {nullptr, 0};
    chunk = std::max(HUGE_PAGE, round_up(chunk));
    char* a = map_aligned(len);
    int region;
    {
      std::lock_guard<std::mutex> g(mu_);
      region = ++regions_;
    }
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    for (size_t off = 0; off < len; off += chunk) {
      const size_t n = std::min(chunk, len - off);
      const int64_t pages = static_cast<int64_t>(n / page);
      char* base = a + off;
#pragma omp parallel for schedule(static) num_threads(std::max(1, threads))
      for (int64_t i = 0; i < pages; ++i) base[i * page] = 0;  // one write faults the page (with THP: its huge page)
      {
        std::lock_guard<std::mutex> g(mu_);
        used_ += n;  // give() counts it back as free
        reserved_ += n;
      }
      give(base, n, region);
    }
    return {a, len};
  }

  std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> stats() {
    std::lock_guard<std::mutex> g(mu_);
    return {static_cast<int64_t>(used_), static_cast<int64_t>(free_bytes_), static_cast<int64_t>(reserved_),
            static_cast<int64_t>(hits_), static_cast<int64_t>(misses_)};
  }

 private:
  // free bytes beyond keep_, largest unreserved ranges first, into `drop` (unmapped by the caller)
  void trim_locked(std::vector<std::pair<char*, size_t>>* drop) {
    while (free_bytes_ - reserved_free_locked() > 0 && free_bytes_ > keep_) {
      auto big = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->second.region == 0 && (big == free_.end() || it->second.len > big->second.len)) big = it;
      if (big == free_.end()) return;
      const size_t excess = free_bytes_ - keep_;
      char* a = big->first;
      const size_t len = big->second.len;
      if (len <= excess) {
        free_.erase(big);
        drop->emplace_back(a, len);
        free_bytes_ -= len;
      } else {  // unmap the range's tail, keep its head
        const size_t cut = excess / HUGE_PAGE * HUGE_PAGE;
        if (cut == 0) return;
        big->second.len -= cut;
        drop->emplace_back(a + big->second.len, cut);
        free_bytes_ -= cut;
      }
    }
  }

  size_t reserved_free_locked() const {
    size_t n = 0;
    for (const auto& [a, r] : free_)
      if (r.region != 0) n += r.len;
    return n;
  }

  std::mutex mu_;
  std::map<char*, Range> free_;
  size_t free_bytes_ = 0, used_ = 0, reserved_ = 0, keep_ = 0, hits_ = 0, misses_ = 0;
  int regions_ = 0;
};

HostPool& host_pool() {
  static HostPool* p = new HostPool();  // never destroyed: tensors may be freed during interpreter exit
  return *p;
}

std::atomic<size_t> node_bytes{0};  // 6: bytes of node-bound ranges in use
constexpr int MPOL_PREFERRED_ = 1, MPOL_F_NODE_ = 1, MPOL_F_ADDR_ = 2, MAX_NODES = 1024;

}  // namespace

// Host-tier buffer (1): uninitialised, from the pool's free ranges or a new huge-page mapping.
at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  const size_t bytes = tensor_bytes(sizes, dtype, "host_empty");
  if (bytes < HUGE_PAGE) return at::empty(sizes, at::TensorOptions().dtype(dtype));
  auto [a, len, region] = host_pool().take(bytes);
  return at::from_blob(
      a, sizes, [len = len, region = region](void* ptr) { host_pool().give(static_cast<char*>(ptr), len, region); },
      at::TensorOptions().dtype(dtype));
}

// 6: a NUMA-node-bound range of its own
at::Tensor host_empty_on(at::IntArrayRef sizes, at::ScalarType dtype, int64_t node) {
  if (node < 0) return host_empty(sizes, dtype);
  TORCH_CHECK(node < MAX_NODES, "host_empty_on: NUMA node ", node, " >= ", MAX_NODES);
  const size_t len = round_up(std::max<size_t>(tensor_bytes(sizes, dtype, "host_empty_on"), 1));
  char* a = map_aligned(len);  // nothing touched yet: the binding decides where its pages come from
  unsigned long mask[MAX_NODES / (8 * sizeof(unsigned long))] = {};
  mask[node / (8 * sizeof(unsigned long))] |= 1UL << (node % (8 * sizeof(unsigned long)));
  // the kernel reads maxnode - 1 bits of the mask
  if (syscall(SYS_mbind, a, len, MPOL_PREFERRED_, mask, MAX_NODES + 1, 0) != 0) {
    const int err = errno;
    munmap(a, len);
    TORCH_CHECK(false, "host_empty_on: binding ", len, " bytes to NUMA node ", node, " failed: ", std::strerror(err));
  }
  node_bytes += len;
  return at::from_blob(
      a, sizes, [len](void* ptr) { munmap(ptr, len); node_bytes -= len; }, at::TensorOptions().dtype(dtype));
}

int64_t host_page_node(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.numel() > 0, "host_page_node: a non-empty CPU tensor");
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0, t.data_ptr(), MPOL_F_NODE_ | MPOL_F_ADDR_) != 0) return -1;
  return node;
}

void host_pool_keep(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "host pool: keep must be >= 0");
  host_pool().set_keep(static_cast<size_t>(bytes));
}

std::tuple<int64_t, int64_t> host_pool_reserve(int64_t bytes, int64_t threads, int64_t chunk) {
  TORCH_CHECK(bytes >= 0 && threads >= 1 && chunk >= 1, "host pool: reserve needs bytes >= 0, threads >= 1, chunk >= 1");
  auto [a, len] = host_pool().reserve(static_cast<size_t>(bytes), static_cast<int>(threads), static_cast<size_t>(chunk));
  return {static_cast<int64_t>(reinterpret_cast<uintptr_t>(a)), static_cast<int64_t>(len)};
}

std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> host_pool_stats() {
  auto s = host_pool().stats();
  std::get<0>(s) += static_cast<int64_t>(node_bytes.load());  // 6
  return s;
}

// 5. dst = src, bytewise, split over `threads` threads in contiguous slices (1 MiB at least): a staged
// device-to-host copy's host side, whose single-threaded copy into fresh pages ran at a few GB/s.
void copy_bytes(at::Tensor& dst, const at::Tensor& src, int64_t threads) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && dst.is_contiguous() && src.is_contiguous(),
              "copy_bytes: contiguous CPU tensors");
  TORCH_CHECK(dst.nbytes() == src.nbytes(), "copy_bytes: ", src.nbytes(), " bytes into ", dst.nbytes());
  TORCH_CHECK(threads >= 1, "copy_bytes: threads >= 1");
  const int64_t n = static_cast<int64_t>(src.nbytes());
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  const int64_t t = std::max<int64_t>(1, std::min<int64_t>(threads, n >> 20));
  const int64_t per = (n + t - 1) / t;
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(t))
  for (int64_t i = 0; i < t; ++i) {
    const int64_t a = i * per, b = std::min(n, a + per);
    if (a < b) std::memcpy(d + a, s + a, static_cast<size_t>(b - a));
  }
}

}  // namespace nelssa
