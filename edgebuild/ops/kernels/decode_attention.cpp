// Decode / verify attention over the paged KV cache for the CPU runtime
// (edgebuild.ops.attention_kernel; used by ops/attention_fast.py's row-invariant steps).
//
// For each valid new row r (sequence row_b[r]) and query head h (KV head h / (Hq / Hkv)):
//   s_t = scale * q[r, h] . K[t]   for every key column t with mask[r, t]
//   out[r, h] = sum_t softmax(s)_t V[t]
// K[t] / V[t] are read in place from the pages (page_table[b, t / page_size], slot
// t % page_size): nothing is gathered. Scores, softmax and the weighted sum run in fp32; the
// output is rounded once to q's dtype. Every (row, head) is computed alone by the same loop
// whatever the other rows, heads or threads of the call, so a row's bits never depend on the
// rows beside it (a 1-row decode equals row i of a verify pass, which keeps greedy DSpark
// equal to target-only).
//
// Up to 4 rows of a sequence and the query heads that share a KV head run as one work item
// (the K / V rows fetched from memory once for them, `run` below), the dot products, exp and
// the weighted sum of V in AVX2 registers where the build has it (-march=native). SmolLM2's
// shapes (9 q / 3 KV heads, D 64), one thread: 8 rows over 256 keys 570 -> 180 us, 1 row over
// 128 keys 42 -> 17 us (against the scalar per-head loop before).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <algorithm>
#include <vector>

#include "pool.h"
#include "simd_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#define EB_ATTN_AVX2 1  // built with -march=native on a CPU that has them
#endif

namespace {

constexpr int kLanes = 16;  // partial sums of a dot product (vectorized by the compiler)

inline float to_f32(float v) { return v; }
inline float to_f32(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t d) {
  for (int64_t j = 0; j < d; ++j) dst[j] = to_f32(src[j]);
}

// q . k over d (a multiple of kLanes), lanes summed in a fixed order: the build without
// AVX2 (with it, scores_of below).
inline float dot(const float* q, const float* k, int64_t d) {
  float acc[kLanes] = {0};
  for (int64_t j = 0; j < d; j += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += q[j + l] * k[j + l];
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

// s_j <- exp(s_j - top) for j < n; returns the sum of the new s_j (in a fixed order).
inline float exp_sum(float* s, int64_t n, float top) {
#ifdef EB_ATTN_AVX2
  const __m256 t = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), t));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  if (j < n) {  // the tail through the same exp8, its unused lanes zeroed
    alignas(32) float buf[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    std::memcpy(buf, s + j, (n - j) * sizeof(float));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j)), lane));
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_load_ps(buf), t)), keep);
    _mm256_store_ps(buf, e);
    std::memcpy(s + j, buf, (n - j) * sizeof(float));
    total = _mm256_add_ps(total, e);
  }
  return hsum8(total);
#else
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - top);
    total += s[j];
  }
  return total;
#endif
}

#ifdef EB_ATTN_AVX2
// 8 values of a K / V row as fp32 (bf16 widened: exact)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

// out[0 .. 8 NV) = sum_j p[j] * V_j[e0 .. e0 + 8 NV): j in order, one fma each, the NV
// accumulators held in registers (through memory, the loop's stores cost a third of a verify
// pass's attention).
template <int NV, typename T>
inline void weighted_sum(const T* const* vrows, int64_t e0, int64_t n, const float* p,
                         float* out) {
  __m256 a[NV];
  for (int u = 0; u < NV; ++u) a[u] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const T* v = vrows[j] + e0;
    const __m256 w = _mm256_set1_ps(p[j]);
    for (int u = 0; u < NV; ++u) a[u] = _mm256_fmadd_ps(w, load8(v + 8 * u), a[u]);
  }
  for (int u = 0; u < NV; ++u) _mm256_storeu_ps(out + e0 + 8 * u, a[u]);
}

// weighted_sum over a head of D values (a multiple of 16), 64 at a time.
template <typename T>
inline void weighted_sum_head(const T* const* vrows, int64_t n, const float* p, float* out,
                              int64_t D) {
  int64_t e = 0;
  for (; e + 64 <= D; e += 64) weighted_sum<8>(vrows, e, n, p, out);
  if (D - e == 48) weighted_sum<6>(vrows, e, n, p, out);
  if (D - e == 32) weighted_sum<4>(vrows, e, n, p, out);
  if (D - e == 16) weighted_sum<2>(vrows, e, n, p, out);
}

// s[j] = q . K_j * scale over a head's keys (two accumulators over d in steps of 16, added,
// then hsum8; a bf16 K row widened in registers), q's 8 vectors held
// in registers for a head of 64; returns the running max (NaN scores never raise it).
// `prefetch`: the K and V rows 4 keys ahead are fetched (the first pass over the keys; the
// other heads and rows find them in cache).
template <typename T>
inline float scores_of(const float* q, const T* const* krows, const T* const* vrows, int64_t n,
                       int64_t D, float scale, float* s, float top, bool prefetch) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  __m256 qv[8];
  const bool d64 = D == 64;
  if (d64)
    for (int u = 0; u < 8; ++u) qv[u] = _mm256_loadu_ps(q + 8 * u);
  for (int64_t j = 0; j < n; ++j) {
    if (prefetch && j + 4 < n)
      for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(krows[j + 4]) + off, 0, 3);
        __builtin_prefetch(reinterpret_cast<const char*>(vrows[j + 4]) + off, 0, 2);
      }
    const T* k = krows[j];
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    if (d64) {
      for (int u = 0; u < 8; u += 2) {
        a0 = _mm256_fmadd_ps(qv[u], load8(k + 8 * u), a0);
        a1 = _mm256_fmadd_ps(qv[u + 1], load8(k + 8 * u + 8), a1);
      }
    } else {
      for (int64_t e = 0; e < D; e += kLanes) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), load8(k + e), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e + 8), load8(k + e + 8), a1);
      }
    }
    const float x = hsum8(_mm256_add_ps(a0, a1)) * scale;
    s[j] = x;
    top = x > top ? x : top;
  }
  return top;
}
#endif

// K / V row t as fp32 (the build without AVX2): fp32 rows in place, bf16 widened into `buf`.
inline const float* row_f32(const float* src, float*, int64_t) { return src; }
inline const float* row_f32(const c10::BFloat16* src, float* buf, int64_t d) {
  load_row(src, buf, d);
  return buf;
}

