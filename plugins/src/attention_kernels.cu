// plugins/src/attention_kernels.cu
//
// Owns: the CUDA kernels of the attention plugin and their launcher (attention_kernels.h).
//   prepare_kernel        q/k RMSNorm + RoPE + the fused KV-cache write, one block per new row
//   attention_tiled_kernel prefill / chunked prefill / verify / draft block: one block per
//                          (16-row query tile, q head, sequence), keys streamed through shared
//                          memory in tiles of 32 with an online softmax
//   attention_row_kernel  decode: one block per (query row, q head, sequence), 4 warps split the
//                          keys and merge their softmax states at the end
// Both attention kernels implement every phase (the masks come from attention_math.h); AUTO
// picks the row kernel for S == 1. No TensorRT types here: the plugin wrapper
// (attention_plugin.cpp) and the standalone check (tests/cuda_check.cu) both call
// eb_attention_enqueue.
//
// Numerics match the host build bit for bit up to the prepared q/K/V (same header functions,
// same reduction order, __f*_rn to stop FMA contraction), so the cache bytes are identical;
// scores/softmax/PV are fp32 with a different summation order and CUDA's expf, so outputs
// agree with the host to float rounding.

#ifndef EB_KERNEL_EMULATION
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <cstdio>

#include "edgebuild/attention_kernels.h"
#include "edgebuild/attention_math.h"
#include "edgebuild/attention_params.h"

// plugins/tests/cuda_emulation.h compiles this file with g++ and runs the kernels on CPU
// threads (tests/test_plugin_host.py): it provides the launch and the dynamic shared memory.
#ifndef EB_DYNAMIC_SMEM
#define EB_DYNAMIC_SMEM(type, name) extern __shared__ type name[]
#endif

namespace eb {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

#ifndef EB_KERNEL_EMULATION
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, Args... args) {
    kernel<<<grid, block, smem, stream>>>(args...);
    return cudaGetLastError();
}
#endif

// prepare_kernel: 8 warps per row, one head per warp at a time.
constexpr int kPrepareWarps = 8;
// tiled kernel: 16 query rows x 32 keys per step, 8 threads per query row.
constexpr int kTileQ = 16;
constexpr int kTileK = 32;
constexpr int kRowThreads = 8;
constexpr int kTiledThreads = kTileQ * kRowThreads;  // 128
// row (decode) kernel: 4 warps split the keys of one query row.
constexpr int kRowWarps = 4;

Geometry geometry_of(const EbAttentionParams& p) {
    return Geometry{p.batch,    p.seq_len,    p.num_q_heads, p.num_kv_heads,
                    p.head_dim, p.rotary_dim, p.page_size,   p.max_pages_per_seq};
}

size_t align_up(size_t n) { return (n + 255) & ~static_cast<size_t>(255); }

size_t dtype_bytes(int32_t dtype) {
    switch (dtype) {
        case EB_DTYPE_FLOAT32: return 4;
        case EB_DTYPE_FLOAT16:
        case EB_DTYPE_BFLOAT16: return 2;
        default: return 1;
    }
}

// ---- prepare: norm + RoPE of q and k, KV write -----------------------------------------------

