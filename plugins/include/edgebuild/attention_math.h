// plugins/include/edgebuild/attention_math.h
//
// Owns: the per-element and per-tile math of the attention contract, written once for the
// host build and the CUDA kernels (EB_HD = __host__ __device__ under nvcc, inline under g++):
//   - addressing: packed qkv rows, the paged KV cache [num_pages, 2, Hkv, page_size, D],
//     the per-call K/V workspace, the GQA head mapping;
//   - masks: which key slot a new row may see (causal / non-causal / tree mask, sliding
//     window) and the slot range worth scanning;
//   - per-head RMSNorm (fixed reduction order) and rotate-half RoPE from the fp32 table;
//   - online softmax with a running max (flash-attention style), incl. merging two states.
//
// The host build (src/attention_host.cpp) composes these sequentially; the kernels
// (src/attention_kernels.cu) compose them in parallel. Numerics follow the reference op's
// docstring: norm and RoPE in fp32, rounded to the qkv dtype after the norm, after the gamma
// product and after RoPE (HF order); new K/V rounded to the cache dtype before use.
#pragma once

#include "edgebuild/numeric.h"

namespace eb {

constexpr int kWarpLanes = 32;

EB_HD float neg_inf() { return bits_float(0xff800000u); }
EB_HD int imin(int a, int b) { return a < b ? a : b; }
EB_HD int imax(int a, int b) { return a > b ? a : b; }

// ---- shapes and addressing ------------------------------------------------------------------

struct Geometry {
    int batch;
    int seq_len;
    int num_q_heads;
    int num_kv_heads;
    int head_dim;
    int rotary_dim;
    int page_size;
    int max_pages_per_seq;

    // Channels of one packed qkv row: Hq q heads, then Hkv k heads, then Hkv v heads.
    EB_HD int qkv_width() const { return (num_q_heads + 2 * num_kv_heads) * head_dim; }
    // GQA: q head h reads KV head h / (Hq / Hkv).
    EB_HD int kv_head_of(int q_head) const { return q_head / (num_q_heads / num_kv_heads); }

    // Element index of channel 0 of head column `col` (0 .. Hq+2*Hkv-1) of new row (b, s).
    EB_HD int64_t qkv_offset(int b, int s, int col) const {
        return (static_cast<int64_t>(b) * seq_len + s) * qkv_width() +
               static_cast<int64_t>(col) * head_dim;
    }
    // Element index of channel 0 of q head h of row (b, s) in the output / q workspace.
    EB_HD int64_t q_offset(int b, int s, int h) const {
        return ((static_cast<int64_t>(b) * seq_len + s) * num_q_heads + h) * head_dim;
    }
    // Element index of channel 0 of KV head kvh of new row (b, s) in the K or V workspace
    // ([B, S, Hkv, D] in the cache dtype).
    EB_HD int64_t new_kv_offset(int b, int s, int kvh) const {
        return ((static_cast<int64_t>(b) * seq_len + s) * num_kv_heads + kvh) * head_dim;
    }
    // Element index of channel 0 of (page, K=0/V=1, kv head, in-page offset) in the cache.
    EB_HD int64_t cache_offset(int32_t page, int kv, int kvh, int in_page) const {
        return (((static_cast<int64_t>(page) * 2 + kv) * num_kv_heads + kvh) * page_size +
                in_page) *
               head_dim;
    }
    // Cache slot t of a sequence lives on page page_row[t / page_size] at offset t % page_size.
    EB_HD int64_t slot_offset(const int32_t* page_row, int slot, int kv, int kvh) const {
        return cache_offset(page_row[slot / page_size], kv, kvh, slot % page_size);
    }
};

// ---- KV storage: the fp8 cache carries a scale, the others store values as they are ---------

template <typename KV>
EB_HD float kv_load(const KV* p, float /*kv_scale*/) {
    return Storage<KV>::load(p);
}
template <>
EB_HD float kv_load<fp8e4m3>(const fp8e4m3* p, float kv_scale) {
    return mul_rn(Storage<fp8e4m3>::load(p), kv_scale);
}
template <typename KV>
EB_HD void kv_store(KV* p, float x, float /*kv_scale*/) {
    Storage<KV>::store(p, x);
}
template <>
EB_HD void kv_store<fp8e4m3>(fp8e4m3* p, float x, float kv_scale) {
    Storage<fp8e4m3>::store(p, div_rn(x, kv_scale));
}

// Where the keys and values of one sequence are read from: cached slots t < past from the
// paged cache, this call's rows (slot past + j) from the workspace. The workspace already
// holds them in the cache dtype, so a key is bit-identical whether it is used fresh now or
// read back from the cache by a later call (chunked prefill == one prefill).
template <typename KV>
struct KeySource {
    const KV* cache;
    const KV* new_k;  // workspace [B, S, Hkv, D]
    const KV* new_v;
    const int32_t* page_row;  // page_table[b]
    int b;
    int past;

    EB_HD const KV* key(const Geometry& g, int slot, int kvh) const {
        return slot < past ? cache + g.slot_offset(page_row, slot, 0, kvh)
                           : new_k + g.new_kv_offset(b, slot - past, kvh);
    }
    EB_HD const KV* value(const Geometry& g, int slot, int kvh) const {
        return slot < past ? cache + g.slot_offset(page_row, slot, 1, kvh)
                           : new_v + g.new_kv_offset(b, slot - past, kvh);
    }
};

// ---- masks ------------------------------------------------------------------------------------

// Visibility rule (contract rule 3) for new row q_row of one sequence.
struct RowMask {
    int past;             // P: cached slots 0..P-1
    int input_len;        // L: valid new rows
    int q_row;            // i: this query's new-row index (slot P + i)
    int causal;           // 1: new row j visible iff j <= i
    int window;           // sliding window w (0 = off)
    const uint8_t* tree;  // tree_mask[b, i, :] (S bytes) or nullptr; replaces `causal`