// The step's own new rows as extra keys (a draft block: attended, never written to the pool):
// row r also sees new row s of its sequence where new_mask[r, s]; K = new_k [B, S, Hkv, D]
// (normalized and rotated), V = the row's v heads in `heads` [B, S, Hq + 2 Hkv, D].
template <typename T>
struct NewKeys {
  const T* k = nullptr;
  const T* heads = nullptr;
  const bool* mask = nullptr;  // [R, S]
  int64_t S = 0, W = 0, Hq = 0;
};

// A work item is (up to kRowsPerItem rows of one sequence, KV head kvh). First each row's
// visible keys are listed in order as K / V row pointers (the pool's keys by page, then the
// step's new rows: no division a key); then each (row, head) alone runs over its list: the
// scores dot(q, K_j) * scale (q held in registers for a head of 64, scores_of), softmax from the
// running max, the weighted sum of V in key order. The first (row, head) of an item prefetches
// the K / V rows 4 keys ahead (a page's rows sit 4-16 KiB from the next page's, where the
// hardware prefetcher starts over); the other heads and rows of the item find them in cache,
// so a verify pass or a draft block reads its sequence's keys from memory once, not once a row
// (a 3-row SmolLM2 verify at 2,048 keys re-read ~3 MB of K / V a layer, more than L2 holds).
// Each (row, head)'s arithmetic is the same, in the same order, whatever the rows, heads and
// threads beside it: a row's bits never depend on them. Measured (bench/README.md, 2026-12-06;
// SmolLM2's 9 q / 3 KV heads, 30 layers, fp32, 1 thread): 256 keys, warm, 1 / 3 / 7 rows 0.63 /
// 1.69 / 3.74 -> 0.58 / 1.40 / 3.06 ms; 2,048 keys from memory 15.2-17.0 / 26-28 / 44-48 ->
// 11.4-12.0 / 19.2-19.7 / 35.0-35.7 ms; bf16 256 keys 1.04 / 2.30 / 5.19 -> 0.61 / 1.54 / 3.41.
constexpr int64_t kRowsPerItem = 4;  // rows of a sequence per work item (more: fewer items)

template <typename T>
void run(const T* q, const T* cache, int64_t P, const int64_t* table, int64_t npages,
         const int64_t* row_b, const bool* mask, T* out, int64_t R, int64_t Hq, int64_t Hkv,
         int64_t D, int64_t ps, int64_t keys, float scale, const NewKeys<T>& nk = NewKeys<T>()) {
  const int64_t group = Hq / Hkv, most = keys + nk.S;
  // cache [P, 2, Hkv, ps, D]
  const int64_t s_head = ps * D, s_kv = Hkv * s_head, s_page = 2 * s_kv;
  std::vector<int64_t> seg_start;  // runs of rows of one sequence, at most kRowsPerItem each
  for (int64_t r = 0; r < R; ++r)
    if (r == 0 || row_b[r] != row_b[r - 1] || r - seg_start.back() >= kRowsPerItem)
      seg_start.push_back(r);
  const int64_t segs = static_cast<int64_t>(seg_start.size());
  seg_start.push_back(R);
  const int64_t items = segs * Hkv;
  const int64_t per = std::max<int64_t>(1, items / 8);
  eb_pool::parallel_for(items, per, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(group * D), kf(D), acc(group * D), scores(group * most), top(group);
    std::vector<const T*> krow(kRowsPerItem * most), vrow(kRowsPerItem * most);
    int64_t n[kRowsPerItem];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t seg = i / Hkv, kvh = i % Hkv, r0 = seg_start[seg];
      const int64_t rows = seg_start[seg + 1] - r0, b = row_b[r0];
      const int64_t* pages = table + b * npages;
      // phase 1: each row's keys in order (the pool's, then the step's new rows), as pointers
      for (int64_t rr = 0; rr < rows; ++rr) n[rr] = 0;
      auto add = [&](int64_t rr, const T* kp, const T* vp) {
        krow[rr * most + n[rr]] = kp;
        vrow[rr * most + n[rr]++] = vp;
      };
      for (int64_t page = 0, t0 = 0; t0 < keys; ++page, t0 += ps) {  // by page: no divisions
        const int64_t t1 = std::min(keys, t0 + ps);
        const T* kpage = nullptr;
        for (int64_t t = t0; t < t1; ++t) {
          bool seen = false;
          for (int64_t rr = 0; rr < rows; ++rr) seen = seen || mask[(r0 + rr) * keys + t];
          if (!seen) continue;
          if (kpage == nullptr) {
            TORCH_CHECK(page < npages, "decode_attention: key ", t, " past the page table");
            const int64_t pg = pages[page];
            TORCH_CHECK(pg >= 0 && pg < P, "decode_attention: page ", pg, " of key ", t,
                        " is outside the pool of ", P, " pages");
            kpage = cache + pg * s_page + kvh * s_head;
          }
          const T* kp = kpage + (t - t0) * D;
          for (int64_t rr = 0; rr < rows; ++rr)
            if (mask[(r0 + rr) * keys + t]) add(rr, kp, kp + s_kv);  // V: K slot + one half
        }
      }
      for (int64_t j = 0; j < nk.S; ++j) {
        const int64_t row = b * nk.S + j;
        const T* kp = nk.k + (row * Hkv + kvh) * D;
        const T* vp = nk.heads + (row * nk.W + nk.Hq + Hkv + kvh) * D;
        for (int64_t rr = 0; rr < rows; ++rr)
          if (nk.mask[(r0 + rr) * nk.S + j]) add(rr, kp, vp);
      }
      // phase 2: each (row, head) alone over its keys: scores, softmax, weighted sum of V
      for (int64_t rr = 0; rr < rows; ++rr) {
        const int64_t r = r0 + rr, cnt = n[rr];
        const T* const* kr = krow.data() + rr * most;
        const T* const* vr = vrow.data() + rr * most;
        if (cnt == 0) {  // a row that sees nothing (padding): zero, as the torch path gives it
          for (int64_t g = 0; g < group; ++g) {
            T* o = out + (r * Hq + kvh * group + g) * D;
            for (int64_t j = 0; j < D; ++j) o[j] = static_cast<T>(0.f);
          }
          continue;
        }
        for (int64_t g = 0; g < group; ++g) {
          load_row(q + (r * Hq + kvh * group + g) * D, qf.data() + g * D, D);
          float* sc = scores.data() + g * most;
          float tp = -std::numeric_limits<float>::infinity();
#ifdef EB_ATTN_AVX2
          tp = scores_of(qf.data() + g * D, kr, vr, cnt, D, scale, sc, tp, rr == 0 && g == 0);
#else
          {
            for (int64_t j = 0; j < cnt; ++j) {
              const float x = dot(qf.data() + g * D, row_f32(kr[j], kf.data(), D), D) * scale;
              sc[j] = x;
              tp = x > tp ? x : tp;
            }
          }
#endif
          top[g] = 1.f / exp_sum(sc, cnt, tp);  // now the normalizer
        }
#ifdef EB_ATTN_AVX2
        for (int64_t g = 0; g < group; ++g)
          weighted_sum_head(vr, cnt, scores.data() + g * most, acc.data() + g * D, D);
#else
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < cnt; ++j) {
          const float* v = row_f32(vr[j], kf.data(), D);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * most + j];
            float* a = acc.data() + g * D;
            for (int64_t e = 0; e < D; ++e) a[e] += p * v[e];
          }
        }
