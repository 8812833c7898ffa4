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
// and added to the running total, then + bias. So a row's result never depends on the other rows of the call, nor on
// the thread count (threads split the output blocks), which makes fp32 DSpark's verify rows
// equal target-only's decode rows bit for bit.
//
// No -ffast-math (it would let the compiler reassociate the sums).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "pool.h"

namespace {

constexpr int64_t kBlock = 16;  // output features per packed block (two AVX2 vectors)
// k per chunk: each chunk is summed in fresh accumulators, then added to the running total, so a
// sum of K products carries ~(kChunk + K / kChunk) roundings instead of K: one long FMA chain
// was 2-3x less accurate than MKL (rms 2.8e-8 against 1.0-1.7e-8 of sum |x w|), enough for a
// 30-layer NVFP4 model's fp32 logits to leave the onnxruntime parity tolerance (4.8e-3 > 3e-3).
constexpr int64_t kChunk = 32;

// Where a block's weights come from: fp32 (packed [K, 16]) or int4 (codes + scale / lo per
// group, widened to fp32 here). start(k0) is called at each chunk of kChunk k; load(k, w0, w1)
// gives input k's 16 weights as two vectors.
struct F32Weights {
  const float* wb;
  inline void start(int64_t) {}
  inline void load(int64_t k, __m256& w0, __m256& w1) const {
    w0 = _mm256_loadu_ps(wb + k * kBlock);
    w1 = _mm256_loadu_ps(wb + k * kBlock + 8);
  }
};

// MR rows (1..6) x one block of 16 outputs over all of K: 2 * MR accumulators, 2 weight vectors
// and 1 broadcast (15 of the 16 ymm registers at MR = 6). Per output and chunk of kChunk k, one
// accumulator fed by FMAs in increasing k, then added to the total on the stack: the same
// sequence for a row whatever MR is. One row is 2 FMA chains (~48 GB/s
// of weights at 3 GHz, above what one core reads from memory); 6 rows keep both FMA units busy.
template <int MR, typename Weights>
__attribute__((target("avx2,fma"))) inline void block_rows(const float* x, int64_t ldx, int64_t K,
                                                           Weights w, const float* bias,
                                                           float* y, int64_t ldy, int64_t n_out) {
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
template <typename Weights>
inline void all_rows(const float* x, int64_t rows, int64_t K, const Weights& w, const float* bias,
                     float* y, int64_t ldy, int64_t n_out) {
  for (int64_t m = 0; m < rows; m += kMaxRows) {
    const float* xm = x + m * K;
    float* ym = y + m * ldy;
    switch (std::min<int64_t>(kMaxRows, rows - m)) {
      case 1: block_rows<1>(xm, K, K, w, bias, ym, ldy, n_out); break;
      case 2: block_rows<2>(xm, K, K, w, bias, ym, ldy, n_out); break;
      case 3: block_rows<3>(xm, K, K, w, bias, ym, ldy, n_out); break;
      case 4: block_rows<4>(xm, K, K, w, bias, ym, ldy, n_out); break;
      case 5: block_rows<5>(xm, K, K, w, bias, ym, ldy, n_out); break;
      default: block_rows<6>(xm, K, K, w, bias, ym, ldy, n_out); break;
    }
  }
}

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

at::Tensor f32_linear(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                      int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "f32_linear: x must be fp32 [rows, in]");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kFloat && w.size(2) == kBlock &&
                  w.is_contiguous(),
              "f32_linear: w must be fp32 [ceil(out / 16), in, 16] (f32_linear.pack)");
  const int64_t rows = x_in.size(0), K = x_in.size(1), NB = w.size(0);
  TORCH_CHECK(w.size(1) == K, "f32_linear: x has ", K, " inputs, the weight ", w.size(1));
  at::Tensor b;
  const float* bp = checked_bias("f32_linear", bias, n, NB, b);
  auto y = at::empty({rows, n}, x_in.options());
  if (rows == 0 || n == 0) return y;
  const at::Tensor x = x_in.contiguous();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto work = [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const float* wb = wp + blk * K * kBlock;
      const float* bb = bp ? bp + blk * kBlock : nullptr;
      const int64_t n_out = std::min<int64_t>(kBlock, n - blk * kBlock);
      all_rows(xp, rows, K, F32Weights{wb}, bb, yp + blk * kBlock, n, n_out);
    }
  };
  eb_pool::parallel_for(NB, 4, work);  // each output is computed by one thread: same bits
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
                           const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "int4_f32_linear: x must be fp32 [rows, in]");
  const int64_t rows = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(2) == 8 &&
                  codes.size(1) == K && codes.is_contiguous(),
              "int4_f32_linear: codes must be uint8 [ceil(out / 16), in, 8] (pack_int4)");
  const int64_t NB = codes.size(0);
  TORCH_CHECK(K % kGroup == 0, "int4_f32_linear: in (", K, ") must be a multiple of 32");
  TORCH_CHECK(sl.dim() == 4 && sl.scalar_type() == at::kFloat && sl.size(0) == NB &&
                  sl.size(1) == K / kGroup && sl.size(2) == 2 && sl.size(3) == kBlock &&
                  sl.is_contiguous(),
              "int4_f32_linear: scales must be fp32 [blocks, in / 32, 2, 16] (pack_int4)");
  at::Tensor b;
  const float* bp = checked_bias("int4_f32_linear", bias, n, NB, b);
  auto y = at::empty({rows, n}, x_in.options());
  if (rows == 0 || n == 0) return y;
  const at::Tensor x = x_in.contiguous();
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
  return y;
}

bool available() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

}  // namespace

TORCH_LIBRARY(edgebuild_f32, m) {
  m.def("f32_linear(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("int4_f32_linear(Tensor x, Tensor codes, Tensor sl, Tensor? bias, int n) -> Tensor");
  m.def("f32_available() -> bool", &available);
}
TORCH_LIBRARY_IMPL(edgebuild_f32, CPU, m) {
  m.impl("f32_linear", &f32_linear);
  m.impl("int4_f32_linear", &int4_f32_linear);
}
