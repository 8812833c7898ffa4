// fp32 linear for edgebuild's CPU runtime on any x86-64 CPU with AVX2 + FMA
// (edgebuild.ops.f32_linear): y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32 throughout.
//
// Why: fp32 is the compute dtype on every CPU without native bf16 (most laptops: AVX2 only),
// and there neither MKL nor oneDNN gave DSpark what it needs:
//   * a verify pass of a few rows cost much more than a decode: a 2-row fp32 verify 1.57x a
//     1-row decode, 8 rows 1.96x (edgebuild/data/step_costs.json), although both read the same
//     weights once; so fp32 DSpark was slower than target-only (x0.88, issue 26);
//   * a row's bits changed with the number of rows in the call (MKL's gemv for one row, gemm
//     for more), so fp32 DSpark's output could differ from target-only's at near-ties.
// Here the weight is packed once into blocks of 16 output features, k-major ([N/16, K, 16]);
// each 16-output block is read once from memory for up to 6 rows at a time (more rows re-read
// it from cache), and every row runs the same instruction sequence whatever the rows beside it:
// for each output, each chunk of 32 k is summed by FMAs in increasing k in a fresh accumulator
// (where the CPU has AVX-512: in two, the chunk's even and its odd k, added at its end;
// block_rows_avx512) and added to the running total, then + bias. So a row's result never
// depends on the other rows of the call, nor on the thread count (threads split the output
// blocks), which makes fp32 DSpark's verify rows equal target-only's decode rows bit for bit.
//
// No -ffast-math (it would let the compiler reassociate the sums).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "pool.h"
#include "simd_math.h"

namespace {

constexpr int64_t kBlock = 16;  // output features per packed block (two AVX2 vectors)
// k per chunk: each chunk is summed in fresh accumulators, then added to the running total, so a
// sum of K products carries ~(kChunk + K / kChunk) roundings instead of K: one long FMA chain
// was 2-3x less accurate than MKL (rms 2.8e-8 against 1.0-1.7e-8 of sum |x w|), enough for a
// 30-layer NVFP4 model's fp32 logits to leave the onnxruntime parity tolerance (4.8e-3 > 3e-3).
constexpr int64_t kChunk = 32;

// Where a block's weights come from: fp32 or bf16 (packed [K, 16]), or int4 (codes + scale / lo
// per group, widened to fp32 here). start(k0) is called at each chunk of kChunk k; load(k, w0,
// w1) gives input k's 16 weights as two fp32 vectors; at(k) is input k's first byte (prefetch).
template <typename T>
struct BlockWeights {  // a [K, 16] block of T, 16 values per input k
  const T* wb;
  static constexpr int64_t kBytesPerK = kBlock * sizeof(T);
  inline const char* at(int64_t k) const { return reinterpret_cast<const char*>(wb + k * kBlock); }
  inline void start(int64_t) {}
};

struct F32Weights : BlockWeights<float> {
  inline void load(int64_t k, __m256& w0, __m256& w1) const {
    w0 = _mm256_loadu_ps(wb + k * kBlock);
    w1 = _mm256_loadu_ps(wb + k * kBlock + 8);
  }
};

// bf16 weights (f32_linear.pack of a weight whose every value is a bf16, as a bf16 checkpoint
// run in fp32 is): the same [K, 16] block in half the bytes. A bf16 value widened to fp32 is
// exact (its 16 bits are the fp32 value's high half), so the FMAs see the same fp32 weights and
// the results are the fp32 layout's bit for bit; a 1-row call, which streams its weights from
// memory, reads half as many bytes. The 16 bf16 of input k are stored as outputs
// 0-3, 8-11, 4-7, 12-15, so that unpacking against zero (per 128-bit lane) puts outputs 0-7 in
// w0 and 8-15 in w1 (two in-lane uops, no lane crossing).
struct BF16Weights : BlockWeights<uint16_t> {
  inline void load(int64_t k, __m256& w0, __m256& w1) const {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + k * kBlock));
    const __m256i z = _mm256_setzero_si256();
    w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
  }
};

// Software prefetch of fp32 / bf16 weights into L2 in calls of kPrefetchRows rows or more (a
// verify pass). Such a call spends longer on each weight line than the hardware prefetcher
// expects, so without it memory and FMAs did not overlap. All linears of a SmolLM2 token,
// streamed from memory (bf16 weights, Zen 4, 1 thread; bench/README.md, runs of 2026-12-05 and
// 2026-12-06): prefetch to L1 2 KiB ahead from 3 rows took 6 rows 27.9 -> 20 ms and 8 rows
// 39 -> 26.6 ms, but slowed 1-2 rows; to L2 16 KiB ahead (8-32 KiB alike) it takes 2 rows
// 14.1 -> 12.7 ms, 3 rows 16.0 -> 13.8, 6 rows 20.7 -> 17.9 against the L1 prefetch, and at 2
// threads 2 rows 8.3 -> 7.9, 3 rows 8.8 -> 8.2. One row, memory-bound, gains nothing (slower at
// 2 threads): not prefetched. Prefetching changes no arithmetic: the bits are the same.
constexpr int64_t kPrefetchRows = 2;
constexpr int64_t kPrefetchBytes = 16384;

// MR rows (1..6) x one block of 16 outputs over all of K: 2 * MR accumulators, 2 weight vectors
// and 1 broadcast (15 of the 16 ymm registers at MR = 6). Per output and chunk of kChunk k, one
// accumulator fed by FMAs in increasing k, then added to the total on the stack: the same
// sequence for a row whatever MR is. One row is 2 FMA chains (~48 GB/s
// of weights at 3 GHz, above what one core reads from memory); 6 rows keep both FMA units busy.
template <int MR, typename Weights>
__attribute__((target("avx2,fma"))) inline void block_rows(const float* x, int64_t ldx, int64_t K,
                                                           Weights w, const float* bias,
                                                           float* y, int64_t ldy, int64_t n_out,
                                                           bool prefetch) {
  // Named accumulators, not an array: GCC 12 kept an array of __m256 on the stack and stored
  // every accumulator back each k (store-bound: 8 rows ran at ~0.5 FMA a cycle).
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
#define EB_ROW(m)                                                    \
  if constexpr (MR > m) {                                            \
    const __m256 xk = _mm256_broadcast_ss(x + m * ldx + k);          \
    a##m##0 = _mm256_fmadd_ps(xk, w0, a##m##0);                      \
    a##m##1 = _mm256_fmadd_ps(xk, w1, a##m##1);                      \
  }
  alignas(32) float tot[MR][kBlock];  // the chunks' sums so far, per row and output
  for (int m = 0; m < MR; ++m) std::fill(tot[m], tot[m] + kBlock, 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min<int64_t>(K, k0 + kChunk);
    w.start(k0);
    if constexpr (Weights::kBytesPerK > 0) {  // this chunk's bytes, kPrefetchBytes ahead, to L2
      if (prefetch)
        for (int64_t off = 0; off < kChunk * Weights::kBytesPerK; off += 64)
          _mm_prefetch(w.at(k0) + kPrefetchBytes + off, _MM_HINT_T1);
    }
    a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = a40 = a41 = a50 = a51 = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      __m256 w0, w1;
      w.load(k, w0, w1);
      EB_ROW(0) EB_ROW(1) EB_ROW(2) EB_ROW(3) EB_ROW(4) EB_ROW(5)
    }
    const __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21},
                              {a30, a31}, {a40, a41}, {a50, a51}};
    for (int m = 0; m < MR; ++m) {
      _mm256_store_ps(tot[m], _mm256_add_ps(_mm256_load_ps(tot[m]), acc[m][0]));
      _mm256_store_ps(tot[m] + 8, _mm256_add_ps(_mm256_load_ps(tot[m] + 8), acc[m][1]));
    }
  }
#undef EB_ROW
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    alignas(32) float out[kBlock];
    _mm256_store_ps(out, _mm256_add_ps(_mm256_load_ps(tot[m]), b0));
    _mm256_store_ps(out + 8, _mm256_add_ps(_mm256_load_ps(tot[m] + 8), b1));
    std::copy(out, out + n_out, y + m * ldy);  // the last block may hold fewer than 16 outputs
  }
}

