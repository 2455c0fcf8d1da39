// Cluster-contiguous reorganisation of K/V rows and the memory read-bandwidth probe.
#include "common.h"

#include <omp.h>
#include <sched.h>

#include <chrono>

namespace nelssa {

PoolSettings& pool() {
  static PoolSettings p;
  return p;
}

void set_pool(int64_t threads, const std::vector<int64_t>& cores, int64_t spin_us) {
  TORCH_CHECK(threads >= 1, "pool threads must be >= 1");
  TORCH_CHECK(spin_us >= 0, "pool spin_us must be >= 0");
  PoolSettings& p = pool();
  p.threads = static_cast<int>(threads);
  p.cores.assign(cores.begin(), cores.end());
  p.spin_us = spin_us;
  ++p.generation;  // every calling thread's team is rebuilt at its next call (host_team.cpp 1)
}

// dst[h, di[h, i], :] = src[h, si[h, i], :] for every kv head h (rows of D elements, any dtype).
void copy_rows(const at::Tensor& src, const at::Tensor& si, at::Tensor& dst, const at::Tensor& di) {
  TORCH_CHECK(src.dim() == 3 && src.is_contiguous() && src.device().is_cpu(), "src must be contiguous CPU [H, L, D]");
  TORCH_CHECK(dst.dim() == 3 && dst.is_contiguous() && dst.device().is_cpu() && dst.scalar_type() == src.scalar_type() &&
                  dst.size(0) == src.size(0) && dst.size(2) == src.size(2),
              "dst must be contiguous CPU [H, M, D] of src's dtype");
  TORCH_CHECK(si.dim() == 2 && si.scalar_type() == at::kLong && si.is_contiguous() && si.size(0) == src.size(0) &&
                  di.sizes() == si.sizes() && di.scalar_type() == at::kLong && di.is_contiguous(),
              "row indices must be int64 [H, N], equal shapes");
  const int64_t H = src.size(0), L = src.size(1), M = dst.size(1), N = si.size(1);
  const int64_t rb = src.size(2) * src.element_size();
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  const int64_t* sp = si.data_ptr<int64_t>();
  const int64_t* dp = di.data_ptr<int64_t>();
  int bad = 0;
#pragma omp parallel for schedule(static) num_threads(pool().threads) reduction(| : bad)
  for (int64_t i = 0; i < H * N; ++i) {
    const int64_t h = i / N, a = sp[i], z = dp[i];
    if (a < 0 || a >= L || z < 0 || z >= M) { bad = 1; continue; }
    std::memcpy(d + (h * M + z) * rb, s + (h * L + a) * rb, rb);
  }
  TORCH_CHECK(!bad, "copy_rows: row index out of range");
}

// Seconds to read every byte of buf `iters` times with the pool's threads; the checksum keeps the
// reads from being optimised away.
std::tuple<double, double> read_bandwidth(const at::Tensor& buf, int64_t iters) {
  TORCH_CHECK(buf.is_contiguous() && buf.device().is_cpu() && buf.scalar_type() == at::kFloat,
              "buf must be a contiguous CPU float32 tensor");
  const float* p = buf.data_ptr<float>();
  const int64_t n = buf.numel();
  double check = 0.0;
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    double part = 0.0;
#pragma omp parallel for schedule(static) num_threads(pool().threads) reduction(+ : part)
    for (int64_t c = 0; c < n; c += 4096) {
      const int64_t e = std::min<int64_t>(n, c + 4096);
      float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      int64_t i = c;
      for (; i + 64 <= e; i += 64) {
        float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0)
        for (int k = 0; k < 16; ++k) s0 += p[i + k];
#pragma omp simd reduction(+ : s1)
        for (int k = 16; k < 32; ++k) s1 += p[i + k];
#pragma omp simd reduction(+ : s2)
        for (int k = 32; k < 48; ++k) s2 += p[i + k];
#pragma omp simd reduction(+ : s3)
        for (int k = 48; k < 64; ++k) s3 += p[i + k];
        a0 += s0, a1 += s1, a2 += s2, a3 += s3;
      }
      for (; i < e; ++i) a0 += p[i];
      part += static_cast<double>(a0 + a1 + a2 + a3);
    }
    check += part;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {secs, check};
}

// Machine probe (benchmark only): reads nblocks blocks of block_bytes at random 512-byte-aligned
// offsets of buf with the pool's threads, every 64-byte line once -> (seconds, checksum). pf_hint
// -1: plain loads (hardware prefetchers only); 0, 1, 3: software prefetch ~16 KB ahead in the block
// stream, as the kernel does. Says what this machine gives scattered runs of a given length.
std::tuple<double, double> block_read(const at::Tensor& buf, int64_t block_bytes, int64_t nblocks, int64_t seed,
                                      int64_t pf_hint) {
  TORCH_CHECK(buf.is_contiguous() && buf.device().is_cpu(), "buf must be a contiguous CPU tensor");
  const int64_t n = buf.nbytes();
  TORCH_CHECK(block_bytes >= 64 && block_bytes % 64 == 0 && block_bytes <= n && nblocks > 0,
              "block_bytes must be a multiple of 64 within buf, nblocks > 0");
  const char* p = static_cast<const char*>(buf.data_ptr());
  std::vector<int64_t> off(nblocks);
  uint64_t x = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull + 1;
  const int64_t slots = (n - block_bytes) / 512 + 1;
  for (auto& o : off) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    o = static_cast<int64_t>(x % static_cast<uint64_t>(slots)) * 512;
  }
  const int64_t ahead = std::max<int64_t>(1, 16384 / block_bytes);
  uint64_t check = 0;
  double secs = 0.0;
  with_prefetch_hint(pf_hint, [&](auto hint) {
    constexpr int HINT = decltype(hint)::value;
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(static) num_threads(pool().threads) reduction(^ : check)
    for (int64_t i = 0; i < nblocks; ++i) {
      if (i + ahead < nblocks) prefetch_bytes<HINT>(p + off[i + ahead], block_bytes);
      const char* b = p + off[i];
      uint64_t y = 0;
      for (int64_t o = 0; o < block_bytes; o += 64) y ^= *reinterpret_cast<const uint64_t*>(b + o);
      check ^= y;
    }
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  return {secs, static_cast<double>(check & 0xffff)};
}

}  // namespace nelssa