    EB_HD bool visible(int slot) const {
        if (window > 0 && (past + q_row) - slot >= window) {
            return false;
        }
        if (slot < past) {
            return true;
        }
        const int j = slot - past;
        if (j >= input_len) {
            return false;
        }
        if (tree != nullptr) {
            return tree[j] != 0;
        }
        return !causal || j <= q_row;
    }
    // Slots outside [begin, end) are never visible: the scan range of this row.
    EB_HD int begin() const { return window > 0 ? imax(0, past + q_row - window + 1) : 0; }
    EB_HD int end() const {
        return (tree != nullptr || !causal) ? past + input_len : past + q_row + 1;
    }
};

// ---- RMSNorm (per head, HF fp32-variance order) -------------------------------------------------

// Lane `lane`'s partial sum of squares: channels lane, lane+32, ... in order. The kernels
// reduce the 32 partials with an xor butterfly; the host emulates the same order, so both
// get the same bits (fp32 addition is commutative, so a+b == b+a exactly).
EB_HD float lane_sum_squares(const float* x, int n, int lane) {
    float acc = 0.0f;
    for (int d = lane; d < n; d += kWarpLanes) {
        acc = add_rn(acc, mul_rn(x[d], x[d]));
    }
    return acc;
}

// 1 / sqrt(mean(x^2) + eps) from the reduced sum of squares of n channels.
EB_HD float rms_inverse(float sum_squares, int n, float eps) {
    return div_rn(1.0f, sqrt_rn(add_rn(div_rn(sum_squares, static_cast<float>(n)), eps)));
}

// One normalised channel: round_T(round_T(x * inv) * gamma). gamma is T-valued, so the
// product of two T values is exact in fp32 before its one rounding (as torch computes it).
template <typename T>
EB_HD float rms_norm_element(float x, float inv, float gamma) {
    return Storage<T>::round(mul_rn(gamma, Storage<T>::round(mul_rn(x, inv))));
}

// ---- RoPE (rotate half on the first rotary_dim channels) ----------------------------------------

// Channel d of RoPE(x) at the position whose table row is cs = [cos * s | sin * s]
// (rotary_dim / 2 each). Channels past rotary_dim pass through. Result rounded to T.
template <typename T>
EB_HD float rope_element(const float* x, int d, int rotary_dim, const float* cs) {
    if (d >= rotary_dim) {
        return x[d];
    }
    const int half = rotary_dim / 2;
    float v;
    if (d < half) {  // x1 * cos - x2 * sin
        v = sub_rn(mul_rn(x[d], cs[d]), mul_rn(x[d + half], cs[half + d]));
    } else {  // x2 * cos + x1 * sin
        const int i = d - half;
        v = add_rn(mul_rn(x[d], cs[i]), mul_rn(x[i], cs[half + i]));
    }
    return Storage<T>::round(v);
}

// ---- online softmax ---------------------------------------------------------------------------

// Running max m and running sum l of exp(s - m) over the keys folded in so far; the caller
// keeps acc = sum exp(s - m) * v and rescales it by the factor each update returns.
struct SoftmaxState {
    float m;
    float l;
};

EB_HD SoftmaxState softmax_start() { return SoftmaxState{neg_inf(), 0.0f}; }

// exp(s - m) with masked scores (-inf) giving exactly 0, also when m is still -inf.
EB_HD float softmax_weight(float s, float m) { return s == neg_inf() ? 0.0f : expf(s - m); }

// Factor that moves an accumulator from max m_old to max m_new (0 when nothing was seen yet).
EB_HD float softmax_rescale(float m_old, float m_new) {
    return m_old == neg_inf() ? 0.0f : expf(m_old - m_new);
}

// Folds a block of scores with maximum block_max into the state: returns the accumulator
// rescale factor and sets *m_used, the max to pass to softmax_weight for this block's scores.
// The caller then adds the block's sum of weights with softmax_add.
EB_HD float softmax_advance(SoftmaxState& st, float block_max, float* m_used) {
    const float m_new = fmaxf(st.m, block_max);
    const float alpha = softmax_rescale(st.m, m_new);
    st.l = st.l * alpha;
    st.m = m_new;
    *m_used = m_new;
    return alpha;
}
EB_HD void softmax_add(SoftmaxState& st, float weight_sum) { st.l += weight_sum; }

// Merges state b (with accumulator scale *scale_b) into a (scale *scale_a): the split-key
// partial results of the decode kernel's warps.
EB_HD SoftmaxState softmax_merge(SoftmaxState a, SoftmaxState b, float* scale_a, float* scale_b) {
    const float m = fmaxf(a.m, b.m);
    *scale_a = softmax_rescale(a.m, m);
    *scale_b = softmax_rescale(b.m, m);
    return SoftmaxState{m, a.l * *scale_a + b.l * *scale_b};
}

// 1 / l, or 0 for a row that saw no key (contract: such a row outputs zeros).
EB_HD float softmax_normalizer(const SoftmaxState& st) { return st.l > 0.0f ? 1.0f / st.l : 0.0f; }

}  // namespace eb