#endif
        for (int64_t g = 0; g < group; ++g) {
          T* o = out + (r * Hq + kvh * group + g) * D;
          const float* a = acc.data() + g * D;
          for (int64_t e = 0; e < D; ++e) o[e] = static_cast<T>(a[e] * top[g]);
        }
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& cache,
                            const at::Tensor& page_table, const at::Tensor& row_b,
                            const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "decode_attention: q must be [R, Hq, D]");
  TORCH_CHECK(cache.dim() == 5 && cache.size(1) == 2 && cache.is_contiguous() &&
                  cache.scalar_type() == q.scalar_type(),
              "decode_attention: cache must be [P, 2, Hkv, page_size, D] in q's dtype");
  const int64_t R = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = cache.size(2);
  TORCH_CHECK(cache.size(4) == D && Hkv > 0 && Hq % Hkv == 0 && D % kLanes == 0,
              "decode_attention: head sizes do not match");
  TORCH_CHECK(page_table.dim() == 2 && page_table.scalar_type() == at::kLong &&
                  page_table.is_contiguous(),
              "decode_attention: page_table must be int64 [B, pages]");
  TORCH_CHECK(row_b.dim() == 1 && row_b.size(0) == R && row_b.scalar_type() == at::kLong,
              "decode_attention: row_b must be int64 [R]");
  TORCH_CHECK(mask.dim() == 2 && mask.size(0) == R && mask.scalar_type() == at::kBool &&
                  mask.is_contiguous(),
              "decode_attention: mask must be bool [R, T]");
  auto out = at::empty({R, Hq, D}, q.options());
  if (R == 0) return out.view({R, Hq * D});
  const int64_t B = page_table.size(0);
  const int64_t* rb = row_b.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(rb[r] >= 0 && rb[r] < B, "decode_attention: row_b");
  const int64_t ps = cache.size(3), keys = mask.size(1), npages = page_table.size(1);
  if (q.scalar_type() == at::kBFloat16) {
    run<c10::BFloat16>(q.data_ptr<c10::BFloat16>(), cache.data_ptr<c10::BFloat16>(),
                       cache.size(0), page_table.data_ptr<int64_t>(), npages, rb, mask.data_ptr<bool>(),
                       out.data_ptr<c10::BFloat16>(), R, Hq, Hkv, D, ps, keys,
                       static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "decode_attention: bf16 or fp32 only");
    run<float>(q.data_ptr<float>(), cache.data_ptr<float>(), cache.size(0),
               page_table.data_ptr<int64_t>(), npages, rb, mask.data_ptr<bool>(), out.data_ptr<float>(), R, Hq, Hkv, D, ps, keys,
               static_cast<float>(scale));
  }
  return out.view({R, Hq * D});
}

// One decode / verify step's attention of a layer in one call: the valid rows' q and k
// normalized (optional per-head RMSNorm, the q_norm / k_norm of Qwen3 and of DSpark drafts)
// and rotated ("rotate half" RoPE, as edgebuild.ops.rope.rotate_with: fp32 x1 * cos - x2 * sin
// and x2 * cos + x1 * sin, each product and sum rounded on its own, then one rounding to the
// model dtype), k and v written to their cache slots, then `run` above. What the torch ops of
// attention_fast._decode_step computed in ~10 calls per layer.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rotate_row(const T* x, const float* c,
                                                              const float* s, int64_t half,
                                                              int64_t D, T* out) {
  for (int64_t j = 0; j < half; ++j) {
    const float x1 = to_f32(x[j]), x2 = to_f32(x[j + half]);
    const float a = x1 * c[j], b = x2 * s[j], e = x2 * c[j], f = x1 * s[j];
    out[j] = static_cast<T>(a - b);
    out[j + half] = static_cast<T>(e + f);
  }
  for (int64_t j = 2 * half; j < D; ++j) out[j] = x[j];
}

// HF's RMSNorm of one head (Qwen3RMSNorm: fp32 variance, the normalized row rounded to the
// model dtype, then times the weight): w * T(x * rsqrt(mean(x^2) + eps)); the sum of squares in
// fp64, as the fp32 kernels' norm (f32_linear.cpp).
template <typename T>
__attribute__((optimize("fp-contract=off"))) void norm_row(const T* x, const float* w, float eps,
                                                            int64_t D, T* out) {
  double ss = 0.0;
  for (int64_t j = 0; j < D; ++j) ss += static_cast<double>(to_f32(x[j])) * to_f32(x[j]);
  const float r = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(D)) + eps);
  for (int64_t j = 0; j < D; ++j)
    out[j] = static_cast<T>(w[j] * to_f32(static_cast<T>(to_f32(x[j]) * r)));
}

// The rows' q / k: (normalized, then) rotated into `out`.
template <typename T>
inline void prepare_row(const T* x, const float* norm_w, float eps, const float* c,
                        const float* s, int64_t half, int64_t D, T* tmp, T* out) {
  if (norm_w != nullptr) {
    norm_row(x, norm_w, eps, D, tmp);
    x = tmp;
  }
  rotate_row(x, c, s, half, D, out);
}