// rows x one block: groups of kMaxRows rows, then the remainder (each row's sequence is the
// same in any group size).
constexpr int kMaxRows = 6;
// f(std::integral_constant<int, MR>, m) for each group of MR rows starting at row m.
template <typename F>
inline void row_groups(int64_t rows, F&& f) {
  for (int64_t m = 0; m < rows; m += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, rows - m)) {
      case 1: f(std::integral_constant<int, 1>{}, m); break;
      case 2: f(std::integral_constant<int, 2>{}, m); break;
      case 3: f(std::integral_constant<int, 3>{}, m); break;
      case 4: f(std::integral_constant<int, 4>{}, m); break;
      case 5: f(std::integral_constant<int, 5>{}, m); break;
      default: f(std::integral_constant<int, 6>{}, m); break;
    }
  }
}
template <typename Weights>
inline void all_rows(const float* x, int64_t rows, int64_t K, const Weights& w, const float* bias,
                     float* y, int64_t ldy, int64_t n_out) {
  const bool prefetch = rows >= kPrefetchRows;
  row_groups(rows, [&](auto mr, int64_t m) {
    block_rows<decltype(mr)::value>(x + m * K, K, K, w, bias, y + m * ldy, ldy, n_out, prefetch);
  });
}

// ------------------------------------------------- fp32 / bf16 weights, the AVX-512 loop
// Where the CPU has AVX-512 (f32_avx512_on), fp32 and bf16 weights run this loop instead of
// block_rows: a block's 16 outputs in one zmm, and per output and chunk of kChunk k two
// accumulators, one for the chunk's even k and one for its odd k (each fed by FMAs in
// increasing k), added at the chunk's end, then to the running total; then + bias. The two
// chains halve the FMA latency each row waits on: in block_rows one row is 2 chains of 4-cycle
// FMAs, and 1-3 rows leave the FMA units idle, so a 3-row verify pass's products did not hide
// under its weight stream. All linears of a SmolLM2 token (bench/f32_linears.py: bf16 weights
// streamed from memory, the loops alternated in one process; Zen 4, bench/README.md, runs of
// 2026-12-06 11:40-13:02 UTC), medians: 3 rows 8-21% faster at one thread (22.4 -> 18.3 ms
// where one row took 16.8), 2-8 rows 6-29%; at two threads 6-28%; one row, at its memory
// floor, not slower. 32 zmm registers hold 6 rows' 12 accumulators and totals; with 16 ymm two
// chains fit 3 rows only, and 4-6 rows in two passes ran 8-15% slower, so CPUs without
// AVX-512 keep block_rows. The two loops' sums differ in their last bits; within one loop a
// row's bits depend neither on the rows beside it nor on the thread count.
struct ZF32Weights {  // fp32 [K, 16]: one 64-byte load, outputs in order
  const float* wb;
  static constexpr int64_t kBytesPerK = kBlock * sizeof(float);
  static constexpr bool kPermuted = false;
  inline const char* at(int64_t k) const { return reinterpret_cast<const char*>(wb + k * kBlock); }
  __attribute__((target("avx512f"))) inline __m512 load(int64_t k) const {
    return _mm512_loadu_ps(wb + k * kBlock);
  }
};
// bf16 [K, 16] in the stored order 0-3, 8-11, 4-7, 12-15 (pack): zero-extended and shifted into
// fp32 (exact), the lanes keep that order; the totals are put in output order at the end.
struct ZBF16Weights {
  const uint16_t* wb;
  static constexpr int64_t kBytesPerK = kBlock * sizeof(uint16_t);
  static constexpr bool kPermuted = true;
  inline const char* at(int64_t k) const { return reinterpret_cast<const char*>(wb + k * kBlock); }
  __attribute__((target("avx512f"))) inline __m512 load(int64_t k) const {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + k * kBlock));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
};

// MR rows (1..6) x one block of 16 outputs over all of K (the loop above the structs).
template <int MR, typename Weights>
__attribute__((target("avx512f"))) inline void block_rows_avx512(
    const float* x, int64_t ldx, int64_t K, Weights w, const float* bias, float* y, int64_t ldy,
    int64_t n_out, bool prefetch) {
  // named registers, as in block_rows (an array was kept on the stack)
  __m512 e0 = _mm512_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, e4 = e0, e5 = e0;  // even k
  __m512 o0 = e0, o1 = e0, o2 = e0, o3 = e0, o4 = e0, o5 = e0;                    // odd k
  __m512 t0 = e0, t1 = e0, t2 = e0, t3 = e0, t4 = e0, t5 = e0;                    // totals
#define EB_ZROW(m, A, k)                                                    \
  if constexpr (MR > m) {                                                   \
    A##m = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + (k)]), wk, A##m);   \
  }
#define EB_ZSTEP(A, k)                                                                     \
  {                                                                                        \
    const __m512 wk = w.load(k);                                                           \
    EB_ZROW(0, A, k) EB_ZROW(1, A, k) EB_ZROW(2, A, k) EB_ZROW(3, A, k) EB_ZROW(4, A, k) \
    EB_ZROW(5, A, k)                                                                       \
  }
#define EB_ZTOT(m) \
  if constexpr (MR > m) t##m = _mm512_add_ps(t##m, _mm512_add_ps(e##m, o##m));
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min<int64_t>(K, k0 + kChunk);
    if (prefetch)  // this chunk's bytes, kPrefetchBytes ahead, to L2 (as block_rows)
      for (int64_t off = 0; off < kChunk * Weights::kBytesPerK; off += 64)
        _mm_prefetch(w.at(k0) + kPrefetchBytes + off, _MM_HINT_T1);
    e0 = e1 = e2 = e3 = e4 = e5 = o0 = o1 = o2 = o3 = o4 = o5 = _mm512_setzero_ps();
    int64_t k = k0;
    for (; k + 2 <= k1; k += 2) {
      EB_ZSTEP(e, k)
      EB_ZSTEP(o, k + 1)
    }
    if (k < k1) EB_ZSTEP(e, k)  // an odd-length last chunk: its last k is even
    EB_ZTOT(0) EB_ZTOT(1) EB_ZTOT(2) EB_ZTOT(3) EB_ZTOT(4) EB_ZTOT(5)
  }
#undef EB_ZROW
#undef EB_ZSTEP
#undef EB_ZTOT
  const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 tot[6] = {t0, t1, t2, t3, t4, t5};
  for (int m = 0; m < MR; ++m) {
    const __m512 t = Weights::kPermuted ? _mm512_permutexvar_ps(order, tot[m]) : tot[m];
    alignas(64) float out[kBlock];
    _mm512_store_ps(out, _mm512_add_ps(t, b));
    std::copy(out, out + n_out, y + m * ldy);  // the last block may hold fewer than 16 outputs
  }
}

// rows x one block with the AVX-512 loop: groups of 6 rows, then the remainder.
template <typename Weights>
inline void all_rows_avx512(const float* x, int64_t rows, int64_t K, const Weights& w,
                            const float* bias, float* y, int64_t ldy, int64_t n_out) {
  const bool prefetch = rows >= kPrefetchRows;
  row_groups(rows, [&](auto mr, int64_t m) {
    block_rows_avx512<decltype(mr)::value>(x + m * K, K, K, w, bias, y + m * ldy, ldy, n_out,
                                           prefetch);
  });
}