// Grid (S, B). Rows past input_lengths[b] do nothing (their outputs are zeroed by the
// attention kernels). q goes to q_ws in fp32 (T-valued); k and v go to the K/V workspace in
// the cache dtype and, with write_kv, to their cache slot.
template <typename T, typename KV>
__global__ void __launch_bounds__(kPrepareWarps * kWarpLanes)
    prepare_kernel(EbAttentionParams p, Geometry g, float* q_ws, KV* k_ws, KV* v_ws) {
    __shared__ float rows[kPrepareWarps][EB_MAX_HEAD_DIM];
    const int s = blockIdx.x;
    const int b = blockIdx.y;
    if (s >= p.input_lengths[b]) {
        return;
    }
    const int warp = threadIdx.x / kWarpLanes;
    const int lane = threadIdx.x % kWarpLanes;
    const int D = g.head_dim, Hq = g.num_q_heads, Hkv = g.num_kv_heads;
    const T* qkv = static_cast<const T*>(p.qkv);
    KV* cache = static_cast<KV*>(p.kv_cache);
    const int32_t* page_row = p.page_table + static_cast<int64_t>(b) * g.max_pages_per_seq;
    const int slot = p.past_lengths[b] + s;
    const float* cs = g.rotary_dim > 0 ? p.rope_cos_sin + static_cast<int64_t>(
                                                              p.positions[b * g.seq_len + s]) *
                                                              g.rotary_dim
                                       : nullptr;
    float* row = rows[warp];

    for (int col = warp; col < Hq + 2 * Hkv; col += kPrepareWarps) {
        const T* src = qkv + g.qkv_offset(b, s, col);
        if (col >= Hq + Hkv) {  // v: stored as projected
            const int kvh = col - Hq - Hkv;
            for (int d = lane; d < D; d += kWarpLanes) {
                const float x = Storage<T>::load(src + d);
                kv_store<KV>(v_ws + g.new_kv_offset(b, s, kvh) + d, x, p.kv_scale);
                if (p.write_kv) {
                    kv_store<KV>(cache + g.slot_offset(page_row, slot, 1, kvh) + d, x, p.kv_scale);
                }
            }
            continue;
        }
        const bool is_q = col < Hq;
        for (int d = lane; d < D; d += kWarpLanes) {
            row[d] = Storage<T>::load(src + d);
        }
        __syncwarp();
        if (p.qk_norm) {
            const T* gamma = static_cast<const T*>(is_q ? p.q_norm_weight : p.k_norm_weight);
            float sum = lane_sum_squares(row, D, lane);
            for (int off = kWarpLanes / 2; off > 0; off /= 2) {
                sum = add_rn(sum, __shfl_xor_sync(kFullMask, sum, off));
            }
            const float inv = rms_inverse(sum, D, p.rms_norm_eps);
            for (int d = lane; d < D; d += kWarpLanes) {  // each lane rewrites its own channels
                row[d] = rms_norm_element<T>(row[d], inv, Storage<T>::load(gamma + d));
            }
            __syncwarp();
        }
        for (int d = lane; d < D; d += kWarpLanes) {
            const float y = rope_element<T>(row, d, g.rotary_dim, cs);
            if (is_q) {
                q_ws[g.q_offset(b, s, col) + d] = y;
            } else {
                const int kvh = col - Hq;
                kv_store<KV>(k_ws + g.new_kv_offset(b, s, kvh) + d, y, p.kv_scale);
                if (p.write_kv) {
                    kv_store<KV>(cache + g.slot_offset(page_row, slot, 0, kvh) + d, y, p.kv_scale);
                }
            }
        }
        __syncwarp();  // the next head overwrites `row`
    }
}

// ---- tiled attention (prefill, chunked prefill, verify, draft block) ------------------------------

size_t tiled_smem_bytes(int D) {
    return sizeof(float) *
           (kTileQ * D + kTileK * (D + 1) + kTileK * D + kTileQ * (kTileK + 1));
}

__device__ __forceinline__ float group_max(float v) {
    for (int off = kRowThreads / 2; off > 0; off /= 2) {
        v = fmaxf(v, __shfl_xor_sync(kFullMask, v, off));
    }
    return v;
}
__device__ __forceinline__ float group_sum(float v) {
    for (int off = kRowThreads / 2; off > 0; off /= 2) {
        v += __shfl_xor_sync(kFullMask, v, off);
    }
    return v;
}