// Per valid row r: q heads into q [R, Hq, D] (unless `q` is null: a write-only context step);
// k / v to the pool slot (write_pages[r], write_offsets[r]), or, with `new_k`, k into new_k
// [B, S, Hkv, D] and nothing written (a draft block: its rows are keys of this step only).
template <typename T>
void step(const T* heads, T* cache, const float* cos, const float* sin, int64_t half,
          const int64_t* wb, const int64_t* wi, const int64_t* wpage, const int64_t* woff,
          int64_t R, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int64_t ps, T* q,
          const float* qn, const float* kn, float eps, T* new_k) {
  const int64_t W = Hq + 2 * Hkv, s_head = ps * D, s_kv = Hkv * s_head, s_page = 2 * s_kv;
  std::vector<T> tmp(D);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t row = wb[r] * S + wi[r];
    const T* x = heads + row * W * D;
    const float* c = cos + row * half;
    const float* sn = sin + row * half;
    if (q != nullptr)
      for (int64_t h = 0; h < Hq; ++h)
        prepare_row(x + h * D, qn, eps, c, sn, half, D, tmp.data(), q + (r * Hq + h) * D);
    if (new_k != nullptr) {
      for (int64_t h = 0; h < Hkv; ++h)
        prepare_row(x + (Hq + h) * D, kn, eps, c, sn, half, D, tmp.data(),
                    new_k + (row * Hkv + h) * D);
      continue;
    }
    T* slot = cache + wpage[r] * s_page + woff[r] * D;
    for (int64_t h = 0; h < Hkv; ++h) {
      prepare_row(x + (Hq + h) * D, kn, eps, c, sn, half, D, tmp.data(), slot + h * s_head);
      std::memcpy(slot + s_kv + h * s_head, x + (Hq + Hkv + h) * D, D * sizeof(T));
    }
  }
}

// A norm weight as fp32 [D] (or null when absent).
at::Tensor norm_weight(const c10::optional<at::Tensor>& w, int64_t D, const char* name) {
  if (!w.has_value()) return at::Tensor();
  TORCH_CHECK(w->dim() == 1 && w->size(0) == D, "decode_step: ", name, " must be [head_dim]");
  return w->to(at::kFloat).contiguous();
}

template <typename T>
void dispatch_step(const at::Tensor& heads, at::Tensor& cache, const at::Tensor& cos,
                   const at::Tensor& sin, int64_t half, const int64_t* wb, const int64_t* wi,
                   const int64_t* wp, const int64_t* wo, int64_t R, int64_t S, int64_t hq,
                   int64_t Hkv, int64_t D, int64_t ps, at::Tensor& q, at::Tensor& out,
                   const at::Tensor& page_table, const c10::optional<at::Tensor>& mask,
                   double scale, const at::Tensor& qn, const at::Tensor& kn, double eps,
                   const c10::optional<at::Tensor>& new_mask, at::Tensor& new_k) {
  const bool attend = mask.has_value();
  T* kp = new_k.defined() ? new_k.data_ptr<T>() : nullptr;
  step<T>(heads.data_ptr<T>(), cache.data_ptr<T>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
          half, wb, wi, wp, wo, R, S, hq, Hkv, D, ps, attend ? q.data_ptr<T>() : nullptr,
          qn.defined() ? qn.data_ptr<float>() : nullptr,
          kn.defined() ? kn.data_ptr<float>() : nullptr, static_cast<float>(eps), kp);
  if (!attend) return;
  NewKeys<T> nk;
  if (kp != nullptr) {
    nk.k = kp;
    nk.heads = heads.data_ptr<T>();
    nk.mask = new_mask->data_ptr<bool>();
    nk.S = S;
    nk.W = hq + 2 * Hkv;
    nk.Hq = hq;
  }
  run<T>(q.data_ptr<T>(), cache.data_ptr<T>(), cache.size(0), page_table.data_ptr<int64_t>(),
         page_table.size(1), wb, mask->data_ptr<bool>(), out.data_ptr<T>(), R, hq, Hkv, D, ps,
         mask->size(1), static_cast<float>(scale), nk);
}

at::Tensor decode_step(const at::Tensor& heads, at::Tensor cache, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& write_b,
                       const at::Tensor& write_i, const at::Tensor& write_pages,
                       const at::Tensor& write_offsets, const at::Tensor& page_table,
                       const c10::optional<at::Tensor>& mask, int64_t hq, double scale,
                       const c10::optional<at::Tensor>& q_norm,
                       const c10::optional<at::Tensor>& k_norm, double eps,
                       const c10::optional<at::Tensor>& new_mask) {
  TORCH_CHECK(heads.dim() == 4 && heads.is_contiguous(),
              "decode_step: heads must be contiguous [B, S, Hq + 2 * Hkv, D]");
  const int64_t B = heads.size(0), S = heads.size(1), D = heads.size(3);
  const int64_t Hkv = (heads.size(2) - hq) / 2, R = write_b.numel();
  TORCH_CHECK(hq > 0 && Hkv > 0 && hq + 2 * Hkv == heads.size(2) && hq % Hkv == 0,
              "decode_step: head counts do not match heads' width");
  TORCH_CHECK(B > 0 && S > 0, "decode_step: heads must have at least one row");
  TORCH_CHECK(cache.dim() == 5 && cache.size(1) == 2 && cache.size(2) == Hkv &&
                  cache.size(4) == D && cache.is_contiguous() &&
                  cache.scalar_type() == heads.scalar_type() && D % kLanes == 0,
              "decode_step: cache must be [P, 2, Hkv, page_size, D] in heads' dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == sin.numel() &&
                  cos.numel() % (B * S) == 0 && 2 * (cos.numel() / (B * S)) <= D,
              "decode_step: cos / sin must be fp32 [B, S, rotary_dim / 2]");
  for (const at::Tensor* t : {&write_b, &write_i, &write_pages, &write_offsets})
    TORCH_CHECK(t->dim() == 1 && t->numel() == R && t->scalar_type() == at::kLong &&
                    t->is_contiguous(),
                "decode_step: write_b / write_i / write_pages / write_offsets: int64 [R]");
  TORCH_CHECK(page_table.dim() == 2 && page_table.scalar_type() == at::kLong &&
                  page_table.is_contiguous() && page_table.size(0) == B,
              "decode_step: page_table must be int64 [B, pages]");
  TORCH_CHECK(!mask.has_value() || (mask->dim() == 2 && mask->size(0) == R &&
                                    mask->scalar_type() == at::kBool && mask->is_contiguous()),
              "decode_step: mask must be bool [R, T]");
  TORCH_CHECK(!new_mask.has_value() ||
                  (mask.has_value() && new_mask->dim() == 2 && new_mask->size(0) == R &&
                   new_mask->size(1) == S && new_mask->scalar_type() == at::kBool &&
                   new_mask->is_contiguous()),
              "decode_step: new_mask must be bool [R, S], with a mask");
  const int64_t half = cos.numel() / (B * S), ps = cache.size(3), P = cache.size(0);
  const int64_t *wb = write_b.data_ptr<int64_t>(), *wi = write_i.data_ptr<int64_t>(),
                *wp = write_pages.data_ptr<int64_t>(), *wo = write_offsets.data_ptr<int64_t>();
  const bool writes = !new_mask.has_value();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(wb[r] >= 0 && wb[r] < B && wi[r] >= 0 && wi[r] < S &&
                    (!writes || (wp[r] >= 0 && wp[r] < P && wo[r] >= 0 && wo[r] < ps)),
                "decode_step: row ", r, " writes outside the batch or the pool");
  const at::Tensor qn = norm_weight(q_norm, D, "q_norm"), kn = norm_weight(k_norm, D, "k_norm");
  auto q = at::empty({mask.has_value() ? R : 0, hq, D}, heads.options());
  auto out = at::empty({mask.has_value() ? R : 0, hq, D}, heads.options());
  at::Tensor new_k = writes ? at::Tensor() : at::zeros({B, S, Hkv, D}, heads.options());
  if (R == 0) return out.view({out.size(0), hq * D});
  if (heads.scalar_type() == at::kBFloat16) {
    dispatch_step<c10::BFloat16>(heads, cache, cos, sin, half, wb, wi, wp, wo, R, S, hq, Hkv, D,
                                 ps, q, out, page_table, mask, scale, qn, kn, eps, new_mask,
                                 new_k);
  } else {
    TORCH_CHECK(heads.scalar_type() == at::kFloat, "decode_step: bf16 or fp32 only");
    dispatch_step<float>(heads, cache, cos, sin, half, wb, wi, wp, wo, R, S, hq, Hkv, D, ps, q,
                         out, page_table, mask, scale, qn, kn, eps, new_mask, new_k);
  }
  return out.view({out.size(0), hq * D});
}