// Whether the CPU has AVX-512F (the fp32 kernel's zmm loop; the W4A8 prefetch distance).
bool has_avx512f() {
  static const bool has = [] {
    __builtin_cpu_init();  // a static initializer may run before libgcc's own
    return __builtin_cpu_supports("avx512f");
  }();
  return has;
}
// A kernel loop taken where the CPU has what it needs, unless its environment variable is "0"
// (read once, at the first call); set(op, 0 / 1) switches it for the process (tests run both
// loops in one process; 1 only where the CPU has it), set(op, -1) only reads it. One relaxed
// load a call.
struct LoopSwitch {
  const char* env;
  bool (*supported)();
  std::atomic<int> state{-1};
  bool on() {
    int v = state.load(std::memory_order_relaxed);
    if (v < 0) {
      const char* e = std::getenv(env);
      v = supported() && !(e && e[0] == '0');
      state.store(v, std::memory_order_relaxed);
    }
    return v;
  }
  bool set(const char* op, int64_t mode) {
    TORCH_CHECK(mode >= -1 && mode <= 1, op, ": mode must be -1, 0 or 1, got ", mode);
    if (mode >= 0) state.store(mode == 1 && supported(), std::memory_order_relaxed);
    return on();
  }
};
// Which loop f32_linear runs: the AVX-512 one where the CPU has it (EDGEBUILD_FP32_AVX512=0:
// the AVX2 one); f32_avx512(mode) is the op tests switch it with.
LoopSwitch g_f32_avx512{"EDGEBUILD_FP32_AVX512", has_avx512f};
bool f32_avx512_on() { return g_f32_avx512.on(); }
bool f32_avx512(int64_t mode) { return g_f32_avx512.set("f32_avx512", mode); }

// The checks and the bias both ops share: out n must fill the last of NB blocks; the bias (if
// any) is fp32 [16 * NB] (f32_linear.pack_bias); returns its data (nullptr: none), kept alive
// in `keep`.
const float* checked_bias(const char* op, const c10::optional<at::Tensor>& bias, int64_t n,
                          int64_t NB, at::Tensor& keep) {
  TORCH_CHECK(n > (NB - 1) * kBlock && n <= NB * kBlock, op, ": out ", n, " does not match ", NB,
              " blocks of 16");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kFloat && keep.numel() == NB * kBlock, op,
              ": bias must be fp32 [16 * blocks] (f32_linear.pack_bias)");
  return keep.data_ptr<float>();
}

// ---------------------------------------------------------------- fused input / output steps
// A decoder layer's small ops run inside its linears' calls (edgebuild.ops.linear.PackedLinear):
// the input rows can be RMSNorm'ed (input_layernorm before q/k/v, post_attention_layernorm
// before gate/up, the final norm before lm_head) or SwiGLU'ed (silu(gate) * up before
// down_proj), and the output can be added to a residual. In torch ops these were ~20 calls a
// layer, ~40% of an int4 decode step at one thread (bench/README.md). Every row is computed on
// its own, so the ops stay row-invariant.

// HF's RMSNorm of one row (LlamaRMSNorm, fp32): w * (x * rsqrt(mean(x^2) + eps)). The sum of
// squares is accumulated in fp64 (so it is the fp32 rounding of the exact mean, where torch's
// fp32 sum may differ from it in the last bits); the rest as torch's fp32 ops round it.
__attribute__((target("avx2,fma"))) void rms_norm_row(const float* x, const float* w, float eps,
                                                      int64_t K, float* h) {
  __m256d s0 = _mm256_setzero_pd(), s1 = s0;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    s0 = _mm256_fmadd_pd(lo, lo, s0);
    s1 = _mm256_fmadd_pd(hi, hi, s1);
  }
  alignas(32) double part[4];
  _mm256_store_pd(part, _mm256_add_pd(s0, s1));
  double ss = (part[0] + part[1]) + (part[2] + part[3]);
  for (; k < K; ++k) ss += static_cast<double>(x[k]) * x[k];
  const float var = static_cast<float>(ss / static_cast<double>(K));
  const float r = 1.0f / std::sqrt(var + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (k = 0; k + 8 <= K; k += 8)
    _mm256_storeu_ps(h + k, _mm256_mul_ps(_mm256_loadu_ps(w + k),
                                          _mm256_mul_ps(_mm256_loadu_ps(x + k), rv)));
  for (; k < K; ++k) h[k] = w[k] * (x[k] * r);
}

// silu(gate) * up of one row (gate = x[0..K), up = x[K..2K)): g / (1 + exp(-g)) * u.
__attribute__((target("avx2,fma"))) void swiglu_row(const float* x, int64_t K, float* h) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 g = _mm256_loadu_ps(x + k);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(h + k, _mm256_mul_ps(s, _mm256_loadu_ps(x + K + k)));
  }
  for (; k < K; ++k) h[k] = x[k] / (1.0f + std::exp(-x[k])) * x[K + k];
}

// The rows the kernel multiplies, as [rows, K]: x itself (x [..., K], leading dims flattened),
// its RMSNorm with `norm_w` ([K]), or its SwiGLU (x [..., 2K] = gate | up). Checks name the op
// and the argument.
at::Tensor kernel_input(const char* op, const at::Tensor& x_in, int64_t K,
                        const c10::optional<at::Tensor>& norm_w, double eps, bool swiglu) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.scalar_type() == at::kFloat, op,
              ": x must be fp32 [..., in]");
  const bool norm = norm_w.has_value() && norm_w->defined();
  TORCH_CHECK(!(norm && swiglu), op, ": norm_weight and swiglu cannot both be given");
  const int64_t width = swiglu ? 2 * K : K;
  TORCH_CHECK(x_in.size(-1) == width, op, ": x has ", x_in.size(-1), " inputs, the weight ", K,
              swiglu ? " (swiglu: x must be gate | up, 2 * in wide)" : "");
  at::Tensor x = x_in.reshape({-1, width}).contiguous();
  if (!norm && !swiglu) return x;
  const int64_t rows = x.size(0);
  auto h = at::empty({rows, K}, x.options());
  const float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  if (norm) {
    const at::Tensor w = norm_w->contiguous();
    TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.size(0) == K, op,
                ": norm_weight must be fp32 [", K, "]");
    const float* wp = w.data_ptr<float>();
    for (int64_t m = 0; m < rows; ++m)
      rms_norm_row(xp + m * K, wp, static_cast<float>(eps), K, hp + m * K);
  } else {
    for (int64_t m = 0; m < rows; ++m) swiglu_row(xp + m * 2 * K, K, hp + m * K);
  }
  return h;
}

// y [rows, n] as the op returns it: x's leading dims, then n.
at::Tensor out_shaped(const at::Tensor& y, const at::Tensor& x_in, int64_t n) {
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = n;
  return y.view(shape);
}

// y = residual + y (elementwise, as torch's `residual + linear(x)`; the same shape as y).
void add_residual(const char* op, at::Tensor& y, const c10::optional<at::Tensor>& residual) {
  if (!residual.has_value() || !residual->defined()) return;
  const at::Tensor r = residual->contiguous();
  TORCH_CHECK(r.scalar_type() == at::kFloat && r.sizes() == y.sizes(), op,
              ": residual must be fp32 ", y.sizes(), ", got ", r.scalar_type(), " ", r.sizes());
  const float* rp = r.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0, n = y.numel(); i < n; ++i) yp[i] = rp[i] + yp[i];
}

at::Tensor f32_linear(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                      int64_t n, const c10::optional<at::Tensor>& norm_w, double eps, bool swiglu,
                      const c10::optional<at::Tensor>& residual) {
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w.dim() == 3 && (w.scalar_type() == at::kFloat || bf16) && w.size(2) == kBlock &&
                  w.is_contiguous(),
              "f32_linear: w must be fp32 or bf16 [ceil(out / 16), in, 16] (f32_linear.pack)");
  const int64_t K = w.size(1), NB = w.size(0);
  const at::Tensor x = kernel_input("f32_linear", x_in, K, norm_w, eps, swiglu);
  const int64_t rows = x.size(0);
  at::Tensor b;
  const float* bp = checked_bias("f32_linear", bias, n, NB, b);
  auto y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out_shaped(y, x_in, n);
  const float* xp = x.data_ptr<float>();
  const void* wp = w.data_ptr();
  float* yp = y.data_ptr<float>();
  const bool z = f32_avx512_on();
  auto work = [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const float* bb = bp ? bp + blk * kBlock : nullptr;
      const int64_t n_out = std::min<int64_t>(kBlock, n - blk * kBlock);
      float* yb = yp + blk * kBlock;
      if (bf16) {
        const uint16_t* wb = static_cast<const uint16_t*>(wp) + blk * K * kBlock;
        if (z) all_rows_avx512(xp, rows, K, ZBF16Weights{wb}, bb, yb, n, n_out);
        else all_rows(xp, rows, K, BF16Weights{{wb}}, bb, yb, n, n_out);
      } else {
        const float* wb = static_cast<const float*>(wp) + blk * K * kBlock;
        if (z) all_rows_avx512(xp, rows, K, ZF32Weights{wb}, bb, yb, n, n_out);
        else all_rows(xp, rows, K, F32Weights{{wb}}, bb, yb, n, n_out);
      }
    }
  };
  eb_pool::parallel_for(NB, 4, work);  // each output is computed by one thread: same bits
  y = out_shaped(y, x_in, n);
  add_residual("f32_linear", y, residual);
  return y;
}