// Grid (ceil(S / 16), Hq, B), 128 threads: thread t serves query row t / 8 of the tile and
// channels (t % 8) + 8k of it. Each step loads 32 keys (K padded to D+1 floats per row so the
// 8 threads of a row hit different banks), scores them, and folds them into the row's online
// softmax; the weights go through shared memory for the P @ V product.
template <typename T, typename KV, int DMAX>
__global__ void __launch_bounds__(kTiledThreads)
    attention_tiled_kernel(EbAttentionParams p, Geometry g, const float* q_ws, const KV* k_ws,
                           const KV* v_ws) {
    EB_DYNAMIC_SMEM(float, smem);
    constexpr int kPerThread = DMAX / kRowThreads;
    const int D = g.head_dim;
    const int ldk = D + 1, ldp = kTileK + 1;
    float* q_s = smem;                 // [kTileQ][D]
    float* k_s = q_s + kTileQ * D;     // [kTileK][D + 1]
    float* v_s = k_s + kTileK * ldk;   // [kTileK][D]
    float* p_s = v_s + kTileK * D;     // [kTileQ][kTileK + 1]

    const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * kTileQ;
    const int r = threadIdx.x / kRowThreads, c = threadIdx.x % kRowThreads;
    const int i = q0 + r;
    const int len = p.input_lengths[b], past = p.past_lengths[b];
    T* out = static_cast<T*>(p.out);

    if (q0 >= len) {  // a tile of padding rows only: zeros
        if (i < g.seq_len) {
            for (int d = c; d < D; d += kRowThreads) {
                Storage<T>::store(out + g.q_offset(b, i, h) + d, 0.0f);
            }
        }
        return;
    }
    for (int idx = threadIdx.x; idx < kTileQ * D; idx += kTiledThreads) {
        const int rr = idx / D;
        q_s[idx] = q0 + rr < len ? q_ws[g.q_offset(b, q0 + rr, h) + idx % D] : 0.0f;
    }
    const bool row_valid = i < len;
    const uint8_t* tree =
        p.has_tree_mask && row_valid
            ? p.tree_mask + (static_cast<int64_t>(b) * g.seq_len + i) * g.seq_len
            : nullptr;
    const RowMask mask{past, len, i, p.causal, p.sliding_window, tree};
    // The union of the valid rows' scan ranges: the window start grows with the row, and the
    // end is the last valid row's (causal) or past + len (tree / non-causal).
    const int last = imin(q0 + kTileQ, len) - 1;
    const int lo = RowMask{past, len, q0, p.causal, p.sliding_window, nullptr}.begin();
    const int hi = (p.has_tree_mask || !p.causal) ? past + len : past + last + 1;

    const int kvh = g.kv_head_of(h);
    const KeySource<KV> src{static_cast<const KV*>(p.kv_cache), k_ws, v_ws,
                            p.page_table + static_cast<int64_t>(b) * g.max_pages_per_seq, b,
                            past};
    SoftmaxState st = softmax_start();
    float acc[kPerThread];
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
        acc[k] = 0.0f;
    }
    __syncthreads();

    for (int kt = lo; kt < hi; kt += kTileK) {
        const int n = imin(kTileK, hi - kt);
        for (int idx = threadIdx.x; idx < kTileK * D; idx += kTiledThreads) {
            const int j = idx / D, d = idx % D;
            float kx = 0.0f, vx = 0.0f;
            if (j < n) {
                kx = kv_load<KV>(src.key(g, kt + j, kvh) + d, p.kv_scale);
                vx = kv_load<KV>(src.value(g, kt + j, kvh) + d, p.kv_scale);
            }
            k_s[j * ldk + d] = kx;
            v_s[j * D + d] = vx;
        }
        __syncthreads();

        float scores[kTileK / kRowThreads];
        float tile_max = neg_inf();
#pragma unroll
        for (int u = 0; u < kTileK / kRowThreads; ++u) {
            const int j = c + u * kRowThreads;
            float s = neg_inf();
            if (row_valid && j < n && mask.visible(kt + j)) {
                float dot = 0.0f;
                for (int d = 0; d < D; ++d) {
                    dot += q_s[r * D + d] * k_s[j * ldk + d];
                }
                s = dot * p.scale;
            }
            scores[u] = s;
            tile_max = fmaxf(tile_max, s);
        }
        tile_max = group_max(tile_max);
        float m_used;
        const float alpha = softmax_advance(st, tile_max, &m_used);
        float weight_sum = 0.0f;
#pragma unroll
        for (int u = 0; u < kTileK / kRowThreads; ++u) {
            const float w = softmax_weight(scores[u], m_used);
            p_s[r * ldp + c + u * kRowThreads] = w;
            weight_sum += w;
        }
        softmax_add(st, group_sum(weight_sum));
        __syncwarp();
#pragma unroll
        for (int k = 0; k < kPerThread; ++k) {
            const int d = c + k * kRowThreads;
            if (d < D) {
                float a = acc[k] * alpha;
                for (int j = 0; j < n; ++j) {
                    a += p_s[r * ldp + j] * v_s[j * D + d];
                }
                acc[k] = a;
            }
        }
        __syncthreads();  // k_s / v_s / p_s are overwritten by the next step
    }

    if (i < g.seq_len) {
        const float norm = row_valid ? softmax_normalizer(st) : 0.0f;
#pragma unroll
        for (int k = 0; k < kPerThread; ++k) {
            const int d = c + k * kRowThreads;
            if (d < D) {
                Storage<T>::store(out + g.q_offset(b, i, h) + d, acc[k] * norm);
            }
        }
    }
}

