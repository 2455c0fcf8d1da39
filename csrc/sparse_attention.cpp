// Fused sparse attention over selected clusters of cluster-contiguous host KV.
//
// One pass over the selected K/V rows: gather (by pointer, no copy) + QK + online softmax + AV.
// Parallel over work items (request, kv_head, cluster chunk of <= work_tokens rows), each producing
// (max, sum, acc) for the G query heads of its GQA group; a final per-head LSE combine. The calling
// thread's team runs it (host_team.cpp).
#include "common.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <type_traits>

namespace nelssa {
namespace {

constexpr int BLK = 16;  // rows per softmax block
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// Rows [0, n) of one selected cluster (or a piece of one) for one kv head: K rows at k, V rows at v.
struct Span {
  const char* k;
  const char* v;
  int64_t n;
};

struct Work {
  int32_t bh;      // request * Hkv + kv_head
  int32_t s0, s1;  // span range within spans[bh]
};

template <int DC>
inline float dot(const float* __restrict a, const float* __restrict b, int D) {
  const int n = DC > 0 ? DC : D;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

template <int DC>
inline void axpy(float a, const float* __restrict x, float* __restrict y, int D) {
  const int n = DC > 0 ? DC : D;
#pragma omp simd
  for (int d = 0; d < n; ++d) y[d] += a * x[d];
}

// Software prefetch of the rows ahead of the one being computed (one row per row computed: bursts
// stall). HINT (compile time, it sits in the inner loops): 0 = NTA, 1 = T2 (L2), 3 = T0 (L1), -1 =
// none (hardware prefetchers only); the best choice depends on the CPU (config prefetch, measured
// by the benchmark's --sweep-prefetch).
template <int HINT>
inline void prefetch_row(const void* k, const void* v, int64_t bytes) {
  prefetch_bytes<HINT>(k, bytes);
  prefetch_bytes<HINT>(v, bytes);
}

// Prefetch cursor over the lines of the work item's records ([K row, V row], contiguous).
// The fused pass calls until(x) at many points of a block (QK rows, softmax heads, AV pairs) with x
// proportional to its progress, so prefetches go out at the rate lines are consumed. Issuing them
// in bursts once per row (only in the QK loop) let the memory pipe drain during softmax and AV:
// memory time and compute time then add up instead of overlapping.
template <int HINT, typename T>
struct PfCursor {
  const std::vector<const T*>& kr;
  int64_t lines, total, next = 0;  // lines per record; lines in all; next line to prefetch
  int64_t row = 0, l = 0;          // next = row * lines + l
  PfCursor(const std::vector<const T*>& k, int64_t row_bytes)
      : kr(k), lines((2 * row_bytes + 63) / 64), total(static_cast<int64_t>(k.size()) * lines) {}
  inline void until(int64_t x) {  // prefetch lines [next, x)
    if constexpr (HINT >= 0) {
      x = std::min(x, total);
      for (; next < x; ++next) {
        __builtin_prefetch(reinterpret_cast<const char*>(kr[row]) + 64 * l, 0, HINT);
        if (++l == lines) l = 0, ++row;
      }
    }
  }
};

// The work item's rows, across its spans, as K and V row pointers (records of [K row, V row]).
template <typename T>
inline void collect_rows(const std::vector<Span>& spans, const Work& w, int D, std::vector<const T*>& kr,
                         std::vector<const T*>& vr) {
  kr.clear(), vr.clear();
  for (int si = w.s0; si < w.s1; ++si) {
    const T* K = reinterpret_cast<const T*>(spans[si].k);
    const T* V = reinterpret_cast<const T*>(spans[si].v);
    for (int64_t r = 0; r < spans[si].n; ++r) kr.push_back(K + 2 * r * D), vr.push_back(V + 2 * r * D);
  }
}

struct Ctx {
  int B, Hq, Hkv, G, D;
  const float* q = nullptr;    // [B, Hq, D], pre-scaled to log2 units (paths other than bf16)
  const uint16_t* qb = nullptr;  // [B, Hq, D] bf16, unscaled (bf16 fast path only)
  float qscale = 1.f;          // scale * log2(e), for the bf16 path
  bool touch_only = false;     // memory-only probe (touch_work), no attention
  int64_t pf_rows = 16;        // rows prefetched ahead
};

// Portable path (any D): attention of one work item; writes m[G], l[G] (log2 units), acc[G*D].
template <typename T, int DC, int HINT>
void run_work(const Ctx& c, const std::vector<const T*>& kr, const std::vector<const T*>& vr, const Work& w,
              float* m, float* l, float* acc, float* kf, float* vf, float* s, float* p) {
  const int G = c.G, D = DC > 0 ? DC : c.D;
  const int b = w.bh / c.Hkv, h = w.bh % c.Hkv;
  const float* qg = c.q + (static_cast<int64_t>(b) * c.Hq + static_cast<int64_t>(h) * G) * D;
  for (int g = 0; g < G; ++g) m[g] = NEG_INF, l[g] = 0.f;
  std::fill(acc, acc + static_cast<int64_t>(G) * D, 0.f);
  const int64_t N = static_cast<int64_t>(kr.size());
  for (int64_t t0 = 0; t0 < N; t0 += BLK) {
    const int nb = static_cast<int>(std::min<int64_t>(BLK, N - t0));
    for (int64_t r = t0 + c.pf_rows; r < std::min(N, t0 + c.pf_rows + BLK); ++r)
      prefetch_row<HINT>(kr[r], vr[r], D * sizeof(T));
    for (int t = 0; t < nb; ++t) {
      to_f32(kr[t0 + t], kf, D);
      for (int g = 0; g < G; ++g) s[g * BLK + t] = dot<DC>(qg + g * D, kf, D);
    }
    for (int g = 0; g < G; ++g) {
      float mb = NEG_INF;
      for (int t = 0; t < nb; ++t) mb = std::max(mb, s[g * BLK + t]);
      if (mb > m[g]) {
        const float alpha = std::exp2(m[g] - mb);  // 0 when m = -inf
        if (l[g] != 0.f) {
          l[g] *= alpha;
          float* a = acc + g * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) a[d] *= alpha;
        }
        m[g] = mb;
      }
      exp2_shift16(s + g * BLK, m[g], p + g * BLK, nb);
      float sum = 0.f;
      for (int t = 0; t < nb; ++t) sum += p[g * BLK + t];
      l[g] += sum;
    }
    for (int t = 0; t < nb; ++t) {
      to_f32(vr[t0 + t], vf, D);
      for (int g = 0; g < G; ++g) axpy<DC>(p[g * BLK + t], vf, acc + g * D, D);
    }
  }
}

#if defined(__AVX512F__)
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
template <>
inline __m512 load16<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}

// v[0..15] -> one vector whose lane t is the horizontal sum of v[t] (45 shuffles/adds in all).
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u01, u23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// AVX-512 path for D = 16 * NV. The work item's rows (across clusters) are listed as pointers and
// processed in full blocks of 16: scores of 16 rows per query head in one vector (transposed
// reduction), vector exp2, AV with the accumulators in registers; rows PF ahead are prefetched.
template <typename T, int NV, int HINT>
void run_work_avx512(const Ctx& c, const std::vector<const T*>& kr, const std::vector<const T*>& vr,
                     const Work& w, float* m, float* l, float* acc, float* scratch) {
  constexpr int D = NV * 16;
  constexpr int HALF = NV > 4 ? 4 : NV;  // accumulator vectors per pass of the AV loop
  const int G = c.G;
  const int b = w.bh / c.Hkv, h = w.bh % c.Hkv;
  const float* qg = c.q + (static_cast<int64_t>(b) * c.Hq + static_cast<int64_t>(h) * G) * D;
  __m512* part = reinterpret_cast<__m512*>(scratch);  // [G][16] partial-sum vectors
  float* p = scratch + G * 16 * 16;                      // [G][16] probabilities
  for (int g = 0; g < G; ++g) m[g] = NEG_INF, l[g] = 0.f;
  std::fill(acc, acc + static_cast<int64_t>(G) * D, 0.f);
  const int64_t N = static_cast<int64_t>(kr.size());
  PfCursor<HINT, T> pf(kr, D * sizeof(T));  // spread over QK / softmax / AV as in the bf16 path
  const int64_t LR = pf.lines, ahead = c.pf_rows * LR;
  pf.until(ahead);

  for (int64_t t0 = 0; t0 < N; t0 += BLK) {
    const int nb = static_cast<int>(std::min<int64_t>(BLK, N - t0));
    const int64_t base = t0 * LR + ahead, span = nb * LR;
    // QK: partial-sum vector per (head, row)
    for (int t = 0; t < nb; ++t) {
      pf.until(base + t * (LR / 2));  // = span * t / (2 * nb)
      const T* kp = kr[t0 + t];
      __m512 kv[NV];
      for (int j = 0; j < NV; ++j) kv[j] = load16<T>(kp + 16 * j);
      for (int g = 0; g < G; ++g) {
        const float* qq = qg + g * D;
        __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(qq), kv[0]);
        __m512 a1 = NV > 1 ? _mm512_mul_ps(_mm512_loadu_ps(qq + 16), kv[1]) : _mm512_setzero_ps();
        for (int j = 2; j < NV; j += 2) {
          a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qq + 16 * j), kv[j], a0);
          if (j + 1 < NV) a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qq + 16 * (j + 1)), kv[j + 1], a1);
        }
        part[g * 16 + t] = _mm512_add_ps(a0, a1);
      }
    }
    const __mmask16 live = static_cast<__mmask16>((1u << nb) - 1u);
    for (int g = 0; g < G; ++g) {
      pf.until(base + span / 2 + span * g / (8 * G));
      for (int t = nb; t < 16; ++t) part[g * 16 + t] = _mm512_setzero_ps();
      const __m512 s = _mm512_mask_blend_ps(live, _mm512_set1_ps(NEG_INF), reduce16(part + g * 16));
      const float mb = _mm512_reduce_max_ps(s);
      if (mb > m[g]) {
        const float alpha = std::exp2(m[g] - mb);
        if (l[g] != 0.f) {
          l[g] *= alpha;
          const __m512 al = _mm512_set1_ps(alpha);
          for (int j = 0; j < NV; ++j)
            _mm512_storeu_ps(acc + g * D + 16 * j, _mm512_mul_ps(al, _mm512_loadu_ps(acc + g * D + 16 * j)));
        }
        m[g] = mb;
      }
      const __m512 e = _mm512_maskz_mov_ps(live, exp2_ps(_mm512_sub_ps(s, _mm512_set1_ps(m[g]))));
      l[g] += _mm512_reduce_add_ps(e);
      _mm512_storeu_ps(p + g * 16, e);
    }
    // AV: accumulators of HALF vectors x up to 4 heads stay in registers across the block's rows
    const int64_t passes = static_cast<int64_t>((NV + HALF - 1) / HALF) * ((G + 3) / 4);
    const int64_t av0 = base + 5 * span / 8;  // AV: the last 3/8 of the block's lines
    const float avs = 3.f * static_cast<float>(span) / static_cast<float>(8 * passes * nb);  // no division per row
    int64_t pass = 0;
    for (int j0 = 0; j0 < NV; j0 += HALF) {
      for (int g0 = 0; g0 < G; g0 += 4, ++pass) {
        const int gn = std::min(4, G - g0);
        __m512 a[4][HALF];
        for (int g = 0; g < gn; ++g)
          for (int j = 0; j < HALF; ++j) a[g][j] = _mm512_loadu_ps(acc + (g0 + g) * D + 16 * (j0 + j));
        for (int t = 0; t < nb; ++t) {
          pf.until(av0 + static_cast<int64_t>(avs * static_cast<float>(pass * nb + t)));
          const T* vp = vr[t0 + t];
          __m512 vv[HALF];
          for (int j = 0; j < HALF; ++j) vv[j] = load16<T>(vp + 16 * (j0 + j));
          for (int g = 0; g < gn; ++g) {
            const __m512 pb = _mm512_set1_ps(p[(g0 + g) * 16 + t]);
            for (int j = 0; j < HALF; ++j) a[g][j] = _mm512_fmadd_ps(pb, vv[j], a[g][j]);
          }
        }
        for (int g = 0; g < gn; ++g)
          for (int j = 0; j < HALF; ++j) _mm512_storeu_ps(acc + (g0 + g) * D + 16 * (j0 + j), a[g][j]);
      }
    }
  }
}
#endif