// ---------------------------------------------------------------- int4 weights, fp32 inputs
// The same kernel for `--quant int4` on an fp32 runtime (edgebuild.ops.f32_linear.pack_int4):
// per block of 16 outputs and k, 8 bytes hold the 16 codes (byte j: output j in the low
// nibble, output 8 + j in the high one); per block and group of 32 k, the 16 scales and 16
// `lo` (= zero - 8 * scale, so w = code * scale + lo = (code - 8) * scale + zero). Each k's 16
// weights are widened to fp32 once (cvtepu8 -> and / shift -> cvtdq2ps -> one FMA with scale
// and lo) and used by up to 6 rows; a group is one chunk of the fp32 kernel's chunked sum.
// Weight bytes per step are 1/8 of fp32's (+ 1/4 for the scales), and a row's bits never
// depend on the rows beside it or on the thread count, as in the fp32 kernel.
constexpr int64_t kGroup = 32;

static_assert(kChunk == kGroup, "an int4 group must be one chunk of the sum");
struct Int4Weights {
  static constexpr int64_t kBytesPerK = 0;  // no software prefetch (compute-bound)
  inline const char* at(int64_t) const { return nullptr; }
  const uint8_t* cb;  // [K, 8] codes of the block
  const float* sl;    // [K / 32, 2, 16] scale, lo of the block
  __m256 s0, s1, l0, l1;
  inline void start(int64_t k0) {
    const float* gs = sl + (k0 / kGroup) * 2 * kBlock;  // scale 0..15, then lo 0..15
    s0 = _mm256_loadu_ps(gs), s1 = _mm256_loadu_ps(gs + 8);
    l0 = _mm256_loadu_ps(gs + 16), l1 = _mm256_loadu_ps(gs + 24);
  }
  inline void load(int64_t k, __m256& w0, __m256& w1) const {
    const __m256i b =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cb + k * 8)));
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F))), s0, l0);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), s1, l1);
  }
};

at::Tensor int4_f32_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& sl,
                           const c10::optional<at::Tensor>& bias, int64_t n,
                           const c10::optional<at::Tensor>& norm_w, double eps, bool swiglu,
                           const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(2) == 8 &&
                  codes.is_contiguous(),
              "int4_f32_linear: codes must be uint8 [ceil(out / 16), in, 8] (pack_int4)");
  const int64_t K = codes.size(1), NB = codes.size(0);
  TORCH_CHECK(K % kGroup == 0, "int4_f32_linear: in (", K, ") must be a multiple of 32");
  TORCH_CHECK(sl.dim() == 4 && sl.scalar_type() == at::kFloat && sl.size(0) == NB &&
                  sl.size(1) == K / kGroup && sl.size(2) == 2 && sl.size(3) == kBlock &&
                  sl.is_contiguous(),
              "int4_f32_linear: scales must be fp32 [blocks, in / 32, 2, 16] (pack_int4)");
  const at::Tensor x = kernel_input("int4_f32_linear", x_in, K, norm_w, eps, swiglu);
  const int64_t rows = x.size(0);
  at::Tensor b;
  const float* bp = checked_bias("int4_f32_linear", bias, n, NB, b);
  auto y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out_shaped(y, x_in, n);
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = sl.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto work = [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const uint8_t* cb = cp + blk * K * 8;
      const float* sb = sp + blk * (K / kGroup) * 2 * kBlock;
      const float* bb = bp ? bp + blk * kBlock : nullptr;
      const int64_t n_out = std::min<int64_t>(kBlock, n - blk * kBlock);
      all_rows(xp, rows, K, Int4Weights{cb, sb, {}, {}, {}, {}}, bb, yp + blk * kBlock, n, n_out);
    }
  };
  eb_pool::parallel_for(NB, 4, work);
  y = out_shaped(y, x_in, n);
  add_residual("int4_f32_linear", y, residual);
  return y;
}

// ------------------------------------------------- int4 weights, int8 inputs (W4A8, AVX2)
// `--quant int4` on an fp32 runtime with the activations quantized to int8 in the op
// (edgebuild.ops.f32_linear.pack_int4_a8 / linear_int4 with int8_inputs), as llama.cpp's Q4_1 x Q8_1 dot
// product and onnxruntime's MatMulNBits at accuracy_level 4 do. Why: the fp32-input kernel
// above widens every code to fp32 and spends ~9 vector uops per 16 products at one row
// (compute-bound, ~13 ms for SmolLM2-135M's int4 linears per token); here 64 products cost
// ~3 shared unpack uops + 2 vpmaddubsw + 2 vpaddw per row.
//
// Activations (a8_quantize_rows, one call per op, before the threads start): per row and group
// of 32 inputs, sx = max|x| / 127 (fp32), xq = round-half-even(x / sx) (int8, |xq| <= 127),
// and ms = sx * sum(xq) (fp32, the sum exact in int). A group of zeros has sx = xq = ms = 0; a
// group with a NaN or an inf has sx = ms = NaN (its outputs become NaN, as in fp32).
//
// Weights (pack_int4_a8): codes [blocks, K / 32, 2, 128]: per block of 16 outputs, group g of
// 32 k and half h (outputs 8 h .. 8 h + 7), 4 steps s (k = 32 g + 8 s .. + 7) of 32 bytes,
// whose byte 4 j + i holds output j's code for k = 32 g + 8 s + i in its low nibble and for
// k + 4 in its high one. So one 32-byte load is 8 outputs x 8 k: `and 0x0F` and
// `srli 4; and 0x0F` make u8 codes whose 32-bit lanes are one output's 4 consecutive k;
// vpmaddubsw with those 4 xq broadcast gives int16 pair sums, and the 8 of a group add up in
// int16 without overflow (16 products of at most 15 * 127: 30480 < 32767); one vpmaddwd with
// ones gives the 8 outputs' int32 group sums in one vector, no horizontal sums. Scales and lo
// [blocks, K / 32, 32]: per group, half 0's 8 scales, its 8 lo (= zero - 8 scale, as
// pack_int4's), then half 1's. Both streams are read in order, a block from start to end (group-major,
// so one pass over 16 outputs reads one contiguous stream).
//
// Per output and group (w = code * scale + lo):
//   c_g = fma(float(sum_k code_k xq_k), scale * sx, lo * ms);  total += c_g  (g increasing)
// then y = total + bias. The lo term uses the quantized sum ms = sx * sum(xq) (llama.cpp's
// choice), not the exact fp32 sum of x: then the result is exactly the dequantized weight times
// the quantized activations, whose error is sum_k w_k (x_k - sx xq_k); with the exact sum it
// would be sum_k (w_k - lo) (x_k - sx xq_k), and |w - lo| reaches the group's whole range
// (for weights spread evenly over [-a, a], 4x the error variance).
//
// Every row runs the same operations whatever the rows beside it (integer sums are exact; the
// fp32 steps above are per row, in a fixed order), and threads split the output blocks: a
// row's bits depend neither on the other rows of the call nor on the thread count.