// ---- row attention (decode) ------------------------------------------------------------------------

// Grid (S, Hq, B), 128 threads. Lane l holds channels l + 32k of q and of the accumulator;
// warp w takes slots begin + w, begin + w + 4, ...; per slot the warp reduces the dot product
// with shuffles and updates its online softmax. The 4 partial states merge through shared
// memory (softmax_rescale to the common max).
template <typename T, typename KV, int DMAX>
__global__ void __launch_bounds__(kRowWarps * kWarpLanes)
    attention_row_kernel(EbAttentionParams p, Geometry g, const float* q_ws, const KV* k_ws,
                         const KV* v_ws) {
    constexpr int kPerLane = DMAX / kWarpLanes;
    __shared__ float part_m[kRowWarps];
    __shared__ float part_l[kRowWarps];
    __shared__ float part_acc[kRowWarps][DMAX];

    const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / kWarpLanes, lane = threadIdx.x % kWarpLanes;
    const int D = g.head_dim;
    const int len = p.input_lengths[b], past = p.past_lengths[b];
    T* out = static_cast<T*>(p.out) + g.q_offset(b, i, h);
    if (i >= len) {
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            Storage<T>::store(out + d, 0.0f);
        }
        return;
    }
    float q[kPerLane], acc[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
        const int d = lane + k * kWarpLanes;
        q[k] = d < D ? q_ws[g.q_offset(b, i, h) + d] : 0.0f;
        acc[k] = 0.0f;
    }
    const uint8_t* tree =
        p.has_tree_mask ? p.tree_mask + (static_cast<int64_t>(b) * g.seq_len + i) * g.seq_len
                        : nullptr;
    const RowMask mask{past, len, i, p.causal, p.sliding_window, tree};
    const int kvh = g.kv_head_of(h);
    const KeySource<KV> src{static_cast<const KV*>(p.kv_cache), k_ws, v_ws,
                            p.page_table + static_cast<int64_t>(b) * g.max_pages_per_seq, b,
                            past};
    SoftmaxState st = softmax_start();
    const int end = mask.end();
    for (int t = mask.begin() + warp; t < end; t += kRowWarps) {
        if (!mask.visible(t)) {  // uniform across the warp
            continue;
        }
        const KV* kp = src.key(g, t, kvh);
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
            const int d = lane + k * kWarpLanes;
            if (d < D) {
                dot += q[k] * kv_load<KV>(kp + d, p.kv_scale);
            }
        }
        for (int off = kWarpLanes / 2; off > 0; off /= 2) {
            dot += __shfl_xor_sync(kFullMask, dot, off);
        }
        const float s = dot * p.scale;
        float m_used;
        const float alpha = softmax_advance(st, s, &m_used);
        const float w = softmax_weight(s, m_used);
        softmax_add(st, w);
        const KV* vp = src.value(g, t, kvh);
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
            const int d = lane + k * kWarpLanes;
            if (d < D) {
                acc[k] = acc[k] * alpha + w * kv_load<KV>(vp + d, p.kv_scale);
            }
        }
    }
    if (lane == 0) {
        part_m[warp] = st.m;
        part_l[warp] = st.l;
    }
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
        const int d = lane + k * kWarpLanes;
        if (d < D) {
            part_acc[warp][d] = acc[k];
        }
    }
    __syncthreads();
    float m = neg_inf();
    for (int w = 0; w < kRowWarps; ++w) {
        m = fmaxf(m, part_m[w]);
    }
    SoftmaxState total{m, 0.0f};
    float factor[kRowWarps];
    for (int w = 0; w < kRowWarps; ++w) {
        factor[w] = softmax_rescale(part_m[w], m);
        total.l += part_l[w] * factor[w];
    }
    const float norm = softmax_normalizer(total);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float v = 0.0f;
        for (int w = 0; w < kRowWarps; ++w) {
            v += part_acc[w][d] * factor[w];
        }
        Storage<T>::store(out + d, v * norm);
    }
}

