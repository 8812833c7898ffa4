// plugins/src/attention_host.cpp
//
// Owns: the host (CPU) build of the attention plugin's computation and its C ABI.
//
// Why: no GPU is needed to check the kernel math. This file runs the full attention contract
// (prepare q/k/v with norm + RoPE, write the paged cache, masked online-softmax attention)
// by calling the same header functions the CUDA kernels call (attention_math.h), in the same
// reduction orders where bits matter (norm), so that:
//   - tests/test_plugin_host.py loads it with ctypes and compares it with the Python
//     reference op on every phase (fp32 to 1e-4; fp16/bf16/fp8 storage paths too);
//   - plugins/tests/cuda_check.cu links it and compares the CUDA kernels with it on a GPU.
// Unlike the kernels it also checks the data (page ids, lengths, positions) before any write,
// as the reference op does.
//
// Build: g++ -std=c++17 -O2 -fPIC -shared -ffp-contract=off -Iplugins/include (see CMake).
// -ffp-contract=off matters: a fused multiply-add would change the bits of RoPE/norm results.

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "edgebuild/attention_host.h"
#include "edgebuild/attention_math.h"
#include "edgebuild/attention_params.h"

namespace {

using eb::Geometry;
using eb::KeySource;
using eb::RowMask;
using eb::Storage;

Geometry geometry_of(const EbAttentionParams& p) {
    return Geometry{p.batch,     p.seq_len,   p.num_q_heads, p.num_kv_heads,
                    p.head_dim,  p.rotary_dim, p.page_size,  p.max_pages_per_seq};
}

int32_t fail(char* err, int32_t err_len, int32_t code, const std::string& msg) {
    return eb_fail(err, err_len, code, msg.c_str());
}

// Data checks of the reference op (_check_values), run before anything is written.
int32_t check_data(const EbAttentionParams& p, char* err, int32_t err_len) {
    for (int b = 0; b < p.batch; ++b) {
        const int past = p.past_lengths[b];
        const int len = p.input_lengths[b];
        const std::string seq = "sequence " + std::to_string(b) + ": ";
        if (past < 0 || len < 0 || len > p.seq_len) {
            return fail(err, err_len, EB_ERR_INVALID_DATA,
                        seq + "past_lengths=" + std::to_string(past) + " must be >= 0 and " +
                            "input_lengths=" + std::to_string(len) + " in [0, S=" +
                            std::to_string(p.seq_len) + "]");
        }
        const int end = p.write_kv ? past + len : past;
        const int pages_needed = (end + p.page_size - 1) / p.page_size;
        if (pages_needed > p.max_pages_per_seq) {
            return fail(err, err_len, EB_ERR_INVALID_DATA,
                        seq + "needs " + std::to_string(pages_needed) + " pages for " +
                            std::to_string(end) + " slots but page_table has " +
                            std::to_string(p.max_pages_per_seq) +
                            " columns; allocate more pages for the sequence");
        }
        for (int j = 0; j < pages_needed; ++j) {
            const int page = p.page_table[static_cast<int64_t>(b) * p.max_pages_per_seq + j];
            if (page < 0 || page >= p.num_pages) {
                return fail(err, err_len, EB_ERR_INVALID_DATA,
                            seq + "page id " + std::to_string(page) + " (page_table column " +
                                std::to_string(j) + ") must be in [0, num_pages=" +
                                std::to_string(p.num_pages) + ")");
            }
        }
        for (int i = 0; p.rotary_dim > 0 && i < len; ++i) {
            const int pos = p.positions[static_cast<int64_t>(b) * p.seq_len + i];
            if (pos < 0 || pos >= p.max_position) {
                return fail(err, err_len, EB_ERR_INVALID_DATA,
                            seq + "position " + std::to_string(pos) + " of row " +
                                std::to_string(i) + " is outside the rope table (" +
                                std::to_string(p.max_position) +
                                " rows); build it with a larger max_position");
            }
        }
    }
    return EB_OK;
}

// Norm (optional) and RoPE of one head vector `raw` (T-valued fp32, D channels) into `out`,
// rounded to T. Sum of squares in the kernels' lane/butterfly order.
template <typename T>
void prepare_head(const float* raw, const float* gamma, const float* cs, const Geometry& g,
                  float eps, float* normed, float* out) {
    const int D = g.head_dim;
    if (gamma != nullptr) {
        float lanes[eb::kWarpLanes];
        for (int l = 0; l < eb::kWarpLanes; ++l) {
            lanes[l] = eb::lane_sum_squares(raw, D, l);
        }
        for (int off = eb::kWarpLanes / 2; off > 0; off /= 2) {
            float next[eb::kWarpLanes];
            for (int l = 0; l < eb::kWarpLanes; ++l) {
                next[l] = eb::add_rn(lanes[l], lanes[l ^ off]);
            }
            std::memcpy(lanes, next, sizeof(lanes));
        }
        const float inv = eb::rms_inverse(lanes[0], D, eps);
        for (int d = 0; d < D; ++d) {
            normed[d] = eb::rms_norm_element<T>(raw[d], inv, gamma[d]);
        }
    } else {
        std::memcpy(normed, raw, sizeof(float) * D);
    }
    for (int d = 0; d < D; ++d) {
        out[d] = eb::rope_element<T>(normed, d, g.rotary_dim, cs);
    }
}

template <typename T>
std::vector<float> load_vector(const void* src, int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    const T* s = static_cast<const T*>(src);
    for (int64_t i = 0; i < n; ++i) {
        v[i] = Storage<T>::load(s + i);
    }
    return v;
}

// Runs the whole contract. Workspaces: q [B, S, Hq, D] fp32 (T-valued), new K/V
// [B, S, Hkv, D] in the cache dtype, exactly as the CUDA path lays them out.
template <typename T, typename KV>
void run(const EbAttentionParams& p) {
    const Geometry g = geometry_of(p);
    const int D = g.head_dim, Hq = g.num_q_heads, Hkv = g.num_kv_heads;
    const T* qkv = static_cast<const T*>(p.qkv);
    KV* cache = static_cast<KV*>(p.kv_cache);
    T* out = static_cast<T*>(p.out);
    const int64_t rows = static_cast<int64_t>(p.batch) * p.seq_len;
    std::vector<float> q_ws(rows * Hq * D, 0.0f);
    std::vector<KV> k_ws(rows * Hkv * D), v_ws(rows * Hkv * D);
    std::vector<float> q_gamma, k_gamma;
    if (p.qk_norm) {
        q_gamma = load_vector<T>(p.q_norm_weight, D);
        k_gamma = load_vector<T>(p.k_norm_weight, D);
    }
    std::vector<float> raw(D), normed(D), prepared(D);

    // 1. prepare: q -> q_ws, k/v -> workspace in the cache dtype
    for (int b = 0; b < p.batch; ++b) {
        for (int s = 0; s < p.input_lengths[b]; ++s) {
            const float* cs = p.rotary_dim > 0
                                  ? p.rope_cos_sin + static_cast<int64_t>(p.positions[b * p.seq_len + s]) * p.rotary_dim
                                  : nullptr;
            for (int col = 0; col < Hq + 2 * Hkv; ++col) {
                const T* src = qkv + g.qkv_offset(b, s, col);
                for (int d = 0; d < D; ++d) {
                    raw[d] = Storage<T>::load(src + d);
                }
                if (col < Hq + Hkv) {
                    const bool is_q = col < Hq;
                    const float* gamma =
                        p.qk_norm ? (is_q ? q_gamma.data() : k_gamma.data()) : nullptr;
                    prepare_head<T>(raw.data(), gamma, cs, g, p.rms_norm_eps, normed.data(),
                                    prepared.data());
                    if (is_q) {
                        std::memcpy(&q_ws[g.q_offset(b, s, col)], prepared.data(),
                                    sizeof(float) * D);
                    } else {
                        KV* dst = &k_ws[g.new_kv_offset(b, s, col - Hq)];
                        for (int d = 0; d < D; ++d) {
                            eb::kv_store<KV>(dst + d, prepared[d], p.kv_scale);
                        }
                    }
                } else {
                    KV* dst = &v_ws[g.new_kv_offset(b, s, col - Hq - Hkv)];
                    for (int d = 0; d < D; ++d) {
                        eb::kv_store<KV>(dst + d, raw[d], p.kv_scale);
                    }
                }
            }
        }
    }

    // 2. attention, one (row, q head) at a time, folding keys into an online softmax
    std::memset(out, 0, sizeof(T) * rows * Hq * D);
    std::vector<float> acc(D);
    for (int b = 0; b < p.batch; ++b) {
        const int past = p.past_lengths[b], len = p.input_lengths[b];
        const int32_t* page_row = p.page_table + static_cast<int64_t>(b) * p.max_pages_per_seq;
        const KeySource<KV> src{cache, k_ws.data(), v_ws.data(), page_row, b, past};
        for (int i = 0; i < len; ++i) {
            const uint8_t* tree =
                p.has_tree_mask ? p.tree_mask + (static_cast<int64_t>(b) * p.seq_len + i) * p.seq_len
                                : nullptr;
            const RowMask mask{past, len, i, p.causal, p.sliding_window, tree};
            for (int h = 0; h < Hq; ++h) {
                const int kvh = g.kv_head_of(h);
                const float* q = &q_ws[g.q_offset(b, i, h)];
                eb::SoftmaxState st = eb::softmax_start();
                std::fill(acc.begin(), acc.end(), 0.0f);
                for (int t = mask.begin(); t < mask.end(); ++t) {
                    if (!mask.visible(t)) {
                        continue;
                    }
                    const KV* k = src.key(g, t, kvh);
                    float dot = 0.0f;
                    for (int d = 0; d < D; ++d) {
                        dot += q[d] * eb::kv_load<KV>(k + d, p.kv_scale);
                    }
                    const float score = dot * p.scale;
                    float m = 0.0f;
                    const float alpha = eb::softmax_advance(st, score, &m);
                    const float w = eb::softmax_weight(score, m);
                    eb::softmax_add(st, w);
                    const KV* v = src.value(g, t, kvh);
                    for (int d = 0; d < D; ++d) {
                        acc[d] = acc[d] * alpha + w * eb::kv_load<KV>(v + d, p.kv_scale);
                    }
                }
                const float norm = eb::softmax_normalizer(st);
                T* o = out + g.q_offset(b, i, h);
                for (int d = 0; d < D; ++d) {
                    Storage<T>::store(o + d, acc[d] * norm);
                }
            }
        }
    }

    // 3. write the new K/V into their cache slots (after the reads, as the contract says)
    if (!p.write_kv) {
        return;
    }
    for (int b = 0; b < p.batch; ++b) {
        const int32_t* page_row = p.page_table + static_cast<int64_t>(b) * p.max_pages_per_seq;
        for (int s = 0; s < p.input_lengths[b]; ++s) {
            for (int kvh = 0; kvh < Hkv; ++kvh) {
                const int slot = p.past_lengths[b] + s;
                std::memcpy(cache + g.slot_offset(page_row, slot, 0, kvh),
                            &k_ws[g.new_kv_offset(b, s, kvh)], sizeof(KV) * D);
                std::memcpy(cache + g.slot_offset(page_row, slot, 1, kvh),
                            &v_ws[g.new_kv_offset(b, s, kvh)], sizeof(KV) * D);
            }
        }
    }
}

template <typename T>
bool dispatch_kv(const EbAttentionParams& p) {
    switch (p.kv_dtype) {
        case EB_DTYPE_FLOAT32: run<T, float>(p); return true;
        case EB_DTYPE_FLOAT16: run<T, eb::f16>(p); return true;
        case EB_DTYPE_BFLOAT16: run<T, eb::bf16>(p); return true;
        case EB_DTYPE_FP8_E4M3: run<T, eb::fp8e4m3>(p); return true;
        default: return false;
    }
}

float load_any(const void* src, int32_t dtype, int64_t i) {
    switch (dtype) {
        case EB_DTYPE_FLOAT32: return Storage<float>::load(static_cast<const float*>(src) + i);
        case EB_DTYPE_FLOAT16: return Storage<eb::f16>::load(static_cast<const eb::f16*>(src) + i);
        case EB_DTYPE_BFLOAT16:
            return Storage<eb::bf16>::load(static_cast<const eb::bf16*>(src) + i);
        default: return Storage<eb::fp8e4m3>::load(static_cast<const eb::fp8e4m3*>(src) + i);
    }
}

void store_any(void* dst, int32_t dtype, int64_t i, float x) {
    switch (dtype) {
        case EB_DTYPE_FLOAT32: Storage<float>::store(static_cast<float*>(dst) + i, x); break;
        case EB_DTYPE_FLOAT16: Storage<eb::f16>::store(static_cast<eb::f16*>(dst) + i, x); break;
        case EB_DTYPE_BFLOAT16: Storage<eb::bf16>::store(static_cast<eb::bf16*>(dst) + i, x); break;
        default: Storage<eb::fp8e4m3>::store(static_cast<eb::fp8e4m3*>(dst) + i, x); break;
    }
}

}  // namespace