// Software prefetch distance in code bytes (the scales at half of it), by CPU. SmolLM2's ~100
// MB of int4 weights per token stream from DRAM. On an AMD Zen 3 without AVX-512, where it was
// tuned (2026-12-04; one interleaved run, busy 2-core host, medians of 15 tokens, half-block
// passes over a half-major layout): 1 row 15.7 ms without, 14.9 / 14.4 / 14.0 ms at 512 /
// 1024 / 2048; 8 rows 40.0 without, 41.5 at 1024 (compute-bound there); with the group-major
// layout (medians of 9, 1 row) 1024 B on a par with the old kernel, 2048 / 4096 B 5-10%
// slower. On an AMD Zen 4 with AVX-512 (2026-12-06, bench/int4_a8_linears.py, 1 thread,
// minima of 15 tokens, 3-5 alternations; bench/README.md) 1024 B ahead cost 10-15%: 1 row
// 7.0-8.0 ms at 1024 against 6.4-6.7 at 128 and 6.6-6.9 without; 3 rows 7.8-8.3 against
// 7.3-7.6 / 7.6-8.0; 4-16 KB ahead slower still (1 row 7.4-10.5, 3 rows 8.0-11.7); in situ
// a SmolLM2 int4 decode step 6.8 -> 6.4 and 7.8 -> 7.3 ms (1 thread), 6.4 -> 4.8 and 5.9 ->
// 5.4 ms (2). So 128 B where AVX-512 is (GCC 12 cannot name Zen 4; no other AVX-512 CPU was
// measured), 1024 elsewhere. Prefetching changes no arithmetic: the bits are the same.
const int kA8Prefetch = has_avx512f() ? 128 : 1024;
constexpr int64_t kA8BlockBytes = kBlock * kGroup / 2;  // code bytes per block and group: 256

// x fp32 [rows, K] (K a multiple of 32) -> xq int8 [K / 32, rows, 32], sx and ms fp32
// [K / 32, rows] (group-major: the kernel reads a group of every row from one pointer).
__attribute__((target("avx2,fma"))) void a8_quantize_rows(const float* x, int64_t rows,
                                                          int64_t K, int8_t* xq, float* sx,
                                                          float* ms) {
  const int64_t G = K / kGroup;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < rows * G; ++i) {  // group g of row m
    const int64_t m = i / G, g = i % G, r = g * rows + m;
    const float* xg = x + i * kGroup;  // rows are contiguous: group i of the flat array
    int8_t* qg = xq + r * kGroup;
    __m256 v[4], amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xg + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float a = _mm_cvtss_f32(m4);
    if (_mm256_movemask_ps(nan) || a > 3.4028234663852886e38f) {  // NaN or inf: NaN out
      std::fill(qg, qg + kGroup, int8_t{0});
      sx[r] = ms[r] = __builtin_nanf("");
      continue;
    }
    if (a == 0.0f) {
      std::fill(qg, qg + kGroup, int8_t{0});
      sx[r] = ms[r] = 0.0f;
      continue;
    }
    const float s = a / 127.0f;
    const __m256 sv = _mm256_set1_ps(s);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)  // round half to even (the default MXCSR mode), |q| <= 127
      q[i] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_div_ps(v[i], sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i sum4 =
        _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    // pack: 32-bit lanes -> 16 -> 8, then undo the packs' per-128-bit-lane interleave
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg), p8);
    sx[r] = s;
    ms[r] = s * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

// A group's code bytes and scales kA8Prefetch ahead (both group loops)
inline void a8_prefetch(const uint8_t* cg, const float* sg) {
  const char* pc = reinterpret_cast<const char*>(cg) + kA8Prefetch;
  _mm_prefetch(pc, _MM_HINT_T0);
  _mm_prefetch(pc + 64, _MM_HINT_T0);
  _mm_prefetch(pc + 128, _MM_HINT_T0);
  _mm_prefetch(pc + 192, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(sg) + kA8Prefetch / 2, _MM_HINT_T0);
}

// The int8 activations of all rows (a8_quantize_rows' output).
struct A8Rows {
  const int8_t* xq;  // [G, rows, 32]
  const float* sx;   // [G, rows]
  const float* ms;   // [G, rows]
  int64_t rows, G;
};

// 4 int8 at p in every 32-bit lane (vbroadcastss: a load-port broadcast, no shuffle uop)
__attribute__((target("avx2,fma"))) inline __m256i bcast4(const int8_t* p) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

// MR rows (1..4) x one block of 16 outputs over groups g0..g1-1, adding to the rows' totals
// tot [MR][16] (fp32). Layout per group: 256 code bytes (half 0's 4 steps of 32 bytes, then
// half 1's), 16 scales + 16 lo (half 0's 8 scales, its 8 lo, then half 1's). Per step the two
// halves' loads are unpacked (4 registers) and used by every row; each xq broadcast serves
// both halves. A row sums a group in one int16 register per half (2 MR registers), then adds
// the group's fp32 term to its totals. The asm barrier keeps each step's adds in order:
// without it GCC reassociates a group's vpaddw into a tree, computes every vpmaddubsw first
// and spills them (as it did with 8 rows of 8 outputs).
template <int MR>
__attribute__((target("avx2,fma"))) inline void a8_block_groups(const A8Rows& a, int64_t m0,
                                                                const uint8_t* cb,
                                                                const float* sb, int64_t g0,
                                                                int64_t g1, float* tot,
                                                                bool prefetch) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr bool kRegs = MR <= 2;  // totals in registers (else in tot: 16 ymm are full)
  __m256 tr[MR][2];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
    if constexpr (kRegs) {
      tr[m][0] = _mm256_load_ps(tot + m * kBlock);
      tr[m][1] = _mm256_load_ps(tot + m * kBlock + 8);
    }
  }
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* cg = cb + g * kA8BlockBytes;
    const float* sg = sb + g * 2 * kBlock;
    if (prefetch) a8_prefetch(cg, sg);
    const int8_t* xg = a.xq + (g * a.rows + m0) * kGroup;  // row m: xg + 32 m
    __m256i acc0[MR], acc1[MR];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) acc0[m] = acc1[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + s * 32));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + 128 + s * 32));
      const __m256i c00 = _mm256_and_si256(v0, low);  // half 0, k = 8 s + 0..3
      const __m256i c01 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);  // k = 8 s + 4..7
      const __m256i c10 = _mm256_and_si256(v1, low);
      const __m256i c11 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const int8_t* xs = xg + m * kGroup + 8 * s;
        const __m256i x0 = bcast4(xs), x1 = bcast4(xs + 4);
        __m256i a0 = acc0[m], a1 = acc1[m];
        a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(c00, x0));  // int16: <= 16 * 15 * 127
        a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(c10, x0));
        a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(c01, x1));
        a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(c11, x1));
        asm("" : "+x"(a0), "+x"(a1));
        acc0[m] = a0, acc1[m] = a1;
      }
    }
    const __m256 sc0 = _mm256_loadu_ps(sg), lo0 = _mm256_loadu_ps(sg + 8);
    const __m256 sc1 = _mm256_loadu_ps(sg + 16), lo1 = _mm256_loadu_ps(sg + 24);
    const float* sx = a.sx + g * a.rows + m0;
    const float* ms = a.ms + g * a.rows + m0;
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m256 sxm = _mm256_broadcast_ss(sx + m), msm = _mm256_broadcast_ss(ms + m);
      const __m256 i0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc0[m], ones));
      const __m256 i1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc1[m], ones));
      const __m256 t0 = _mm256_fmadd_ps(i0, _mm256_mul_ps(sc0, sxm), _mm256_mul_ps(lo0, msm));
      const __m256 t1 = _mm256_fmadd_ps(i1, _mm256_mul_ps(sc1, sxm), _mm256_mul_ps(lo1, msm));
      if constexpr (kRegs) {
        tr[m][0] = _mm256_add_ps(tr[m][0], t0);
        tr[m][1] = _mm256_add_ps(tr[m][1], t1);
      } else {
        float* tm = tot + m * kBlock;
        _mm256_store_ps(tm, _mm256_add_ps(_mm256_load_ps(tm), t0));
        _mm256_store_ps(tm + 8, _mm256_add_ps(_mm256_load_ps(tm + 8), t1));
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
    if constexpr (kRegs) {
      _mm256_store_ps(tot + m * kBlock, tr[m][0]);
      _mm256_store_ps(tot + m * kBlock + 8, tr[m][1]);
    }
  }
}