// ---- launch ------------------------------------------------------------------------------------------

template <typename T, typename KV, int DMAX>
cudaError_t launch_attention(const EbAttentionParams& p, const Geometry& g, const float* q_ws,
                             const KV* k_ws, const KV* v_ws, bool row_kernel,
                             cudaStream_t stream) {
    if (row_kernel) {
        const dim3 grid(g.seq_len, g.num_q_heads, g.batch);
        return launch_kernel(attention_row_kernel<T, KV, DMAX>, grid, dim3(kRowWarps * kWarpLanes),
                             0, stream, p, g, q_ws, k_ws, v_ws);
    }
    const size_t smem = tiled_smem_bytes(g.head_dim);
    if (smem > 48 * 1024) {  // above the default limit: opt in (all targets allow >= 99 KiB)
        const cudaError_t e = cudaFuncSetAttribute(attention_tiled_kernel<T, KV, DMAX>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(smem));
        if (e != cudaSuccess) {
            return e;
        }
    }
    const dim3 grid((g.seq_len + kTileQ - 1) / kTileQ, g.num_q_heads, g.batch);
    return launch_kernel(attention_tiled_kernel<T, KV, DMAX>, grid, dim3(kTiledThreads), smem,
                         stream, p, g, q_ws, k_ws, v_ws);
}

template <typename T, typename KV>
cudaError_t launch_typed(const EbAttentionParams& p, void* workspace, bool row_kernel,
                         cudaStream_t stream) {
    const Geometry g = geometry_of(p);
    const size_t rows = static_cast<size_t>(g.batch) * g.seq_len;
    char* base = static_cast<char*>(workspace);
    float* q_ws = reinterpret_cast<float*>(base);
    base += align_up(rows * g.num_q_heads * g.head_dim * sizeof(float));
    KV* k_ws = reinterpret_cast<KV*>(base);
    base += align_up(rows * g.num_kv_heads * g.head_dim * sizeof(KV));
    KV* v_ws = reinterpret_cast<KV*>(base);

    const cudaError_t e =
        launch_kernel(prepare_kernel<T, KV>, dim3(g.seq_len, g.batch),
                      dim3(kPrepareWarps * kWarpLanes), 0, stream, p, g, q_ws, k_ws, v_ws);
    if (e != cudaSuccess) {
        return e;
    }
    if (g.head_dim <= 128) {
        return launch_attention<T, KV, 128>(p, g, q_ws, k_ws, v_ws, row_kernel, stream);
    }
    return launch_attention<T, KV, EB_MAX_HEAD_DIM>(p, g, q_ws, k_ws, v_ws, row_kernel, stream);
}

}  // namespace
}  // namespace eb