// A decode / verify step's decoder layers in one call (edgebuild.models.common.FusedLayers):
// per layer the four linear calls of edgebuild_f32 (through the dispatcher, the ops as Python
// calls them) and this file's decode_step, in the modules' order with the modules' inputs, so
// the same bits as ~5 Python op calls a layer (what goes is ~10 us of Python per layer).
// Linear j of layer i is entry 4 i + j of w / sl / bias / n / kind (kind 0: f32_linear(x, w),
// 1: int4_f32_linear(x, w, sl), 2: int4_a8_linear(x, w, sl)); norm / eps 2 i, 2 i + 1 are the
// layer's input and post-attention RMSNorms, qk_norm 2 i, 2 i + 1 its q / k norms (or none).
// The step's attention inputs (cos .. mask, new_mask) and heads are shared by every layer; with
// new_mask the step is a DSpark draft's block pass (decode_step's non-causal block: the rows
// attend the cache (mask) and each other (new_mask), nothing is written). last_rows (0: all)
// cuts the last layer to the first last_rows rows of each sequence after its attention: a block
// pass's K/V need every row, its o_proj and MLP only the rows that are drafted (every kernel is
// row-invariant, so the kept rows have the same bits). Returns the last layer's output
// ([B, last_rows or S, d]), then the outputs of the layers in `taps` (ascending).
using F32Op = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                         int64_t, const c10::optional<at::Tensor>&, double, bool,
                         const c10::optional<at::Tensor>&);
using Int4Op = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const c10::optional<at::Tensor>&, int64_t,
                          const c10::optional<at::Tensor>&, double, bool,
                          const c10::optional<at::Tensor>&);

struct LinearOps {
  c10::TypedOperatorHandle<F32Op> f32;
  c10::TypedOperatorHandle<Int4Op> int4_f32, int4_a8;
};

const LinearOps& linear_ops() {  // edgebuild_f32 is loaded: FusedLayers exists only then
  static const LinearOps ops{
      c10::Dispatcher::singleton().findSchemaOrThrow("edgebuild_f32::f32_linear", "")
          .typed<F32Op>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("edgebuild_f32::int4_f32_linear", "")
          .typed<Int4Op>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("edgebuild_f32::int4_a8_linear", "")
          .typed<Int4Op>()};
  return ops;
}

// Linear j's call as the dispatcher runs it (kind 0: f32_linear(x, w), 1: int4_f32_linear(x, w,
// sl), 2: int4_a8_linear(x, w, sl)); `op` names the caller in the error.
at::Tensor run_linear(const char* op, int64_t kind, const at::Tensor& w, const at::Tensor& sl,
                      const c10::optional<at::Tensor>& b, int64_t n, const at::Tensor& x,
                      const c10::optional<at::Tensor>& nw, double e, bool swiglu,
                      const c10::optional<at::Tensor>& residual) {
  const LinearOps& ops = linear_ops();
  switch (kind) {
    case 0: return ops.f32.call(x, w, b, n, nw, e, swiglu, residual);
    case 1: return ops.int4_f32.call(x, w, sl, b, n, nw, e, swiglu, residual);
    case 2: return ops.int4_a8.call(x, w, sl, b, n, nw, e, swiglu, residual);
  }
  TORCH_CHECK(false, op, ": linear kind ", kind, " (0, 1 or 2)");
}