// 8 fp32 at p then 8 at q in one zmm (AVX512F: a 256-bit insert of the other's bits)
__attribute__((target("avx512f"))) inline __m512 join8(const float* p, const float* q) {
  const __m512d lo = _mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(p)));
  return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(q)), 1));
}

// The same MR rows x one block over groups g0..g1-1 with AVX-512 VNNI (`vpdpbusd`), where the
// CPU has avx512_vnni, avx512bw and avx512vl: one zmm holds the block's 16 outputs (half 0's 32
// code bytes of a step in its low half, half 1's in its high half), and each row sums a group
// in one int32 register with 2 `vpdpbusd` a step, where the AVX2 loop takes 4 `vpmaddubsw` +
// 4 `vpaddw` and a `vpmaddwd` a group. The integer sums are exact either way (the AVX2 loop's
// int16 partial sums stay below 2^15), and the fp32 steps after them are the same operations
// in the same order, so the results are the AVX2 loop's bit for bit (tests/test_f32_linear.py
// compares the two). Zen 4, 1 thread: a 1536 x 576 linear from L2 at 1 / 4 / 8 rows 19.6 /
// 39-40.5 / 70-71.5 -> 16.7 / 31.1 / 54.5 us (bench/README.md, 2026-12-06).
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma"))) inline void
a8_block_groups_vnni(const A8Rows& a, int64_t m0, const uint8_t* cb, const float* sb,
                     int64_t g0, int64_t g1, float* tot, bool prefetch) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 tr[MR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) tr[m] = _mm512_loadu_ps(tot + m * kBlock);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* cg = cb + g * kA8BlockBytes;
    const float* sg = sb + g * 2 * kBlock;
    if (prefetch) a8_prefetch(cg, sg);
    const int8_t* xg = a.xq + (g * a.rows + m0) * kGroup;  // row m: xg + 32 m
    __m512i acc[MR];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + s * 32));
      const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + 128 + s * 32));
      const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
      const __m512i c0 = _mm512_and_si512(v, low);  // k = 8 s + 0..3 of outputs 0-15
      const __m512i c1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);  // k = 8 s + 4..7
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const int8_t* xs = xg + m * kGroup + 8 * s;
        int32_t x0, x1;
        std::memcpy(&x0, xs, 4);
        std::memcpy(&x1, xs + 4, 4);
        acc[m] = _mm512_dpbusd_epi32(acc[m], c0, _mm512_set1_epi32(x0));
        acc[m] = _mm512_dpbusd_epi32(acc[m], c1, _mm512_set1_epi32(x1));
      }
    }
    const __m512 sc = join8(sg, sg + 16), lo = join8(sg + 8, sg + 24);  // outputs 0-7 | 8-15
    const float* sx = a.sx + g * a.rows + m0;
    const float* ms = a.ms + g * a.rows + m0;
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m512 sxm = _mm512_set1_ps(sx[m]), msm = _mm512_set1_ps(ms[m]);
      const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_mul_ps(sc, sxm),
                                       _mm512_mul_ps(lo, msm));
      tr[m] = _mm512_add_ps(tr[m], t);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(tot + m * kBlock, tr[m]);
}

using A8Groups = void (*)(const A8Rows&, int64_t, const uint8_t*, const float*, int64_t, int64_t,
                          float*, bool);
constexpr A8Groups kA8Groups[4] = {a8_block_groups<1>, a8_block_groups<2>, a8_block_groups<3>,
                                   a8_block_groups<4>};
constexpr A8Groups kA8GroupsVnni[4] = {a8_block_groups_vnni<1>, a8_block_groups_vnni<2>,
                                       a8_block_groups_vnni<3>, a8_block_groups_vnni<4>};
bool a8_vnni_supported() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return has;
}
// Which group loop int4_a8_linear runs: VNNI where the CPU has it (EDGEBUILD_A8_VNNI=0: the
// AVX2 one); a8_vnni(mode) is the op tests switch it with (LoopSwitch).
LoopSwitch g_a8_vnni{"EDGEBUILD_A8_VNNI", a8_vnni_supported};
bool a8_vnni_on() { return g_a8_vnni.on(); }
bool a8_vnni(int64_t mode) { return g_a8_vnni.set("a8_vnni", mode); }
constexpr int kA8Rows = 4;  // rows per chunk

// rows x one block of 16 outputs: chunks of up to 4 rows over all groups (each row's sequence
// is the same in any chunk); later chunks read the block from cache (only the first
// prefetches). tot: [rows, 16] fp32 scratch, 32-byte aligned.
__attribute__((target("avx2,fma"))) inline void a8_block_all_rows(
    const A8Rows& a, const uint8_t* cb, const float* sb, const float* bias, float* y,
    int64_t ldy, int64_t n_out, float* tot, const A8Groups* groups) {
  for (int64_t i = 0; i < a.rows * kBlock; i += 8) _mm256_store_ps(tot + i, _mm256_setzero_ps());
  for (int64_t m = 0; m < a.rows; m += kA8Rows) {
    const int64_t mr = std::min<int64_t>(kA8Rows, a.rows - m);
    groups[mr - 1](a, m, cb, sb, 0, a.G, tot + m * kBlock, m == 0);
  }
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  for (int64_t m = 0; m < a.rows; ++m) {
    alignas(32) float out[kBlock];
    _mm256_store_ps(out, _mm256_add_ps(_mm256_load_ps(tot + m * kBlock), b0));
    _mm256_store_ps(out + 8, _mm256_add_ps(_mm256_load_ps(tot + m * kBlock + 8), b1));
    std::copy(out, out + n_out, y + m * ldy);
  }
}

at::Tensor int4_a8_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& sl,
                          const c10::optional<at::Tensor>& bias, int64_t n,
                          const c10::optional<at::Tensor>& norm_w, double eps, bool swiglu,
                          const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.size(2) == 2 &&
                  codes.size(3) == kA8BlockBytes / 2 && codes.is_contiguous(),
              "int4_a8_linear: codes must be uint8 [ceil(out / 16), in / 32, 2, 128] "
              "(pack_int4_a8)");
  const int64_t G = codes.size(1), K = G * kGroup, NB = codes.size(0);
  TORCH_CHECK(K > 0, "int4_a8_linear: in must be a positive multiple of 32");
  const at::Tensor x = kernel_input("int4_a8_linear", x_in, K, norm_w, eps, swiglu);
  const int64_t rows = x.size(0);
  TORCH_CHECK(sl.dim() == 3 && sl.scalar_type() == at::kFloat && sl.size(0) == NB &&
                  sl.size(1) == G && sl.size(2) == 2 * kBlock && sl.is_contiguous(),
              "int4_a8_linear: scales must be fp32 [blocks, in / 32, 32] (pack_int4_a8)");
  at::Tensor b;
  const float* bp = checked_bias("int4_a8_linear", bias, n, NB, b);
  auto y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out_shaped(y, x_in, n);
  auto xq = at::empty({G, rows, kGroup}, x.options().dtype(at::kChar));
  auto sxms = at::empty({2, G, rows}, x.options());
  float* sxp = sxms.data_ptr<float>();
  a8_quantize_rows(x.data_ptr<float>(), rows, K, xq.data_ptr<int8_t>(), sxp, sxp + rows * G);
  const A8Rows a{xq.data_ptr<int8_t>(), sxp, sxp + rows * G, rows, G};
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = sl.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const A8Groups* groups = a8_vnni_on() ? kA8GroupsVnni : kA8Groups;
  auto work = [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(rows * kBlock + 8);  // the rows' totals, 32-byte aligned
    float* tot = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~uintptr_t{31});
    for (int64_t blk = b0; blk < b1; ++blk) {
      const float* bb = bp ? bp + blk * kBlock : nullptr;
      const int64_t n_out = std::min<int64_t>(kBlock, n - blk * kBlock);
      a8_block_all_rows(a, cp + blk * G * kA8BlockBytes, sp + blk * G * 2 * kBlock, bb,
                        yp + blk * kBlock, n, n_out, tot, groups);
    }
  };
  eb_pool::parallel_for(NB, 4, work);
  y = out_shaped(y, x_in, n);
  add_residual("int4_a8_linear", y, residual);
  return y;
}