#if defined(__AVX512BF16__)
// bf16 KV fast path (AVX512-BF16), D = 32 * NC. QK with vdpbf16ps on the stored rows (no
// conversion; q is bf16-exact). AV with vdpbf16ps on row pairs interleaved by vpunpck{l,h}wd and
// the probabilities rounded to bf16, as FlashAttention does for its PV product; accumulation and
// the softmax statistics stay fp32 (l sums the rounded probabilities, so weights sum to 1). The
// accumulators hold a fixed lane permutation of D, undone once at the end of the work item.
template <int NC, int GC, int HINT>
void run_work_bf16(const Ctx& c, const std::vector<const at::BFloat16*>& kr,
                   const std::vector<const at::BFloat16*>& vr, const Work& w, float* m, float* l, float* acc,
                   float* scratch) {
  constexpr int D = NC * 32;
  constexpr int GB = 16 / (2 * NC) > 0 ? 16 / (2 * NC) : 1;  // heads per AV pass (accumulators in registers)
  const int G = GC > 0 ? GC : c.G;  // GQA group size (compile-time for the common ones: loops unroll)
  const int b = w.bh / c.Hkv, h = w.bh % c.Hkv;
  const uint16_t* qg = c.qb + (static_cast<int64_t>(b) * c.Hq + static_cast<int64_t>(h) * G) * D;
  __m512* part = reinterpret_cast<__m512*>(scratch);          // [G][16] partial sums
  uint32_t* pp = reinterpret_cast<uint32_t*>(scratch + G * 16 * 16);  // [G][8] bf16 probability pairs
  __m512i qv[8][NC];
  const int gq = std::min(G, 8);
  for (int g = 0; g < gq; ++g)
    for (int j = 0; j < NC; ++j) qv[g][j] = _mm512_loadu_si512(qg + g * D + 32 * j);
  for (int g = 0; g < G; ++g) m[g] = NEG_INF, l[g] = 0.f;
  std::fill(acc, acc + static_cast<int64_t>(G) * D, 0.f);
  const __m512 sc = _mm512_set1_ps(c.qscale);
  const int64_t N = static_cast<int64_t>(kr.size());
  PfCursor<HINT, at::BFloat16> pf(kr, 2 * D);
  const int64_t LR = pf.lines;  // prefetch lines per row
  const int64_t ahead = c.pf_rows * LR;
  pf.until(ahead);

  for (int64_t t0 = 0; t0 < N; t0 += BLK) {
    const int nb = static_cast<int>(std::min<int64_t>(BLK, N - t0));
    // progress through the block, in lines: QK covers the first half, softmax and AV the second
    const int64_t base = t0 * LR + ahead, span = nb * LR;
    for (int t = 0; t < nb; ++t) {
      pf.until(base + t * (LR / 2));  // = span * t / (2 * nb)
      const at::BFloat16* kp = kr[t0 + t];
      __m512i kv[NC];
      for (int j = 0; j < NC; ++j) kv[j] = _mm512_loadu_si512(kp + 32 * j);
      for (int g = 0; g < G; ++g) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int j = 0; j < NC; ++j) {
          const __m512i qj = g < 8 ? qv[g][j] : _mm512_loadu_si512(qg + g * D + 32 * j);
          if (j % 2 == 0) a0 = _mm512_dpbf16_ps(a0, (__m512bh)qj, (__m512bh)kv[j]);
          else a1 = _mm512_dpbf16_ps(a1, (__m512bh)qj, (__m512bh)kv[j]);
        }
        part[g * 16 + t] = _mm512_add_ps(a0, a1);
      }
    }
    const __mmask16 live = static_cast<__mmask16>((1u << nb) - 1u);
    for (int g = 0; g < G; ++g) {
      pf.until(base + span / 2 + span * g / (8 * G));  // softmax: 1/8 of the block's lines
      for (int t = nb; t < 16; ++t) part[g * 16 + t] = _mm512_setzero_ps();
      const __m512 s =
          _mm512_mask_blend_ps(live, _mm512_set1_ps(NEG_INF), _mm512_mul_ps(sc, reduce16(part + g * 16)));
      const float mb = _mm512_reduce_max_ps(s);
      if (mb > m[g]) {
        const float alpha = std::exp2(m[g] - mb);
        if (l[g] != 0.f) {
          l[g] *= alpha;
          const __m512 al = _mm512_set1_ps(alpha);
          for (int j = 0; j < 2 * NC; ++j)
            _mm512_storeu_ps(acc + g * D + 16 * j, _mm512_mul_ps(al, _mm512_loadu_ps(acc + g * D + 16 * j)));
        }
        m[g] = mb;
      }
      const __m512 e = _mm512_maskz_mov_ps(live, exp2_ps(_mm512_sub_ps(s, _mm512_set1_ps(m[g]))));
      const __m256bh eb = _mm512_cvtneps_pbh(e);
      l[g] += _mm512_reduce_add_ps(_mm512_cvtpbh_ps(eb));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pp + g * 8), (__m256i)eb);
    }
    const int npair = (nb + 1) / 2;
    const int64_t steps = static_cast<int64_t>((G + GB - 1) / GB) * npair;
    const int64_t av0 = base + 5 * span / 8;  // AV: the last 3/8 of the block's lines
    const float avs = 3.f * static_cast<float>(span) / static_cast<float>(8 * steps);  // no division per pair
    for (int g0 = 0; g0 < G; g0 += GB) {
      const int gn = std::min(GB, G - g0);
      __m512 a[GB][2 * NC];
      for (int g = 0; g < gn; ++g)
        for (int j = 0; j < 2 * NC; ++j) a[g][j] = _mm512_loadu_ps(acc + (g0 + g) * D + 16 * j);
      for (int k = 0; k < npair; ++k) {
        pf.until(av0 + static_cast<int64_t>(avs * static_cast<float>((g0 / GB) * npair + k)));
        const at::BFloat16* ra = vr[t0 + 2 * k];
        const at::BFloat16* rb = 2 * k + 1 < nb ? vr[t0 + 2 * k + 1] : ra;  // its probability is 0
        __m512i lo[NC], hi[NC];
        for (int j = 0; j < NC; ++j) {
          const __m512i x = _mm512_loadu_si512(ra + 32 * j), y = _mm512_loadu_si512(rb + 32 * j);
          lo[j] = _mm512_unpacklo_epi16(x, y);
          hi[j] = _mm512_unpackhi_epi16(x, y);
        }
        for (int g = 0; g < gn; ++g) {
          const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[(g0 + g) * 8 + k]));
          for (int j = 0; j < NC; ++j) {
            a[g][2 * j] = _mm512_dpbf16_ps(a[g][2 * j], (__m512bh)lo[j], pb);
            a[g][2 * j + 1] = _mm512_dpbf16_ps(a[g][2 * j + 1], (__m512bh)hi[j], pb);
          }
        }
      }
      for (int g = 0; g < gn; ++g)
        for (int j = 0; j < 2 * NC; ++j) _mm512_storeu_ps(acc + (g0 + g) * D + 16 * j, a[g][j]);
    }
  }
  // undo the lane permutation: acc[16*(2j+u) + 4k + r] holds element 32j + 8k + 4u + r
  float tmp[D];
  for (int g = 0; g < G; ++g) {
    float* a = acc + g * D;
    for (int j = 0; j < NC; ++j)
      for (int u = 0; u < 2; ++u)
        for (int k = 0; k < 4; ++k)
          for (int r = 0; r < 4; ++r) tmp[32 * j + 8 * k + 4 * u + r] = a[16 * (2 * j + u) + 4 * k + r];
    std::memcpy(a, tmp, sizeof(tmp));
  }
}
#endif