std::vector<at::Tensor> decoder_layers(
    const at::Tensor& x_in, at::TensorList caches, at::TensorList w, at::TensorList sl,
    const c10::List<c10::optional<at::Tensor>>& bias, at::IntArrayRef n, at::IntArrayRef kind,
    at::TensorList norm, at::ArrayRef<double> eps,
    const c10::List<c10::optional<at::Tensor>>& qk_norm, double qk_eps, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& write_b, const at::Tensor& write_i,
    const at::Tensor& write_pages, const at::Tensor& write_offsets, const at::Tensor& table,
    const at::Tensor& mask, int64_t hq, int64_t hkv, double scale, at::IntArrayRef taps,
    const c10::optional<at::Tensor>& new_mask, int64_t last_rows) {
  const int64_t L = caches.size();
  TORCH_CHECK(x_in.dim() == 3 && L > 0 && (int64_t)w.size() == 4 * L &&
                  (int64_t)sl.size() == 4 * L && (int64_t)bias.size() == 4 * L &&
                  (int64_t)n.size() == 4 * L && (int64_t)kind.size() == 4 * L &&
                  (int64_t)norm.size() == 2 * L && (int64_t)eps.size() == 2 * L &&
                  (int64_t)qk_norm.size() == 2 * L,
              "decoder_layers: x must be [B, S, d]; 4 linears, 2 norms and 2 q/k norms a layer");
  const int64_t B = x_in.size(0), S = x_in.size(1), D = caches[0].size(4);
  TORCH_CHECK(write_b.numel() == B * S, "decoder_layers: every row of x must be valid (R = B S)");
  TORCH_CHECK(last_rows >= 0 && last_rows <= S, "decoder_layers: last_rows must be in [0, S]");
  const bool cut = last_rows > 0 && last_rows < S;
  for (size_t t = 0; t < taps.size(); ++t)
    TORCH_CHECK(taps[t] >= 0 && taps[t] < L && (t == 0 || taps[t] > taps[t - 1]),
                "decoder_layers: taps must ascend within [0, layers)");
  auto linear = [&](int64_t j, const at::Tensor& x, const c10::optional<at::Tensor>& nw,
                    double e, bool swiglu, const c10::optional<at::Tensor>& residual) {
    return run_linear("decoder_layers", kind[j], w[j], sl[j], bias.get(j), n[j], x, nw, e,
                      swiglu, residual);
  };
  const c10::optional<at::Tensor> none;
  std::vector<at::Tensor> out{x_in};
  at::Tensor x = x_in;
  size_t next_tap = 0;
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor qkv = linear(4 * i, x, norm[2 * i], eps[2 * i], false, none);
    const at::Tensor a = decode_step(qkv.view({B, S, hq + 2 * hkv, D}), caches[i], cos, sin,
                                     write_b, write_i, write_pages, write_offsets, table, mask,
                                     hq, scale, qk_norm.get(2 * i), qk_norm.get(2 * i + 1),
                                     qk_eps, new_mask);
    at::Tensor a3 = a.view({B, S, hq * D});
    if (cut && i == L - 1) {  // the last layer's o_proj and MLP: the kept rows only
      a3 = a3.narrow(1, 0, last_rows).contiguous();
      x = x.narrow(1, 0, last_rows).contiguous();
    }
    const at::Tensor h = linear(4 * i + 1, a3, none, 0.0, false, x);
    const at::Tensor gu = linear(4 * i + 2, h, norm[2 * i + 1], eps[2 * i + 1], false, none);
    x = linear(4 * i + 3, gu, none, 0.0, true, h);
    if (next_tap < taps.size() && taps[next_tap] == i) {
      out.push_back(x);
      ++next_tap;
    }
  }
  out[0] = x;
  return out;
}

// A DSpark draft's context update in one call (edgebuild.models.dspark.DSparkDraft.
// context_update): per layer i its packed k/v linear (linear i of w / sl / bias / n / kind) on
// the context rows c [B, S, d_in] with the RMSNorm `norm` inside the call (the draft's
// hidden_norm: C = hidden_norm(fc(F)) feeds every layer's k/v directly), then decode_step with
// no mask: the valid rows' K (k_norm i, RoPE) and V written to caches[i], nothing attended. The
// same op calls with the same inputs as the modules' path (write_context), so the same bits;
// what goes is the Python around each layer's two calls (~0.05 ms a layer in a SmolLM2 draft
// step: a 2-layer update 0.70 -> 0.65 ms). The step inputs are one write plan's, shared by the
// layers (attention_fast.write_step_args).
void context_layers(const at::Tensor& c, at::TensorList caches, at::TensorList w,
                    at::TensorList sl, const c10::List<c10::optional<at::Tensor>>& bias,
                    at::IntArrayRef n, at::IntArrayRef kind, const at::Tensor& norm, double eps,
                    const c10::List<c10::optional<at::Tensor>>& k_norm, double qk_eps,
                    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& write_b,
                    const at::Tensor& write_i, const at::Tensor& write_pages,
                    const at::Tensor& write_offsets, const at::Tensor& table, int64_t hq,
                    double scale) {
  const int64_t L = caches.size();
  TORCH_CHECK(c.dim() == 3 && L > 0 && (int64_t)w.size() == L && (int64_t)sl.size() == L &&
                  (int64_t)bias.size() == L && (int64_t)n.size() == L &&
                  (int64_t)kind.size() == L && (int64_t)k_norm.size() == L,
              "context_layers: c must be [B, S, d]; one k/v linear and one k norm a layer");
  const int64_t B = c.size(0), S = c.size(1), D = caches[0].size(4);
  const c10::optional<at::Tensor> none, nw{norm};
  for (int64_t i = 0; i < L; ++i) {
    const at::Tensor kv =
        run_linear("context_layers", kind[i], w[i], sl[i], bias.get(i), n[i], c, nw, eps, false,
                   none);  // [B, S, 2 Hkv D]
    TORCH_CHECK(kv.size(-1) % D == 0, "context_layers: k/v width ", kv.size(-1),
                " is not whole heads of ", D);
    const at::Tensor heads = at::cat({at::zeros({B, S, hq * D}, kv.options()), kv}, -1);
    decode_step(heads.view({B, S, hq + kv.size(-1) / D, D}), caches[i], cos, sin, write_b,
                write_i, write_pages, write_offsets, table, none, hq, scale, none,
                k_norm.get(i), qk_eps, none);
  }
}

// torch's intra-op threads (which edgebuild's kernel pool sizes itself from) set to 1 while
// alive, when `on` (edgebuild.ops.threads.one_thread's rule, inside one call).
struct OneThread {
  int threads = 0;
  explicit OneThread(bool on) {
    if (on && at::get_num_threads() > 1) {
      threads = at::get_num_threads();
      at::set_num_threads(1);
    }
  }
  ~OneThread() {
    if (threads) at::set_num_threads(threads);
  }
};

using MarkovOp = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
    const c10::optional<at::Tensor>&, double);

// Rows `pos` [N] of the RoPE table (fp32 [max_position, rotary_dim]) as the step's cos and sin,
// fp32 [N, rotary_dim / 2] each: attention_fast._rope_rows' values (copies of the table's).
std::pair<at::Tensor, at::Tensor> rope_rows(const at::Tensor& rope,
                                            const std::vector<int64_t>& pos, const char* op) {
  const int64_t half = rope.size(1) / 2;
  for (int64_t p : pos)
    TORCH_CHECK(p >= 0 && p < rope.size(0), op, ": position ", p, " is outside the RoPE table (",
                rope.size(0), " rows)");
  const at::Tensor idx = at::tensor(pos, at::TensorOptions().dtype(at::kLong));
  const at::Tensor r = rope.index_select(0, idx);
  return {r.narrow(1, 0, half).contiguous(), r.narrow(1, half, half).contiguous()};
}