extern "C" {

EB_HOST_EXPORT int32_t eb_host_abi_version(void) { return EB_ATTENTION_ABI_VERSION; }

EB_HOST_EXPORT int32_t eb_host_params_size(void) {
    return static_cast<int32_t>(sizeof(EbAttentionParams));
}

EB_HOST_EXPORT int32_t eb_host_validate_attributes(const EbAttentionParams* params, char* err,
                                                   int32_t err_len) {
    return eb_validate_attributes(params, err, err_len);
}

EB_HOST_EXPORT int32_t eb_host_paged_attention(const EbAttentionParams* params, char* err,
                                               int32_t err_len) {
    const int32_t status = eb_validate_params(params, err, err_len);
    if (status != EB_OK) {
        return status;
    }
    const EbAttentionParams& p = *params;
    if (p.batch == 0 || p.seq_len == 0) {
        return EB_OK;
    }
    const int32_t data_status = check_data(p, err, err_len);
    if (data_status != EB_OK) {
        return data_status;
    }
    bool served = false;
    switch (p.io_dtype) {
        case EB_DTYPE_FLOAT32: served = dispatch_kv<float>(p); break;
        case EB_DTYPE_FLOAT16: served = dispatch_kv<eb::f16>(p); break;
        case EB_DTYPE_BFLOAT16: served = dispatch_kv<eb::bf16>(p); break;
        default: break;
    }
    return served ? EB_OK
                  : eb_fail(err, err_len, EB_ERR_UNSUPPORTED, "unsupported io/kv dtype pair");
}

EB_HOST_EXPORT int32_t eb_host_convert(const void* src, int32_t src_dtype, void* dst,
                                       int32_t dst_dtype, int64_t count) {
    if (src_dtype < EB_DTYPE_FLOAT32 || src_dtype > EB_DTYPE_FP8_E4M3 ||
        dst_dtype < EB_DTYPE_FLOAT32 || dst_dtype > EB_DTYPE_FP8_E4M3 || count < 0) {
        return EB_ERR_INVALID_ARGUMENT;
    }
    for (int64_t i = 0; i < count; ++i) {
        store_any(dst, dst_dtype, i, load_any(src, src_dtype, i));
    }
    return EB_OK;
}

}  // extern "C"