// Memory-only probe: reads every cache line of the work item's K and V rows in the kernel's order,
// with the same prefetching, and no arithmetic. Its GB/s is the ceiling the fused pass can reach
// on this machine for this access pattern (benchmark only).
template <typename T, int HINT>
void touch_work(const Ctx& c, const std::vector<const T*>& kr, const std::vector<const T*>& vr, int D, float* m) {
  const int64_t bytes = static_cast<int64_t>(D) * sizeof(T);
  const int64_t N = static_cast<int64_t>(kr.size()), PF = c.pf_rows;
  for (int64_t r = 0; r < std::min(N, PF); ++r) prefetch_row<HINT>(kr[r], vr[r], bytes);
  uint64_t x = 0;
  for (int64_t r = 0; r < N; ++r) {
    if (r + PF < N) prefetch_row<HINT>(kr[r + PF], vr[r + PF], bytes);
    for (int64_t o = 0; o < bytes; o += 64)
      x ^= *reinterpret_cast<const uint64_t*>(reinterpret_cast<const char*>(kr[r]) + o) ^
           *reinterpret_cast<const uint64_t*>(reinterpret_cast<const char*>(vr[r]) + o);
  }
  m[0] = static_cast<float>(x & 1);
}

// One work item: rows collected into the calling pool thread's buffers (reused across calls), then
// the path for the dtype / D / CPU. Chosen once per call (ItemFn) outside the parallel region.
using ItemFn = void (*)(const Ctx&, const std::vector<Span>&, const Work&, float*, float*, float*);