// A DSpark draft's proposal in one call (edgebuild.runtime.dspark_backend.TorchDraft.
// propose_after_context): the context update (fc of the new rows' target features, then
// context_layers: every layer's K/V written), the block pass (the rows [anchor, mask x (S - 1)]
// embedded, decoder_layers with the block's masks: non-causal, nothing written, the last layer
// cut to last_rows), the final RMSNorm, the draft's lm_head (head_*: its packed call, over the
// token map) and, with walk_k > 0 (a greedy batch), the one-call greedy walk (markov_greedy over
// walk_k candidates, `counts` slots each). Returns [h, base] or [h, base, cand, choice, conf].
// The same op calls on the same inputs as the Python path (update_context, block_forward,
// base_logits, greedy_path), so the same cache bits and outputs (tests/test_draft_program.py);
// what goes is that path's Python: the two step plans, the batch bookkeeping, the embedding, the
// norm's torch calls and the calls' wrappers (~0.8 ms of a SmolLM2 proposal right after a target
// pass, when the interpreter's data comes from memory; bench/README.md, runs of 2026-12-06
// 06:00-07:00 UTC).
//
// features fp32 [C, M, F]: the new rows of the C sequences with ctx_len[b] > 0, in batch order
// (padding rows past ctx_len[b] are projected, never written), or none; sequence b's ctx_len[b]
// new rows sit at cache slots past[b] .. (pages: table [B, pages], int64, its pages already
// reserved); its block at positions past[b] + ctx_len[b] + 0 .. S - 1 attends every cached row.
// ctx_one_thread: the update's linears and writes on one thread (the runtime's rule for a short
// update, dspark_backend.ONE_THREAD_ROWS), the block at the caller's threads.
std::vector<at::Tensor> draft_pass(
    const c10::optional<at::Tensor>& features, at::IntArrayRef ctx_len, int64_t fc_kind,
    const at::Tensor& fc_w, const at::Tensor& fc_sl, const c10::optional<at::Tensor>& fc_bias,
    int64_t fc_n, at::TensorList cw, at::TensorList csl,
    const c10::List<c10::optional<at::Tensor>>& cbias, at::IntArrayRef cn, at::IntArrayRef ckind,
    const at::Tensor& hidden_norm, double hidden_eps,
    const c10::List<c10::optional<at::Tensor>>& k_norm, const at::Tensor& embed,
    at::IntArrayRef anchors, int64_t mask_id, int64_t S, at::TensorList w, at::TensorList sl,
    const c10::List<c10::optional<at::Tensor>>& bias, at::IntArrayRef n, at::IntArrayRef kind,
    at::TensorList norm, at::ArrayRef<double> eps,
    const c10::List<c10::optional<at::Tensor>>& qk_norm, double qk_eps, at::TensorList caches,
    const at::Tensor& table, at::IntArrayRef past, const at::Tensor& rope, int64_t hq,
    int64_t hkv, double scale, int64_t last_rows, const at::Tensor& final_norm,
    double final_eps, bool ctx_one_thread, int64_t head_kind, const at::Tensor& head_w,
    const at::Tensor& head_sl, const c10::optional<at::Tensor>& head_bias, int64_t head_n,
    int64_t walk_k, const c10::optional<at::Tensor>& counts,
    const c10::optional<at::Tensor>& token_map, const c10::optional<at::Tensor>& w1,
    const c10::optional<at::Tensor>& w2, const c10::optional<at::Tensor>& gate_w,
    const c10::optional<at::Tensor>& gate_b, const c10::optional<at::Tensor>& conf_w,
    double conf_b) {
  const char* op = "draft_pass";
  const int64_t B = anchors.size();
  TORCH_CHECK(B > 0 && S > 0 && (int64_t)past.size() == B && (int64_t)ctx_len.size() == B,
              op, ": anchors, past and ctx_len need one entry per sequence, and S > 0");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == B && table.scalar_type() == at::kLong &&
                  table.is_contiguous(),
              op, ": table must be int64 [B, pages]");
  TORCH_CHECK(rope.dim() == 2 && rope.scalar_type() == at::kFloat && rope.is_contiguous(), op,
              ": rope must be fp32 [max_position, rotary_dim]");
  TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == at::kFloat && embed.is_contiguous(),
              op, ": embed must be fp32 [vocab, d]");
  TORCH_CHECK(!caches.empty(), op, ": no KV pools");
  const int64_t ps = caches[0].size(3), P = caches[0].size(0), pages = table.size(1);
  const int64_t half = rope.size(1) / 2;
  const int64_t* tp = table.data_ptr<int64_t>();
  auto slot = [&](int64_t b, int64_t r, int64_t& page, int64_t& off) {
    const int64_t j = r / ps;
    TORCH_CHECK(j < pages, op, ": sequence ", b, " has no page for cache row ", r);
    page = tp[b * pages + j];
    off = r % ps;
    TORCH_CHECK(page >= 0 && page < P, op, ": sequence ", b, " row ", r, " is on page ", page,
                " outside the pool");
  };
  const auto lopt = at::TensorOptions().dtype(at::kLong);
  const c10::optional<at::Tensor> none;
  // 1. the context update
  int64_t ctx_rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ctx_len[b] >= 0 && past[b] >= 0, op, ": negative past / ctx_len");
    ctx_rows += ctx_len[b];
  }
  if (ctx_rows > 0) {  // a batch of the sequences that add rows (features' rows, in order)
    std::vector<int64_t> adds;
    for (int64_t b = 0; b < B; ++b)
      if (ctx_len[b] > 0) adds.push_back(b);
    const int64_t C = adds.size();
    TORCH_CHECK(features.has_value() && features->dim() == 3 && features->size(0) == C, op,
                ": features must be [sequences adding rows = ", C, ", M, F]");
    const int64_t M = features->size(1);
    std::vector<int64_t> pos, wb, wi, wp, wo;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t b = adds[c];
      TORCH_CHECK(ctx_len[b] <= M, op, ": sequence ", b, " adds ", ctx_len[b], " rows of ", M);
      for (int64_t i = 0; i < M; ++i)  // a padding row's position: any valid one (unread)
        pos.push_back(past[b] + std::min(i, ctx_len[b] - 1));
      for (int64_t i = 0; i < ctx_len[b]; ++i) {
        int64_t page, off;
        slot(b, past[b] + i, page, off);
        wb.push_back(c), wi.push_back(i), wp.push_back(page), wo.push_back(off);
      }
    }
    auto [cos, sin] = rope_rows(rope, pos, op);
    const at::Tensor ctable =
        C == B ? table : table.index_select(0, at::tensor(adds, lopt)).contiguous();
    OneThread alone(ctx_one_thread);
    const at::Tensor c = run_linear(op, fc_kind, fc_w, fc_sl, fc_bias, fc_n,
                                    features->to(at::kFloat), none, 0.0, false, none);
    context_layers(c, caches, cw, csl, cbias, cn, ckind, hidden_norm, hidden_eps, k_norm, qk_eps,
                   cos.view({C, M, half}), sin.view({C, M, half}), at::tensor(wb, lopt),
                   at::tensor(wi, lopt), at::tensor(wp, lopt), at::tensor(wo, lopt), ctable, hq,
                   scale);
  }
  // 2. the block pass: [anchor, mask x (S - 1)] at the slots after the context
  std::vector<int64_t> ids, pos, wb, wi;
  int64_t width = 0;  // the cached key columns (the widest sequence's context)
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = past[b] + ctx_len[b];
    width = std::max(width, s);
    for (int64_t i = 0; i < S; ++i) {
      ids.push_back(i == 0 ? anchors[b] : mask_id);
      pos.push_back(s + i);
      wb.push_back(b), wi.push_back(i);
    }
  }
  for (int64_t id : ids)
    TORCH_CHECK(id >= 0 && id < embed.size(0), op, ": token id ", id,
                " is outside the embedding");
  const at::Tensor x = embed.index_select(0, at::tensor(ids, lopt)).view({B, S, embed.size(1)});
  auto [cos, sin] = rope_rows(rope, pos, op);
  auto mask = at::zeros({B * S, width}, at::TensorOptions().dtype(at::kBool));
  bool* mp = mask.data_ptr<bool>();
  for (int64_t r = 0; r < B * S; ++r)
    for (int64_t t = 0; t < past[wb[r]] + ctx_len[wb[r]]; ++t) mp[r * width + t] = true;
  const at::Tensor zero = at::zeros({B * S}, lopt);  // a block writes nothing: no slots
  const std::vector<at::Tensor> outs = decoder_layers(
      x, caches, w, sl, bias, n, kind, norm, eps, qk_norm, qk_eps, cos.view({B, S, half}),
      sin.view({B, S, half}), at::tensor(wb, lopt), at::tensor(wi, lopt), zero, zero, table,
      mask, hq, hkv, scale, {}, at::ones({B * S, S}, at::TensorOptions().dtype(at::kBool)),
      last_rows > 0 && last_rows < S ? last_rows : 0);
  // 3. the final norm as edgebuild.ops.norm.rms_norm's torch ops (the same bits)
  const at::Tensor& y = outs[0];
  at::Tensor hidden = y.to(at::kFloat);
  const at::Tensor variance = hidden.pow(2).mean(-1, true);
  hidden = hidden * at::rsqrt(variance + final_eps);
  const at::Tensor h = final_norm * hidden.to(y.scalar_type());
  // 4. the draft's lm_head (over its token map) and, for a greedy batch, the walk
  const at::Tensor base =
      run_linear(op, head_kind, head_w, head_sl, head_bias, head_n, h.to(at::kFloat), none, 0.0,
                 false, none).to(at::kFloat);
  if (walk_k <= 0) return {h, base};
  static const auto markov = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("edgebuild_f32::markov_greedy", "")
                                 .typed<MarkovOp>();
  OneThread walk_alone(true);
  TORCH_CHECK(counts.has_value(), op, ": a walk needs counts");
  auto [cand, choice, conf] =
      markov.call(base, at::tensor(std::vector<int64_t>(anchors.begin(), anchors.end()), lopt),
                  *counts, walk_k, token_map, w1, w2, gate_w, gate_b, h, conf_w, conf_b);
  return {h, base, cand, choice, conf};
}

}  // namespace