extern "C" size_t eb_attention_workspace_size(int32_t batch, int32_t seq_len, int32_t num_q_heads,
                                              int32_t num_kv_heads, int32_t head_dim,
                                              int32_t kv_dtype) {
    const size_t rows = static_cast<size_t>(std::max(batch, 0)) * std::max(seq_len, 0);
    const size_t kv = rows * std::max(num_kv_heads, 0) * std::max(head_dim, 0) *
                      eb::dtype_bytes(kv_dtype);
    return eb::align_up(rows * std::max(num_q_heads, 0) * std::max(head_dim, 0) * sizeof(float)) +
           2 * eb::align_up(kv);
}

extern "C" int32_t eb_attention_enqueue(const EbAttentionParams* p, void* workspace,
                                        size_t workspace_bytes, void* stream,
                                        int32_t kernel_choice, char* err, int32_t err_len) {
    const int32_t status = eb_validate_params(p, err, err_len);
    if (status != EB_OK) {
        return status;
    }
    if (p->batch == 0 || p->seq_len == 0) {
        return EB_OK;
    }
    if (p->batch > 65535 || p->num_q_heads > 65535) {
        return eb_fail(err, err_len, EB_ERR_UNSUPPORTED,
                       "batch and num_q_heads must be <= 65535 (CUDA grid y/z limits)");
    }
    const size_t needed = eb_attention_workspace_size(p->batch, p->seq_len, p->num_q_heads,
                                                      p->num_kv_heads, p->head_dim, p->kv_dtype);
    if (workspace == nullptr || workspace_bytes < needed) {
        char msg[160];
        snprintf(msg, sizeof(msg), "workspace of %zu bytes is too small: this call needs %zu",
                 workspace_bytes, needed);
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, msg);
    }
    const bool row = kernel_choice == EB_KERNEL_ROW ||
                     (kernel_choice == EB_KERNEL_AUTO && p->seq_len == 1);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    cudaError_t e = cudaErrorInvalidValue;
    bool served = true;
    const int io = p->io_dtype, kv = p->kv_dtype;
    if (io == EB_DTYPE_FLOAT32 && kv == EB_DTYPE_FLOAT32) {
        e = eb::launch_typed<float, float>(*p, workspace, row, s);
    } else if (io == EB_DTYPE_FLOAT16 && kv == EB_DTYPE_FLOAT16) {
        e = eb::launch_typed<eb::f16, eb::f16>(*p, workspace, row, s);
    } else if (io == EB_DTYPE_BFLOAT16 && kv == EB_DTYPE_BFLOAT16) {
        e = eb::launch_typed<eb::bf16, eb::bf16>(*p, workspace, row, s);
    } else if (io == EB_DTYPE_FLOAT16 && kv == EB_DTYPE_FP8_E4M3) {
        e = eb::launch_typed<eb::f16, eb::fp8e4m3>(*p, workspace, row, s);
    } else if (io == EB_DTYPE_BFLOAT16 && kv == EB_DTYPE_FP8_E4M3) {
        e = eb::launch_typed<eb::bf16, eb::fp8e4m3>(*p, workspace, row, s);
    } else {
        served = false;
    }
    if (!served) {
        char msg[160];
        snprintf(msg, sizeof(msg),
                 "io_dtype %d with kv_dtype %d is not built: the kernels serve fp32/fp32, "
                 "fp16/fp16, bf16/bf16, fp16/fp8 and bf16/fp8",
                 io, kv);
        return eb_fail(err, err_len, EB_ERR_UNSUPPORTED, msg);
    }
    if (e != cudaSuccess) {
        char msg[200];
        snprintf(msg, sizeof(msg), "attention kernel launch failed: %s", cudaGetErrorString(e));
        return eb_fail(err, err_len, EB_ERR_CUDA, msg);
    }
    return EB_OK;
}