template <typename T, int DC, int HINT>
void run_item(const Ctx& c, const std::vector<Span>& spans, const Work& w, float* wm, float* wl, float* wa) {
  thread_local std::vector<const T*> kr, vr;
  thread_local std::vector<float> kf, vf, s, p;
  const int G = c.G, D = c.D;
  collect_rows<T>(spans, w, D, kr, vr);
  if (c.touch_only) return touch_work<T, HINT>(c, kr, vr, D, wm);
#if defined(__AVX512F__)
  thread_local std::vector<__m512> scratch;  // [G][16] partial sums + [G][16] floats of p
  if (scratch.size() < static_cast<size_t>(G * 17 + 1)) scratch.resize(G * 17 + 1);
  float* sc = reinterpret_cast<float*>(scratch.data());
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16> && DC > 0 && DC % 32 == 0) {
    if (c.qb != nullptr) {
      switch (G) {
        case 1: return run_work_bf16<DC / 32, 1, HINT>(c, kr, vr, w, wm, wl, wa, sc);
        case 2: return run_work_bf16<DC / 32, 2, HINT>(c, kr, vr, w, wm, wl, wa, sc);
        case 3: return run_work_bf16<DC / 32, 3, HINT>(c, kr, vr, w, wm, wl, wa, sc);
        case 4: return run_work_bf16<DC / 32, 4, HINT>(c, kr, vr, w, wm, wl, wa, sc);
        case 8: return run_work_bf16<DC / 32, 8, HINT>(c, kr, vr, w, wm, wl, wa, sc);
        default: return run_work_bf16<DC / 32, 0, HINT>(c, kr, vr, w, wm, wl, wa, sc);
      }
    }
  }