// The activation quantization alone (tests compare it with torch's round(x / (max|x| / 127))):
// (xq int8 [rows, in], sx fp32 [rows, in / 32], ms fp32 [rows, in / 32]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_rows(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) % kGroup == 0,
              "int8_rows: x must be fp32 [rows, in] with in a multiple of 32");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), K = x.size(1), G = K / kGroup;
  auto xq = at::empty({G, rows, kGroup}, x.options().dtype(at::kChar));
  auto sx = at::empty({G, rows}, x.options()), ms = at::empty({G, rows}, x.options());
  if (rows * G > 0)
    a8_quantize_rows(x.data_ptr<float>(), rows, K, xq.data_ptr<int8_t>(), sx.data_ptr<float>(),
                     ms.data_ptr<float>());
  return {xq.permute({1, 0, 2}).reshape({rows, K}), sx.t().contiguous(), ms.t().contiguous()};
}

// The k largest entries of each row of x fp32 [R, V] (the DSpark draft's top-k candidates over
// the vocabulary, edgebuild.ops.f32_linear.topk): values fp32 [R, k] and indices int64 [R, k],
// best first. Order: larger value first, equal values by smaller index (what a stable
// descending sort gives), NaN above every number (as torch.sort). One pass over the row, 8
// values at a time compared in AVX2 with the k-th best so far (topk_row).
struct Entry {
  float v;
  int64_t i;
};

inline bool better(const Entry& a, const Entry& b) {  // a ranks above b
  const bool an = std::isnan(a.v), bn = std::isnan(b.v);
  if (an != bn) return an;
  if (!an && a.v != b.v) return a.v > b.v;
  return a.i < b.i;
}

// Candidates above the k-th best so far are appended to buf; when it holds kSpill more than k,
// nth_element keeps the k best and raises the bar (a heap update per candidate cost ~40 us a
// 49152-entry row: ~400 candidates pass the bar in a row of random order).
constexpr int64_t kSpill = 512;

void topk_row(const float* x, int64_t V, int64_t k, std::vector<Entry>& buf, float* vals,
              int64_t* idx) {
  buf.clear();
  for (int64_t j = 0; j < k; ++j) buf.push_back(Entry{x[j], j});
  auto bar = [&]() {  // the worst kept entry: a lane must rank above it to enter
    return *std::max_element(buf.begin(), buf.begin() + k, better);
  };
  auto compact = [&]() {
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), better);
    buf.resize(k);
  };
  Entry worst = bar();
  auto offer = [&](int64_t j) {
    const Entry e{x[j], j};
    if (!better(e, worst)) return;
    buf.push_back(e);
    if ((int64_t)buf.size() >= k + kSpill) {
      compact();
      worst = bar();
    }
  };
  int64_t j = k;
  for (; j < V && (j & 7); ++j) offer(j);
  for (; j + 8 <= V; j += 8) {
    // a lane may enter when it is above the bar's value, or NaN (the exact rule: offer)
    const float w = std::isnan(worst.v) ? INFINITY : worst.v;
    const __m256 v = _mm256_loadu_ps(x + j);
    const __m256 hit = _mm256_or_ps(_mm256_cmp_ps(v, _mm256_set1_ps(w), _CMP_GT_OQ),
                                    _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    int bits = _mm256_movemask_ps(hit);
    while (bits) {
      const int lane = __builtin_ctz(bits);
      bits &= bits - 1;
      offer(j + lane);
    }
  }
  for (; j < V; ++j) offer(j);
  if ((int64_t)buf.size() > k) compact();
  std::sort(buf.begin(), buf.end(), better);  // best first
  for (int64_t t = 0; t < k; ++t) {
    vals[t] = buf[t].v;
    idx[t] = buf[t].i;
  }
}

std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x_in, int64_t k) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "topk_rows: x must be fp32 [rows, V]");
  const at::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "topk_rows: k must be in 1..V (", V, "), got ", k);
  auto vals = at::empty({R, k}, x.options());
  auto idx = at::empty({R, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  eb_pool::parallel_for(R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<Entry> buf;
    buf.reserve(k + kSpill);
    for (int64_t r = r0; r < r1; ++r) topk_row(xp + r * V, V, k, buf, vp + r * k, ip + r * k);
  });
  return {vals, idx};
}

// The greedy walk of DSpark blocks over their top-k candidates in one call (the DSpark draft's
// proposal for greedy requests, edgebuild.ops.f32_linear.markov_greedy; spec §3 "Drafting" and
// "Top-k pruning"). For request b and slot k < counts[b]: the candidates are the top-k of
// base[b, k] (topk_row's order), mapped through token_map where there is one; the previous
// token is the anchor for slot 0, else the token chosen at slot k - 1; e = W1[prev];
//   vanilla head: u = e;   gated: u = sigmoid(Wg [h_k; e] + bg) * e;   no head: no bias;
//   score_j = top_j + W2[cand_j] . u, the choice the first j of the largest score (NaN first);
//   confidence = sigmoid(h_k . cw[:d] (+ e . cw[d:] with the Markov input) + cb).
// It walks only the path taken: O(k r) a slot where the lattice (DSparkDraft.lattice) scores
// every (previous candidate, candidate) pair, O(k^2 r), in ~25 torch ops a proposal. Products
// and sums are in double (fp32 / bf16 inputs and their products are exact in double; the sums
// and the gate's sigmoid round at double precision), so a choice is the argmax of the scores in
// double; the lattice's fp32 matmul may choose otherwise only where two scores tie to within its
// rounding (verification keeps the output the target's either way).
struct Mat {  // a row-major [rows, cols] fp32 or bf16 matrix read as double
  const void* p = nullptr;
  int64_t rows = 0, cols = 0;
  bool bf16 = false;
  double at(int64_t r, int64_t c) const {
    if (!bf16) return static_cast<const float*>(p)[r * cols + c];
    const uint32_t u = uint32_t(static_cast<const uint16_t*>(p)[r * cols + c]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
};

// m[row, off : off + len] . x in double (AVX2: four lanes, then their sum)
double dot_row(const Mat& m, int64_t row, int64_t off, const double* x, int64_t len) {
  __m256d acc = _mm256_setzero_pd();
  int64_t c = 0;
  if (!m.bf16) {
    const float* p = static_cast<const float*>(m.p) + row * m.cols + off;
    for (; c + 4 <= len; c += 4)
      acc = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(p + c)), _mm256_loadu_pd(x + c), acc);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(m.p) + row * m.cols + off;
    for (; c + 4 <= len; c += 4) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c));
      const __m128 f = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(b), 16));
      acc = _mm256_fmadd_pd(_mm256_cvtps_pd(f), _mm256_loadu_pd(x + c), acc);
    }
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, acc);
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; c < len; ++c) sum += m.at(row, off + c) * x[c];
  return sum;
}