TORCH_LIBRARY(edgebuild_attn, m) {
  m.def("decode_attention(Tensor q, Tensor cache, Tensor page_table, Tensor row_b, Tensor mask, "
        "float scale) -> Tensor");
  m.def("decode_step(Tensor heads, Tensor(a!) cache, Tensor cos, Tensor sin, Tensor write_b, "
        "Tensor write_i, Tensor write_pages, Tensor write_offsets, Tensor page_table, "
        "Tensor? mask, int hq, float scale, Tensor? q_norm=None, Tensor? k_norm=None, "
        "float eps=0., Tensor? new_mask=None) -> Tensor");
  m.def("decoder_layers(Tensor x, Tensor(a!)[] caches, Tensor[] w, Tensor[] sl, Tensor?[] bias, "
        "int[] n, int[] kind, Tensor[] norm, float[] eps, Tensor?[] qk_norm, float qk_eps, "
        "Tensor cos, Tensor sin, Tensor write_b, Tensor write_i, Tensor write_pages, "
        "Tensor write_offsets, Tensor table, Tensor mask, int hq, int hkv, float scale, "
        "int[] taps, Tensor? new_mask=None, int last_rows=0) -> Tensor[]");
  m.def("context_layers(Tensor c, Tensor(a!)[] caches, Tensor[] w, Tensor[] sl, Tensor?[] bias, "
        "int[] n, int[] kind, Tensor norm, float eps, Tensor?[] k_norm, float qk_eps, "
        "Tensor cos, Tensor sin, Tensor write_b, Tensor write_i, Tensor write_pages, "
        "Tensor write_offsets, Tensor table, int hq, float scale) -> ()");
  m.def("draft_pass(Tensor? features, int[] ctx_len, int fc_kind, Tensor fc_w, Tensor fc_sl, "
        "Tensor? fc_bias, int fc_n, Tensor[] cw, Tensor[] csl, Tensor?[] cbias, int[] cn, "
        "int[] ckind, Tensor hidden_norm, float hidden_eps, Tensor?[] k_norm, Tensor embed, "
        "int[] anchors, int mask_id, int S, Tensor[] w, Tensor[] sl, Tensor?[] bias, int[] n, "
        "int[] kind, Tensor[] norm, float[] eps, Tensor?[] qk_norm, float qk_eps, "
        "Tensor(a!)[] caches, Tensor table, int[] past, Tensor rope, int hq, int hkv, "
        "float scale, int last_rows, Tensor final_norm, float final_eps, bool ctx_one_thread, "
        "int head_kind, Tensor head_w, Tensor head_sl, Tensor? head_bias, int head_n, "
        "int walk_k, Tensor? counts, Tensor? token_map, Tensor? w1, Tensor? w2, "
        "Tensor? gate_w, Tensor? gate_b, Tensor? conf_w, float conf_b) -> Tensor[]");
}
TORCH_LIBRARY_IMPL(edgebuild_attn, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_step", &decode_step);
  m.impl("decoder_layers", &decoder_layers);
  m.impl("context_layers", &context_layers);
  m.impl("draft_pass", &draft_pass);
}