#endif
#if defined(__AVX512F__)
  if constexpr (DC > 0 && DC % 16 == 0) return run_work_avx512<T, DC / 16, HINT>(c, kr, vr, w, wm, wl, wa, sc);
#endif
  if (kf.size() < static_cast<size_t>(D)) kf.resize(D), vf.resize(D);
  if (s.size() < static_cast<size_t>(G * BLK)) s.resize(G * BLK), p.resize(G * BLK);
  run_work<T, DC, HINT>(c, kr, vr, w, wm, wl, wa, kf.data(), vf.data(), s.data(), p.data());
}

thread_local KernelSplit tls_split;  // the calling thread's last call, by part (common.h)

inline double secs(int64_t ns) { return static_cast<double>(ns) * 1e-9; }

// Grow-only buffer (no value-initialisation on reuse): per-call scratch that would otherwise be
// allocated, zeroed and page-faulted on every call.
template <typename T>
inline T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// q preparation: plain integer / float loops that vectorise everywhere (a fused loop with float bit
// casts ran at ~2 ns per element on the Intel host: 130 us per call at batch 16).
// Any NaN/Inf among n values of the given bit width (exponent all ones).
template <typename U>
inline bool any_nonfinite(const U* u, int64_t n, U exp_mask) {
  U bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<U>((u[i] & exp_mask) == exp_mask);
  return bad != 0;
}

// fp32 q: qb = upper 16 bits; returns whether every value is exactly bf16 (lower 16 bits zero).
inline bool split_bf16(const uint32_t* u, int64_t n, uint16_t* qb) {
  uint32_t low = 0;
  for (int64_t i = 0; i < n; ++i) low |= u[i] & 0xffffu, qb[i] = static_cast<uint16_t>(u[i] >> 16);
  return low == 0;
}

template <typename T>
inline void scale_q(const T* qp, int64_t n, float qsc, float* qs) {
  for (int64_t i = 0; i < n; ++i) qs[i] = static_cast<float>(qp[i]) * qsc;
}

// Per calling thread scratch of sparse_attention, kept between calls.
struct CallBufs {
  std::vector<std::vector<const char*>> base;                  // [B][part] KV data
  std::vector<std::vector<int64_t>> rows;                      // [B][part] KV rows
  std::vector<std::vector<Span>> spans;                        // [B * Hkv]
  std::vector<std::vector<std::pair<int32_t, int32_t>>> wk;    // work ranges per (request, kv head)
  std::vector<std::vector<float>> rm, rl, racc;                // their results (m, l, acc) per (request, kv head)
  std::vector<int> bad;
  std::vector<float> qs;
  std::vector<uint16_t> qb;
};

}  // namespace