Mat as_mat(const at::Tensor& t, const char* name) {
  TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  t.is_contiguous() && t.dim() >= 1,
              "markov_greedy: ", name, " must be a contiguous fp32 or bf16 tensor");
  Mat m;
  m.p = t.data_ptr();
  m.cols = t.size(-1);
  m.rows = m.cols ? t.numel() / m.cols : 0;
  m.bf16 = t.scalar_type() == at::kBFloat16;
  return m;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> markov_greedy(
    const at::Tensor& base_in, const at::Tensor& anchors_in, const at::Tensor& counts_in,
    int64_t k, const c10::optional<at::Tensor>& token_map, const c10::optional<at::Tensor>& w1_in,
    const c10::optional<at::Tensor>& w2_in, const c10::optional<at::Tensor>& gate_w_in,
    const c10::optional<at::Tensor>& gate_b_in, const c10::optional<at::Tensor>& h_in,
    const c10::optional<at::Tensor>& conf_w_in, double conf_b) {
  TORCH_CHECK(base_in.dim() == 3 && base_in.scalar_type() == at::kFloat,
              "markov_greedy: base must be fp32 [B, n, V]");
  const at::Tensor base = base_in.contiguous();
  const int64_t B = base.size(0), n = base.size(1), V = base.size(2);
  TORCH_CHECK(k >= 1 && k <= V, "markov_greedy: k must be in 1..V (", V, "), got ", k);
  const at::Tensor anchors = anchors_in.to(at::kLong).contiguous();
  const at::Tensor counts = counts_in.to(at::kLong).contiguous();
  TORCH_CHECK(anchors.dim() == 1 && anchors.size(0) == B && counts.dim() == 1 &&
                  counts.size(0) == B,
              "markov_greedy: anchors and counts must be [B = ", B, "]");
  const int64_t* ap = anchors.data_ptr<int64_t>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(cp[b] >= 0 && cp[b] <= n, "markov_greedy: counts[", b, "] = ", cp[b],
                " is outside 0..n (", n, ")");
  at::Tensor tmap;
  if (token_map) {
    tmap = token_map->to(at::kLong).contiguous();
    TORCH_CHECK(tmap.dim() == 1 && tmap.size(0) == V,
                "markov_greedy: token_map must be int [V = ", V, "]");
  }
  const int64_t* tp = tmap.defined() ? tmap.data_ptr<int64_t>() : nullptr;
  const bool markov = w1_in.has_value();
  TORCH_CHECK(markov == w2_in.has_value(), "markov_greedy: give both W1 and W2, or neither");
  Mat w1, w2, gw, gb, h, cw;
  if (markov) {
    w1 = as_mat(*w1_in, "W1");
    w2 = as_mat(*w2_in, "W2");
    TORCH_CHECK(w1_in->dim() == 2 && w2_in->dim() == 2 && w1.rows == w2.rows &&
                    w1.cols == w2.cols,
                "markov_greedy: W1 and W2 must both be [vocab, rank]");
  }
  const int64_t r = w1.cols, vocab = markov ? w1.rows : 0;
  if (h_in) {
    h = as_mat(*h_in, "h");
    TORCH_CHECK(h_in->dim() == 3 && h_in->size(0) == B && h_in->size(1) >= n,
                "markov_greedy: h must be [B, >= n, d]");
  }
  const int64_t d = h.cols, h_rows = h_in ? h_in->size(1) : 0;
  const bool gated = gate_w_in.has_value();
  if (gated) {
    TORCH_CHECK(markov && h_in && gate_b_in, "markov_greedy: a gated head needs W1, W2, h, bg");
    gw = as_mat(*gate_w_in, "gate weight");
    gb = as_mat(*gate_b_in, "gate bias");
    TORCH_CHECK(gw.rows == r && gw.cols == d + r && gb.rows * gb.cols == r,
                "markov_greedy: the gate must be [rank, d + rank] with a [rank] bias");
  }
  bool conf_markov = false;
  if (conf_w_in) {
    cw = as_mat(*conf_w_in, "confidence weight");
    TORCH_CHECK(h_in && (cw.cols == d || (markov && cw.cols == d + r)),
                "markov_greedy: the confidence weight must be [d] or [d + rank] with h given");
    conf_markov = cw.cols == d + r && markov;
  }
  auto cand = at::zeros({B, n, k}, base.options().dtype(at::kLong));
  auto choice = at::zeros({B, n}, base.options().dtype(at::kLong));
  auto conf = at::ones({B, n}, base.options());
  auto top = at::empty({B, n, k}, base.options());
  const float* xp = base.data_ptr<float>();
  float* tv = top.data_ptr<float>();
  int64_t* cd = cand.data_ptr<int64_t>();
  eb_pool::parallel_for(B * n, 1, [&](int64_t r0, int64_t r1) {  // every row's candidates
    std::vector<Entry> buf;
    buf.reserve(k + kSpill);
    for (int64_t row = r0; row < r1; ++row) {
      if (row % n >= cp[row / n]) continue;
      int64_t* ids = cd + row * k;
      topk_row(xp + row * V, V, k, buf, tv + row * k, ids);
      if (tp)
        for (int64_t j = 0; j < k; ++j) ids[j] = tp[ids[j]];
    }
  });
  int64_t* ch = choice.data_ptr<int64_t>();
  float* cf = conf.data_ptr<float>();
  std::vector<double> e(r), u(r), hs(d);
  for (int64_t b = 0; b < B; ++b) {  // the walk: a few hundred dot products a request
    int64_t prev = ap[b];
    for (int64_t s = 0; s < cp[b]; ++s) {
      const int64_t row = b * n + s, hrow = b * h_rows + s;
      for (int64_t c = 0; c < d; ++c) hs[c] = h.at(hrow, c);
      if (markov) {
        TORCH_CHECK(prev >= 0 && prev < vocab, "markov_greedy: token ", prev,
                    " is outside the Markov head's vocabulary (", vocab, ")");
        for (int64_t c = 0; c < r; ++c) e[c] = w1.at(prev, c);
        for (int64_t c = 0; c < r; ++c) u[c] = e[c];
        if (gated)
          for (int64_t g = 0; g < r; ++g) {
            const double z = gb.at(0, g) + dot_row(gw, g, 0, hs.data(), d) +
                             dot_row(gw, g, d, e.data(), r);
            u[g] = e[g] / (1.0 + std::exp(-z));
          }
      }
      const int64_t* ids = cd + row * k;
      int64_t best = 0;
      double best_s = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        double sc = tv[row * k + j];
        if (markov) {
          TORCH_CHECK(ids[j] >= 0 && ids[j] < vocab, "markov_greedy: candidate ", ids[j],
                      " is outside the Markov head's vocabulary (", vocab, ")");
          sc += dot_row(w2, ids[j], 0, u.data(), r);
        }
        const bool take = j == 0 || (std::isnan(sc) && !std::isnan(best_s)) ||
                          (!std::isnan(best_s) && sc > best_s);
        if (take) {
          best = j;
          best_s = sc;
        }
      }
      if (cw.p) {
        double z = conf_b + dot_row(cw, 0, 0, hs.data(), d);
        if (conf_markov) z += dot_row(cw, 0, d, e.data(), r);
        cf[row] = static_cast<float>(1.0 / (1.0 + std::exp(-z)));
      }
      ch[row] = best;
      prev = ids[best];
    }
  }
  return {cand, choice, conf};
}

bool available() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

}  // namespace

TORCH_LIBRARY(edgebuild_f32, m) {
  // norm_weight / eps: RMSNorm the input rows first; swiglu: x is gate | up, silu(gate) * up
  // is multiplied; residual: returned is residual + x W^T (+ bias) (kernel_input, add_residual)
  m.def(
      "f32_linear(Tensor x, Tensor w, Tensor? bias, int n, Tensor? norm_weight=None, "
      "float eps=0.0, bool swiglu=False, Tensor? residual=None) -> Tensor");
  m.def(
      "int4_f32_linear(Tensor x, Tensor codes, Tensor sl, Tensor? bias, int n, "
      "Tensor? norm_weight=None, float eps=0.0, bool swiglu=False, Tensor? residual=None) -> "
      "Tensor");
  m.def(
      "int4_a8_linear(Tensor x, Tensor codes, Tensor sl, Tensor? bias, int n, "
      "Tensor? norm_weight=None, float eps=0.0, bool swiglu=False, Tensor? residual=None) -> "
      "Tensor");
  m.def("int8_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
  m.def(
      "markov_greedy(Tensor base, Tensor anchors, Tensor counts, int k, Tensor? token_map, "
      "Tensor? w1, Tensor? w2, Tensor? gate_w, Tensor? gate_b, Tensor? h, Tensor? conf_w, "
      "float conf_b) -> (Tensor, Tensor, Tensor)");
  m.def("f32_available() -> bool", &available);
  m.def("a8_vnni(int mode=-1) -> bool", &a8_vnni);
  m.def("f32_avx512(int mode=-1) -> bool", &f32_avx512);
}
TORCH_LIBRARY_IMPL(edgebuild_f32, CPU, m) {
  m.impl("f32_linear", &f32_linear);
  m.impl("int4_f32_linear", &int4_f32_linear);
  m.impl("int4_a8_linear", &int4_a8_linear);
  m.impl("int8_rows", &int8_rows);
  m.impl("topk_rows", &topk_rows);
  m.impl("markov_greedy", &markov_greedy);
}