// The fused pass writing into out [B, Hq, D] / lse [B, Hq] (fp32, contiguous, CPU or pinned): allocates
// no tensor, so it may run where CUDA API calls are not allowed (a CUDA host function, host_call.cpp).
void sparse_attention_into(
    const at::Tensor& q,                         // [B, Hq, D] fp32 / bf16 / fp16
    const std::vector<std::vector<at::Tensor>>& parts,  // [B][P_b] of [Hkv, Lp, 2, D]: token records [K row, V row]
    const std::vector<at::Tensor>& cpart,        // [B] of int32 [C_b]: part of each cluster
    const std::vector<at::Tensor>& cstart,       // [B] of int64 [Hkv, C_b]: first token of the cluster in its part
    const std::vector<at::Tensor>& csize,        // [B] of int32 [Hkv, C_b]: tokens of the cluster
    const std::vector<at::Tensor>& sel,          // [B] of int64 [Hkv, S_b]: selected cluster ids
    const std::vector<at::Tensor>& nsel,         // [B] of int64 [Hkv]: valid ids per head
    double scale, int64_t work_tokens, bool touch_only, int64_t prefetch_rows, int64_t prefetch_hint,
    at::Tensor& out, at::Tensor& lse) {
  const int64_t t_in = now_ns();
  tls_split = KernelSplit{};
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.device().is_cpu(),
              "q must be a contiguous CPU [B, Hq, D] tensor (fp32, or the KV dtype)");
  const int B = static_cast<int>(q.size(0)), Hq = static_cast<int>(q.size(1)), D = static_cast<int>(q.size(2));
  const size_t nb = parts.size();
  TORCH_CHECK(static_cast<int>(nb) == B && cpart.size() == nb && cstart.size() == nb && csize.size() == nb &&
                  sel.size() == nb && nsel.size() == nb,
              "per-request lists must all have B entries");
  TORCH_CHECK(B > 0 && !parts[0].empty(), "empty batch");
  TORCH_CHECK(work_tokens > 0, "work_tokens must be > 0");
  TORCH_CHECK(prefetch_rows >= 0 && valid_prefetch_hint(prefetch_hint),
              "prefetch_rows must be >= 0 and prefetch_hint one of -1 (none), 0 (NTA), 1 (T2), 3 (T0)");
  const int Hkv = static_cast<int>(parts[0][0].size(0));
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "num query heads must be a multiple of num kv heads");
  const int G = Hq / Hkv;
  const at::ScalarType dt = parts[0][0].scalar_type();
  const int64_t row_bytes = static_cast<int64_t>(D) * parts[0][0].element_size();

  // The calling thread's scratch, reused across calls (the call runs on this thread and its pool).
  thread_local CallBufs tls;
  CallBufs& cb = tls;  // shared by the pool threads below (a thread_local named inside the region would be theirs)
  if (cb.base.size() < static_cast<size_t>(B)) cb.base.resize(B), cb.rows.resize(B);
  auto& base = cb.base;  // [b][part]: KV part's data and rows
  auto& rows = cb.rows;
  for (int b = 0; b < B; ++b) {
    TORCH_CHECK(!parts[b].empty(), "request ", b, ": no KV parts");
    base[b].clear(), rows[b].clear();
    for (size_t j = 0; j < parts[b].size(); ++j) {
      const at::Tensor& kv = parts[b][j];
      TORCH_CHECK(kv.dim() == 4 && kv.size(0) == Hkv && kv.size(2) == 2 && kv.size(3) == D,
                  "request ", b, " part ", j, ": KV must be [Hkv, L, 2, D]");
      TORCH_CHECK(kv.scalar_type() == dt, "all KV parts must share one dtype");
      TORCH_CHECK(kv.is_contiguous() && kv.device().is_cpu(), "KV parts must be contiguous CPU tensors");
      base[b].push_back(static_cast<const char*>(kv.data_ptr()));
      rows[b].push_back(kv.size(1));
    }
    const int64_t C = cpart[b].numel();
    TORCH_CHECK(cpart[b].scalar_type() == at::kInt && cstart[b].scalar_type() == at::kLong &&
                    csize[b].scalar_type() == at::kInt && sel[b].scalar_type() == at::kLong &&
                    nsel[b].scalar_type() == at::kLong,
                "cluster tables: cpart int32, cstart int64, csize int32, sel/nsel int64");
    TORCH_CHECK(cstart[b].dim() == 2 && cstart[b].size(0) == Hkv && cstart[b].size(1) == C &&
                    csize[b].sizes() == cstart[b].sizes() && cstart[b].is_contiguous() && csize[b].is_contiguous() &&
                    cpart[b].is_contiguous(),
                "request ", b, ": cluster tables must be contiguous [Hkv, C]");
    TORCH_CHECK(sel[b].dim() == 2 && sel[b].size(0) == Hkv && sel[b].is_contiguous() && nsel[b].numel() == Hkv,
                "request ", b, ": selection must be [Hkv, S] with counts [Hkv]");
  }

  Ctx c;
  c.B = B, c.Hq = Hq, c.Hkv = Hkv, c.G = G, c.D = D;
  c.touch_only = touch_only;
  c.pf_rows = prefetch_rows;
  const int BH = B * Hkv;
  if (cb.spans.size() < static_cast<size_t>(BH))
    cb.spans.resize(BH), cb.wk.resize(BH), cb.rm.resize(BH), cb.rl.resize(BH), cb.racc.resize(BH);
  int* bad = grow(cb.bad, BH);

  // q: checked for NaN/Inf; the bf16 fast path takes q as bf16 (given as bf16, or fp32 that is exactly
  // bf16: it is, from a bf16 model), the others as fp32 pre-scaled to log2 units.
  const int64_t nq = static_cast<int64_t>(B) * Hq * D;
  const float qsc = static_cast<float>(scale * LOG2E);
  const at::ScalarType qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf, "queries must be fp32, bf16 or fp16");
  const void* qp = q.data_ptr();
  bool nonfinite;
  if (qt == at::kFloat) nonfinite = any_nonfinite(static_cast<const uint32_t*>(qp), nq, 0x7f800000u);
  else if (qt == at::kBFloat16) nonfinite = any_nonfinite(static_cast<const uint16_t*>(qp), nq, uint16_t{0x7f80});
  else nonfinite = any_nonfinite(static_cast<const uint16_t*>(qp), nq, uint16_t{0x7c00});
  TORCH_CHECK_VALUE(!nonfinite, "queries contain NaN or Inf");
  // bf16 fast path: bf16 KV, q exactly bf16 (used in place when given as bf16), and a head size with a
  // compiled item (64, 128: the dispatch below); any other D takes q as fp32 (a D of 32 or 96 here left
  // the generic item without its queries: a segfault on AVX512-BF16 CPUs)
  bool fast = false;
#if defined(__AVX512BF16__)
  if (dt == at::kBFloat16 && (D == 64 || D == 128)) {
    if (qt == at::kBFloat16) c.qb = static_cast<const uint16_t*>(qp), fast = true;
    else if (qt == at::kFloat && split_bf16(static_cast<const uint32_t*>(qp), nq, grow(cb.qb, nq)))
      c.qb = cb.qb.data(), fast = true;
    if (fast) c.qscale = qsc;
  }
#endif
  if (!fast) {  // the other paths take q as fp32, pre-scaled to log2 units
    float* qs = grow(cb.qs, nq);
    NELSSA_DISPATCH_KV(qt, "queries", [&] { scale_q(static_cast<const scalar_t*>(qp), nq, qsc, qs); });
    c.q = qs;
  }

  ItemFn item = nullptr;
  with_prefetch_hint(prefetch_hint, [&](auto hint) {
    constexpr int HINT = decltype(hint)::value;
    NELSSA_DISPATCH_KV(dt, "sparse_attention", [&] {
      item = D == 64 ? &run_item<scalar_t, 64, HINT> : D == 128 ? &run_item<scalar_t, 128, HINT>
                                                                : &run_item<scalar_t, 0, HINT>;
    });
  });
  TORCH_CHECK(out.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat && out.is_contiguous() &&
                  lse.is_contiguous() && out.device().is_cpu() && lse.device().is_cpu() &&
                  out.sizes() == at::IntArrayRef({B, Hq, D}) && lse.sizes() == at::IntArrayRef({B, Hq}),
              "outputs must be contiguous fp32 CPU tensors out [B, Hq, D] and lse [B, Hq]");
  float* o = out.data_ptr<float>();
  float* ls = lse.data_ptr<float>();

  // Work items of <= work rows: at most work_tokens, and small enough for ~16 items per thread (the
  // dynamic schedule's tail, about half an item per thread, stays a few % of the call). The rows are
  // estimated here (selected clusters x the request's mean cluster size), so the items are cut in the
  // same loop that finds the spans.
  int64_t work;
  {
    double est = 0;
    for (int b = 0; b < B; ++b) {
      int64_t tokens = 0;
      for (int64_t r : rows[b]) tokens += r;
      const double mean = static_cast<double>(tokens) / static_cast<double>(std::max<int64_t>(1, cpart[b].numel()));
      const int64_t S = sel[b].size(1);
      const int64_t* ns = nsel[b].data_ptr<int64_t>();
      for (int h = 0; h < Hkv; ++h) est += mean * static_cast<double>(std::clamp<int64_t>(ns[h], 0, S));
    }
    const int64_t threads = pool().threads;
    const int64_t per = (static_cast<int64_t>(est) + 16 * threads - 1) / (16 * threads);
    work = std::max<int64_t>(std::min<int64_t>(64, work_tokens), std::min<int64_t>(work_tokens, per));
  }

  // One run of the calling thread's team for the whole call (host_team.cpp: its workers wait for it
  // spinning or asleep; an OpenMP region's start and barriers were futex wake-ups in an engine process);
  // nothing in it throws: bad selections are flagged and raised after it.
  auto& spans = cb.spans;
  auto& wk = cb.wk;
  auto &rm = cb.rm, &rl = cb.rl, &racc = cb.racc;
  // the call's time by part (KernelSplit): the caller's stamps after barriers, each member's entry and busy time
  HostTeam& tm = host_team();
  const int team = team_size(tm);
  const int64_t t_region = now_ns();
  std::atomic<int64_t> last_entry{t_region}, busy_ns{0};
  std::atomic<int64_t> next_bh{0}, next_item{0};  // the loops' dynamic schedules
  int64_t t_tables = 0, t_items = 0;
  // Phase 1, for one (request, kv head): its spans, one per selected cluster (validated), cut into work
  // items of <= work rows.
  auto phase1 = [&](int bh) {
    const int b = bh / Hkv, h = bh % Hkv;
    auto& sv = spans[bh];
    sv.clear(), wk[bh].clear();
    bad[bh] = 0;
    const int64_t C = cpart[b].numel(), S = sel[b].size(1);
    const int64_t n = nsel[b].data_ptr<int64_t>()[h];
    if (n < 0 || n > S) { bad[bh] = 1; return; }
    const int64_t* ids = sel[b].data_ptr<int64_t>() + h * S;
    const int32_t* cp = cpart[b].data_ptr<int32_t>();
    const int64_t* cs = cstart[b].data_ptr<int64_t>() + h * C;
    const int32_t* cz = csize[b].data_ptr<int32_t>() + h * C;
    sv.reserve(n);
    // the table lookups are cold cache misses (one line per selected cluster): prefetch them ahead
    constexpr int64_t AHEAD = 32;
    auto prefetch_entry = [&](int64_t i) {  // ids are validated below; clamped here only to stay in the table
      const int64_t cid = std::clamp<int64_t>(ids[i], 0, C - 1);
      __builtin_prefetch(cs + cid), __builtin_prefetch(cz + cid), __builtin_prefetch(cp + cid);
    };
    for (int64_t i = 0; i < std::min(n, AHEAD); ++i) prefetch_entry(i);
    bool big = false;
    for (int64_t i = 0; i < n; ++i) {
      if (i + AHEAD < n) prefetch_entry(i + AHEAD);
      const int64_t cid = ids[i];
      if (cid < 0 || cid >= C) { bad[bh] = 1; break; }
      const int32_t part = cp[cid];
      const int64_t st = cs[cid], sz = cz[cid];
      if (part < 0 || part >= static_cast<int32_t>(rows[b].size()) || st < 0 || sz < 0 ||
          st + sz > rows[b][part]) { bad[bh] = 1; break; }
      const char* head = base[b][part] + 2 * h * rows[b][part] * row_bytes;
      sv.push_back({head + 2 * st * row_bytes, head + (2 * st + 1) * row_bytes, sz});
      big |= sz > work;
    }
    if (bad[bh]) return;
    if (big) {
      std::vector<Span> split;  // clusters larger than one work item are cut (rare: clusters are small)
      for (const Span& sp : sv)
        for (int64_t o = 0; o < sp.n; o += work)
          split.push_back({sp.k + 2 * o * row_bytes, sp.v + 2 * o * row_bytes, std::min(work, sp.n - o)});
      sv.swap(split);
    }
    int64_t acc = 0;
    int32_t s0 = 0;
    for (int32_t i = 0; i < static_cast<int32_t>(sv.size()); ++i) {
      acc += sv[i].n;
      if (acc >= work) { wk[bh].push_back({s0, i + 1}); s0 = i + 1; acc = 0; }
    }
    if (s0 < static_cast<int32_t>(sv.size())) wk[bh].push_back({s0, static_cast<int32_t>(sv.size())});
    const int64_t ni = static_cast<int64_t>(wk[bh].size());  // its items' results, in reused buffers
    grow(rm[bh], ni * G), grow(rl[bh], ni * G), grow(racc[bh], ni * G * D);
  };
  // Phase 4, for one (request, kv head): combine the chunks of each of its q heads by LSE.
  auto phase4 = [&](int bh) {
    const int b = bh / Hkv, h = bh % Hkv;
    for (int g = 0; g < G; ++g) {
      const int64_t row = static_cast<int64_t>(b) * Hq + h * G + g;
      const int64_t ni = static_cast<int64_t>(wk[bh].size());
      const float *pm = rm[bh].data(), *pl = rl[bh].data(), *pacc = racc[bh].data();
      float M = NEG_INF;
      for (int64_t w = 0; w < ni; ++w) M = std::max(M, pm[w * G + g]);
      float* od = o + row * D;
      std::fill(od, od + D, 0.f);
      float L = 0.f;
      if (M != NEG_INF) {
        for (int64_t w = 0; w < ni; ++w) {
          const float f = std::exp2(pm[w * G + g] - M);
          L += f * pl[w * G + g];
          const float* a = pacc + (w * G + g) * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) od[d] += f * a[d];
        }
      }
      if (L > 0.f) {
        const float inv = 1.f / L;
        for (int d = 0; d < D; ++d) od[d] *= inv;
        ls[row] = (M + std::log2(L)) * LN2;
      } else {
        ls[row] = NEG_INF;
      }
    }
  };
  team_run(tm, [&](int me) {
    {
      const int64_t e = now_ns();
      int64_t cur = last_entry.load(std::memory_order_relaxed);
      while (e > cur && !last_entry.compare_exchange_weak(cur, e, std::memory_order_relaxed)) {
      }
    }
    // Phase 1 over (request, kv head), four at a time (one loop: each barrier may cost a wake-up)
    for (int64_t s0; (s0 = next_bh.fetch_add(4, std::memory_order_relaxed)) < BH;)
      for (int bh = static_cast<int>(s0); bh < std::min<int64_t>(BH, s0 + 4); ++bh) phase1(bh);
    team_barrier(tm);
    // Phase 2, on every member (no serial step, no barrier): whether any selection was bad, and the items'
    // numbering (item i is item i - pre[bh] of the bh with pre[bh] <= i < pre[bh + 1]).
    bool fail = false;
    thread_local std::vector<int64_t> pre;
    pre.resize(BH + 1);
    pre[0] = 0;
    for (int bh = 0; bh < BH; ++bh) fail |= bad[bh] != 0, pre[bh + 1] = pre[bh] + static_cast<int64_t>(wk[bh].size());
    const int64_t nw = pre[BH];
    if (fail) return;  // every member sees the same flags: none waits at the barrier below
    if (me == 0) t_tables = now_ns();
    // Phase 3: the fused pass, one item at a time
    int64_t busy = 0;
    for (int64_t i; (i = next_item.fetch_add(1, std::memory_order_relaxed)) < nw;) {
      const int bh = static_cast<int>(std::upper_bound(pre.begin(), pre.begin() + BH + 1, i) - pre.begin()) - 1;
      const int64_t k = i - pre[bh];
      const Work w{bh, wk[bh][k].first, wk[bh][k].second};
      const int64_t a = now_ns();
      item(c, spans[bh], w, rm[bh].data() + k * G, rl[bh].data() + k * G, racc[bh].data() + k * G * D);
      busy += now_ns() - a;
    }
    busy_ns.fetch_add(busy, std::memory_order_relaxed);
    team_barrier(tm);
    if (me == 0) t_items = now_ns();
    // Phase 4 over (request, kv head), split evenly (the run's end is its barrier)
    for (int bh = me; bh < BH; bh += team) phase4(bh);
  });
  {
    const int64_t t_end = now_ns();
    KernelSplit& k = tls_split;
    k.prep = secs(t_region - t_in);
    k.fork = secs(last_entry.load() - t_region);
    if (t_tables && t_items) {
      const double mean = secs(busy_ns.load()) / team, wall = secs(t_items - t_tables);
      k.tables = std::max(0.0, secs(t_tables - t_region) - k.fork);
      k.items = std::min(mean, wall), k.wait = wall - k.items;
      k.combine = secs(t_end - t_items);
    } else {
      k.tables = std::max(0.0, secs(t_end - t_region) - k.fork);
    }
  }
  for (int bh = 0; bh < BH; ++bh)
    TORCH_CHECK_VALUE(!bad[bh], "request ", bh / Hkv, " kv head ", bh % Hkv,
                      ": selection out of range of its cluster table");  // bad input: a ValueError
  // the results are checked here, not by the caller (torch ops on its Python thread cost GIL hand-offs):
  // NaN/Inf in an output, or a NaN LSE (-inf is an empty selection), is an error, never an answer
  bool bad_out = !touch_only && any_nonfinite(reinterpret_cast<const uint32_t*>(o), static_cast<int64_t>(B) * Hq * D,
                                              0x7f800000u);
  for (int64_t i = 0; !touch_only && i < static_cast<int64_t>(B) * Hq && !bad_out; ++i) bad_out = std::isnan(ls[i]);
  TORCH_CHECK_VALUE(!bad_out, "host attention returned non-finite values");
}

const KernelSplit& last_kernel_split() { return tls_split; }

std::tuple<at::Tensor, at::Tensor> sparse_attention(
    const at::Tensor& q, const std::vector<std::vector<at::Tensor>>& parts, const std::vector<at::Tensor>& cpart,
    const std::vector<at::Tensor>& cstart, const std::vector<at::Tensor>& csize, const std::vector<at::Tensor>& sel,
    const std::vector<at::Tensor>& nsel, double scale, int64_t work_tokens, bool touch_only,
    int64_t prefetch_rows, int64_t prefetch_hint,
    bool pin_out) {  // outputs in pinned memory (CUDA builds of torch: the caller copies them to the device
                     // without a staging copy)
  TORCH_CHECK(q.dim() == 3, "q must be a contiguous CPU [B, Hq, D] tensor (fp32, or the KV dtype)");
  const auto oopt = q.options().dtype(at::kFloat).pinned_memory(pin_out);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, oopt);
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, oopt);
  sparse_attention_into(q, parts, cpart, cstart, csize, sel, nsel, scale, work_tokens, touch_only, prefetch_rows,
                        prefetch_hint, out, lse);
  return {out, lse};
}

}  // namespace nelssa
