// plugins/tests/cuda_check.cu
//
// Owns: the standalone GPU check of the attention kernels (no TensorRT needed). For every
// phase (prefill, chunked prefill, decode, chain/tree verify, draft context update,
// non-causal draft block, cache-less vision), several head configs (GQA/MQA/MHA, q/k norm,
// partial RoPE, sliding window, head_dim 16..256, multi-tile shapes), every storage path
// (fp32, fp16, bf16, fp16+fp8 cache, bf16+fp8 cache) and both attention kernels (tiled, row),
// it runs the CUDA path (eb_attention_enqueue) and the host build (eb_host_paged_attention,
// which tests/test_plugin_host.py checks against the Python reference op) on the same random
// inputs with scattered pages and unequal lengths, and prints one PASS/FAIL line each:
//   - the written KV cache must be bit-identical (same header math, same roundings);
//   - attn_out within: fp32 1e-4 abs; fp16 2e-3 + 2e-3*|ref|; bf16 1.6e-2 + 1.6e-2*|ref|.
// Then it times the kernels on model-sized shapes and prints TIME lines.
//
// Built by CMake as edgebuild_cuda_check (links the kernels and the host build); run by
// scripts/gpu_check.sh. Without a GPU, tests/test_plugin_host.py compiles this same file and
// the kernels with g++ on cuda_emulation.h and runs `--no-timing --quick`.
// Then, with --bandwidth, a decode-attention bandwidth microbenchmark (BANDWIDTH lines: GB/s
// and % of the HBM roofline); --bandwidth-dry runs it on tiny shapes (the CPU emulation).
// Usage: edgebuild_cuda_check [--no-timing] [--quick] [--no-correctness] [--bandwidth |
// --bandwidth-dry] [--peak-gbps GBPS]. Exit code 0 iff every check passed.

#ifndef EB_KERNEL_EMULATION  // CPU emulation: plugins/tests/cuda_emulation.h stands in
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "edgebuild/attention_host.h"
#include "edgebuild/attention_kernels.h"
#include "edgebuild/numeric.h"

namespace {

#define CUDA_OK(call)                                                                   \
    do {                                                                                \
        const cudaError_t e_ = (call);                                                  \
        if (e_ != cudaSuccess) {                                                        \
            std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_),    \
                         __FILE__, __LINE__);                                           \
            std::exit(2);                                                               \
        }                                                                               \
    } while (0)

struct Case {
    std::string name;
    std::vector<int> past, lengths;
    int seq_len = 1;
    int causal = 1, write_kv = 1, tree = 0, no_cache = 0;
    int hq = 4, hkv = 2, d = 16, rotary = 16, qk_norm = 0, window = 0, page_size = 4;
};

struct StoragePath {
    const char* name;
    int io, kv;
};

const StoragePath kPaths[] = {{"fp32", EB_DTYPE_FLOAT32, EB_DTYPE_FLOAT32},
                              {"fp16", EB_DTYPE_FLOAT16, EB_DTYPE_FLOAT16},
                              {"bf16", EB_DTYPE_BFLOAT16, EB_DTYPE_BFLOAT16},
                              {"fp16+fp8kv", EB_DTYPE_FLOAT16, EB_DTYPE_FP8_E4M3},
                              {"bf16+fp8kv", EB_DTYPE_BFLOAT16, EB_DTYPE_FP8_E4M3}};

size_t bytes_of(int dtype) {
    return dtype == EB_DTYPE_FLOAT32 ? 4 : dtype == EB_DTYPE_FP8_E4M3 ? 1 : 2;
}

float load_as_float(const std::vector<uint8_t>& buf, int dtype, size_t i) {
    const void* p = buf.data() + i * bytes_of(dtype);
    switch (dtype) {
        case EB_DTYPE_FLOAT32: return eb::Storage<float>::load(static_cast<const float*>(p));
        case EB_DTYPE_FLOAT16: return eb::Storage<eb::f16>::load(static_cast<const eb::f16*>(p));
        case EB_DTYPE_BFLOAT16:
            return eb::Storage<eb::bf16>::load(static_cast<const eb::bf16*>(p));
        default: return eb::Storage<eb::fp8e4m3>::load(static_cast<const eb::fp8e4m3*>(p));
    }
}

std::vector<uint8_t> encode(const std::vector<float>& x, int dtype) {
    std::vector<uint8_t> out(x.size() * bytes_of(dtype));
    for (size_t i = 0; i < x.size(); ++i) {
        void* p = out.data() + i * bytes_of(dtype);
        switch (dtype) {
            case EB_DTYPE_FLOAT32: eb::Storage<float>::store(static_cast<float*>(p), x[i]); break;
            case EB_DTYPE_FLOAT16: eb::Storage<eb::f16>::store(static_cast<eb::f16*>(p), x[i]); break;
            case EB_DTYPE_BFLOAT16:
                eb::Storage<eb::bf16>::store(static_cast<eb::bf16*>(p), x[i]);
                break;
            default: eb::Storage<eb::fp8e4m3>::store(static_cast<eb::fp8e4m3*>(p), x[i]); break;
        }
    }
    return out;
}

// Host-side tensors of one call; `params` points into them.
struct Inputs {
    std::vector<uint8_t> qkv, cache, q_norm, k_norm, out, tree;
    std::vector<int32_t> page_table, past, lengths, positions;
    std::vector<float> rope;
    EbAttentionParams params{};
};

std::vector<float> randn(std::mt19937& rng, size_t n, float mean = 0.0f, float stddev = 1.0f) {
    std::normal_distribution<float> dist(mean, stddev);
    std::vector<float> v(n);
    for (auto& x : v) {
        x = dist(rng);
    }
    return v;
}

// Random tree per sequence: node j > 0 hangs under a random earlier node; a node sees its
// ancestors and itself. Positions follow the depth.
void fill_tree(std::mt19937& rng, const Case& c, Inputs& in) {
    const int S = c.seq_len;
    in.tree.assign(static_cast<size_t>(c.lengths.size()) * S * S, 0);
    for (size_t b = 0; b < c.lengths.size(); ++b) {
        std::vector<int> parent(S, -1), depth(S, 0);
        for (int j = 1; j < c.lengths[b]; ++j) {
            parent[j] = static_cast<int>(rng() % j);
            depth[j] = depth[parent[j]] + 1;
        }
        for (int i = 0; i < c.lengths[b]; ++i) {
            for (int node = i; node >= 0; node = parent[node]) {
                in.tree[(b * S + i) * S + node] = 1;
            }
            in.positions[b * S + i] = c.past[b] + depth[i];
        }
    }
}

void fill_pages(std::mt19937& rng, const Case& c, Inputs& in, int* num_pages, int* max_pages) {
    const int B = static_cast<int>(c.lengths.size());
    std::vector<int> need(B);
    for (int b = 0; b < B; ++b) {
        const int slots = c.past[b] + (c.write_kv ? c.lengths[b] : 0);
        need[b] = (slots + c.page_size - 1) / c.page_size;
    }
    *max_pages = c.no_cache ? 0 : *std::max_element(need.begin(), need.end()) + 1;
    *num_pages = 0;
    for (int b = 0; b < B && !c.no_cache; ++b) {
        *num_pages += need[b];
    }
    *num_pages += c.no_cache ? 0 : 3;  // spare pages must stay untouched
    std::vector<int> order(*num_pages);
    for (int i = 0; i < *num_pages; ++i) {
        order[i] = i;
    }
    std::shuffle(order.begin(), order.end(), rng);
    in.page_table.assign(static_cast<size_t>(B) * *max_pages, -1);
    int cursor = 0;
    for (int b = 0; b < B && !c.no_cache; ++b) {
        for (int j = 0; j < need[b]; ++j) {
            in.page_table[b * *max_pages + j] = order[cursor++];
        }
    }
}

// RoPE table as the Python rope_cos_sin_table builds it (default rope, theta 10000).
std::vector<float> rope_table(int rotary, int max_position) {
    std::vector<float> t(static_cast<size_t>(max_position) * rotary);
    const int half = rotary / 2;
    for (int pos = 0; pos < max_position; ++pos) {
        for (int i = 0; i < half; ++i) {
            const float inv_freq = 1.0f / std::pow(10000.0f, (2.0f * i) / rotary);
            const float f = static_cast<float>(pos) * inv_freq;
            t[pos * rotary + i] = std::cos(f);
            t[pos * rotary + half + i] = std::sin(f);
        }
    }
    return t;
}

Inputs make_inputs(const Case& c, const StoragePath& path, unsigned seed) {
    std::mt19937 rng(seed);
    Inputs in;
    const int B = static_cast<int>(c.lengths.size()), S = c.seq_len, D = c.d;
    int num_pages = 0, max_pages = 0;
    fill_pages(rng, c, in, &num_pages, &max_pages);
    in.past = c.past;
    in.lengths = c.lengths;
    in.positions.assign(static_cast<size_t>(B) * S, -7);  // padding rows: never read
    for (int b = 0; b < B; ++b) {
        for (int i = 0; i < c.lengths[b]; ++i) {
            in.positions[b * S + i] = c.past[b] + i;
        }
    }
    if (c.tree) {
        fill_tree(rng, c, in);
    }
    const int max_position = *std::max_element(c.past.begin(), c.past.end()) + S + 4;
    in.rope = rope_table(c.rotary, max_position);
    in.qkv = encode(randn(rng, static_cast<size_t>(B) * S * (c.hq + 2 * c.hkv) * D), path.io);
    in.cache = encode(randn(rng, static_cast<size_t>(num_pages) * 2 * c.hkv * c.page_size * D),
                      path.kv);
    if (c.qk_norm) {
        in.q_norm = encode(randn(rng, D, 1.0f, 0.3f), path.io);
        in.k_norm = encode(randn(rng, D, 1.0f, 0.3f), path.io);
    }
    in.out.assign(static_cast<size_t>(B) * S * c.hq * D * bytes_of(path.io), 0x5a);

    EbAttentionParams& p = in.params;
    p.struct_size = sizeof(EbAttentionParams);
    p.batch = B, p.seq_len = S, p.num_pages = num_pages, p.max_pages_per_seq = max_pages;
    p.max_position = max_position;
    p.num_q_heads = c.hq, p.num_kv_heads = c.hkv, p.head_dim = D, p.rotary_dim = c.rotary;
    p.page_size = c.page_size, p.causal = c.causal, p.write_kv = c.write_kv;
    p.sliding_window = c.window, p.qk_norm = c.qk_norm, p.has_tree_mask = c.tree;
    p.io_dtype = path.io, p.kv_dtype = path.kv;
    p.scale = 1.0f / std::sqrt(static_cast<float>(D));
    p.rms_norm_eps = 1e-6f, p.kv_scale = 1.0f;
    return in;
}

// Points params at the host vectors.
EbAttentionParams host_view(Inputs& in) {
    EbAttentionParams p = in.params;
    p.qkv = in.qkv.data(), p.kv_cache = in.cache.empty() ? nullptr : in.cache.data();
    p.page_table = in.page_table.empty() ? nullptr : in.page_table.data();
    p.past_lengths = in.past.data(), p.input_lengths = in.lengths.data();
    p.positions = in.positions.data(), p.rope_cos_sin = in.rope.empty() ? nullptr : in.rope.data();
    p.q_norm_weight = in.q_norm.empty() ? nullptr : in.q_norm.data();
    p.k_norm_weight = in.k_norm.empty() ? nullptr : in.k_norm.data();
    p.tree_mask = in.tree.empty() ? nullptr : in.tree.data();
    p.out = in.out.data();
    return p;
}

// Device copies of the host vectors; freed on destruction.
struct DeviceCall {
    std::vector<void*> allocations;
    EbAttentionParams params{};
    void* workspace = nullptr;
    size_t workspace_bytes = 0;

    template <typename V>
    void* upload(const V& v) {
        if (v.empty()) {
            return nullptr;
        }
        void* d = nullptr;
        const size_t n = v.size() * sizeof(v[0]);
        CUDA_OK(cudaMalloc(&d, n));
        CUDA_OK(cudaMemcpy(d, v.data(), n, cudaMemcpyHostToDevice));
        allocations.push_back(d);
        return d;
    }
    explicit DeviceCall(Inputs& in) {
        params = in.params;
        params.qkv = upload(in.qkv), params.kv_cache = upload(in.cache);
        params.page_table = static_cast<const int32_t*>(upload(in.page_table));
        params.past_lengths = static_cast<const int32_t*>(upload(in.past));
        params.input_lengths = static_cast<const int32_t*>(upload(in.lengths));
        params.positions = static_cast<const int32_t*>(upload(in.positions));
        params.rope_cos_sin = static_cast<const float*>(upload(in.rope));
        params.q_norm_weight = upload(in.q_norm), params.k_norm_weight = upload(in.k_norm);
        params.tree_mask = static_cast<const uint8_t*>(upload(in.tree));
        params.out = upload(in.out);
        workspace_bytes = eb_attention_workspace_size(params.batch, params.seq_len,
                                                      params.num_q_heads, params.num_kv_heads,
                                                      params.head_dim, params.kv_dtype);
        CUDA_OK(cudaMalloc(&workspace, std::max<size_t>(workspace_bytes, 1)));
        allocations.push_back(workspace);
    }
    ~DeviceCall() {
        for (void* d : allocations) {
            cudaFree(d);
        }
    }
    bool enqueue(int kernel, cudaStream_t stream) {
        char err[256] = {0};
        const int32_t status = eb_attention_enqueue(&params, workspace, workspace_bytes, stream,
                                                    kernel, err, sizeof(err));
        if (status != EB_OK) {
            std::printf("  enqueue failed (%d): %s\n", status, err);
        }
        return status == EB_OK;
    }
};

struct Tolerance {
    float atol, rtol;
};
Tolerance tolerance_of(int io) {
    if (io == EB_DTYPE_FLOAT32) return {1e-4f, 0.0f};
    if (io == EB_DTYPE_FLOAT16) return {2e-3f, 2e-3f};
    return {1.6e-2f, 1.6e-2f};
}

// One comparison: host build vs CUDA kernel `kernel` on the same inputs.
bool check_case(const Case& c, const StoragePath& path, int kernel, unsigned seed) {
    Inputs host = make_inputs(c, path, seed);
    DeviceCall dev(host);  // uploads the untouched inputs
    EbAttentionParams hp = host_view(host);
    char err[256] = {0};
    const int32_t hs = eb_host_paged_attention(&hp, err, sizeof(err));
    bool ok = hs == EB_OK && dev.enqueue(kernel, nullptr);
    if (hs != EB_OK) {
        std::printf("  host failed (%d): %s\n", hs, err);
    }
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> out(host.out.size()), cache(host.cache.size());
    CUDA_OK(cudaMemcpy(out.data(), dev.params.out, out.size(), cudaMemcpyDeviceToHost));
    if (!cache.empty()) {
        CUDA_OK(cudaMemcpy(cache.data(), dev.params.kv_cache, cache.size(),
                           cudaMemcpyDeviceToHost));
    }
    const Tolerance tol = tolerance_of(path.io);
    float max_err = 0.0f;
    size_t bad = 0;
    for (size_t i = 0; i < out.size() / bytes_of(path.io); ++i) {
        const float a = load_as_float(out, path.io, i), r = load_as_float(host.out, path.io, i);
        const float e = std::fabs(a - r);
        max_err = std::isnan(e) ? INFINITY : std::max(max_err, e);
        bad += !(e <= tol.atol + tol.rtol * std::fabs(r));
    }
    size_t cache_diff = 0;
    for (size_t i = 0; i < cache.size(); ++i) {
        cache_diff += cache[i] != host.cache[i];
    }
    ok = ok && bad == 0 && cache_diff == 0;
    std::printf("%s %-28s %-11s %-5s max_abs_err=%.3g (tol %.0e+%.0e*|ref|) bad=%zu "
                "cache_bytes_differing=%zu\n",
                ok ? "PASS" : "FAIL", c.name.c_str(), path.name,
                kernel == EB_KERNEL_ROW ? "row" : "tiled", max_err, tol.atol, tol.rtol, bad,
                cache_diff);
    return ok;
}

std::vector<Case> phase_cases() {
    std::vector<Case> v;
    auto add = [&](const char* name, std::vector<int> past, std::vector<int> len, int S) {
        Case c;
        c.name = name, c.past = std::move(past), c.lengths = std::move(len), c.seq_len = S;
        v.push_back(c);
        return &v.back();
    };
    add("prefill", {0, 0, 0}, {7, 3, 5}, 7);
    add("chunked_prefill", {5, 9, 0}, {6, 2, 4}, 6);
    add("decode", {13, 4, 21}, {1, 1, 1}, 1);
    add("decode_idle_sequence", {7, 30}, {1, 0}, 1);
    add("verify_chain", {10, 3}, {4, 3}, 4);
    add("verify_tree", {6, 11}, {5, 4}, 5)->tree = 1;
    add("draft_context_update", {8, 2}, {3, 5}, 5);
    Case* block = add("draft_block", {9, 14}, {4, 4}, 4);
    block->causal = 0, block->write_kv = 0;
    Case* vision = add("vision_no_cache", {0, 0}, {6, 4}, 6);
    vision->causal = 0, vision->write_kv = 0, vision->no_cache = 1;
    // multi-tile shapes: > 16 query rows, > 32 keys per row
    add("prefill_multi_tile", {0, 0}, {45, 20}, 45);
    add("chunked_prefill_multi_tile", {70, 33}, {37, 18}, 40);
    add("decode_long_context", {300, 77, 129}, {1, 1, 1}, 1);
    add("verify_tree_long", {90, 41}, {12, 9}, 12)->tree = 1;
    Case* long_block = add("draft_block_long", {150, 64}, {16, 16}, 16);
    long_block->causal = 0, long_block->write_kv = 0;
    return v;
}

struct Config {
    const char* name;
    int hq, hkv, d, rotary, qk_norm, window, page_size;
};
const Config kConfigs[] = {
    {"gqa_d16", 4, 2, 16, 16, 0, 0, 4},
    {"mqa_qknorm_partial_rope_d32", 4, 1, 32, 16, 1, 0, 4},
    {"mha_window_d16", 4, 4, 16, 16, 0, 5, 3},
    {"gqa_qknorm_d128", 8, 2, 128, 128, 1, 0, 16},
    {"gqa_window_d96", 6, 2, 96, 64, 0, 19, 8},
    {"gqa_qknorm_d256", 4, 2, 256, 128, 1, 0, 8},
};

// quick: every config and phase on two storage paths (fp32 and bf16 + fp8 cache) instead of
// five; what the CPU emulation in the test suite runs.
int run_correctness(bool quick) {
    int failures = 0, total = 0;
    unsigned seed = 1;
    for (const Config& cfg : kConfigs) {
        for (Case c : phase_cases()) {
            c.name = std::string(c.name) + "/" + cfg.name;
            c.hq = cfg.hq, c.hkv = cfg.hkv, c.d = cfg.d, c.rotary = cfg.rotary;
            c.qk_norm = cfg.qk_norm, c.window = cfg.window, c.page_size = cfg.page_size;
            for (const StoragePath& path : kPaths) {
                if (quick && path.io != path.kv && path.io != EB_DTYPE_BFLOAT16) {
                    continue;
                }
                if (quick && path.io == path.kv && path.io != EB_DTYPE_FLOAT32) {
                    continue;
                }
                for (int kernel : {EB_KERNEL_TILED, EB_KERNEL_ROW}) {
                    ++total;
                    failures += !check_case(c, path, kernel, seed);
                }
                ++seed;
            }
        }
    }
    std::printf("correctness: %d passed, %d failed\n", total - failures, failures);
    return failures;
}

// Times one model-sized call per kernel; also checks the two kernels agree on it.
int time_case(const char* name, Case c, const StoragePath& path, int iterations) {
    Inputs in = make_inputs(c, path, 99);
    int failures = 0;
    std::vector<uint8_t> first_out;
    for (int kernel : {EB_KERNEL_TILED, EB_KERNEL_ROW}) {
        DeviceCall dev(in);
        cudaEvent_t start, stop;
        CUDA_OK(cudaEventCreate(&start));
        CUDA_OK(cudaEventCreate(&stop));
        if (!dev.enqueue(kernel, nullptr)) {  // warm-up (also writes the cache once)
            return 1;
        }
        CUDA_OK(cudaEventRecord(start));
        for (int it = 0; it < iterations; ++it) {
            dev.enqueue(kernel, nullptr);
        }
        CUDA_OK(cudaEventRecord(stop));
        CUDA_OK(cudaEventSynchronize(stop));
        float ms = 0.0f;
        CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
        std::vector<uint8_t> out(in.out.size());
        CUDA_OK(cudaMemcpy(out.data(), dev.params.out, out.size(), cudaMemcpyDeviceToHost));
        float diff = 0.0f;
        if (!first_out.empty()) {
            for (size_t i = 0; i < out.size() / bytes_of(path.io); ++i) {
                diff = std::max(diff, std::fabs(load_as_float(out, path.io, i) -
                                                load_as_float(first_out, path.io, i)));
            }
            const bool agree = diff <= 2 * tolerance_of(path.io).atol + 1e-2f;
            failures += !agree;
            std::printf("%s %s tiled-vs-row max_abs_diff=%.3g\n", agree ? "PASS" : "FAIL", name,
                        diff);
        }
        first_out = out;
        std::printf("TIME %-36s %-11s %-5s %8.3f ms/call (prepare + attention, %d calls)\n",
                    name, path.name, kernel == EB_KERNEL_ROW ? "row" : "tiled",
                    ms / iterations, iterations);
        CUDA_OK(cudaEventDestroy(start));
        CUDA_OK(cudaEventDestroy(stop));
    }
    return failures;
}

Case model_case(std::vector<int> past, std::vector<int> len, int S) {
    Case c;
    c.past = std::move(past), c.lengths = std::move(len), c.seq_len = S;
    c.hq = 32, c.hkv = 8, c.d = 128, c.rotary = 128, c.qk_norm = 1, c.page_size = 64;
    return c;
}

int run_timings() {
    const StoragePath fp16 = kPaths[1], fp8 = kPaths[3];
    int failures = 0;
    failures += time_case("prefill B1 S1024 Hq32 Hkv8 D128", model_case({0}, {1024}, 1024), fp16, 5);
    failures += time_case("chunked_prefill B1 S256 past2048", model_case({2048}, {256}, 256), fp16, 5);
    const std::vector<int> past8(8, 2048), one8(8, 1), four4(4, 8), past4(4, 2048);
    failures += time_case("decode B8 past2048", model_case(past8, one8, 1), fp16, 20);
    failures += time_case("decode B8 past2048 fp8kv", model_case(past8, one8, 1), fp8, 20);
    failures += time_case("verify_chain B4 S8 past2048", model_case(past4, four4, 8), fp16, 20);
    Case block = model_case(past4, std::vector<int>(4, 16), 16);
    block.causal = 0, block.write_kv = 0;
    failures += time_case("draft_block B4 S16 past2048", block, fp16, 20);
    return failures;
}

// ---- decode-attention bandwidth microbenchmark ------------------------------------------------
// Decode (S = 1, the row kernel) over long contexts is bound by reading the K/V pages: one call
// reads every visible slot's K and V once. Effective bandwidth = those bytes (+ qkv, out) / time,
// reported against the HBM roofline 2 * memory clock * bus width (cudaDevAttrMemoryClockRate,
// cudaDevAttrGlobalMemoryBusWidth; --peak-gbps overrides). The pool (> 1 GB at the full size,
// far above L2) is filled on the device (cudaMemset), pages are shuffled across the pool.
// --bandwidth-dry: the same code on tiny shapes (the CPU emulation has no clock: no % printed).

struct BandwidthShape {
    const char* name;
    int batch, context, hq, hkv, d, page_size;
    StoragePath path;
};

double hbm_peak_gbps(double override_gbps) {
    if (override_gbps > 0) {
        return override_gbps;
    }
    int device = 0, clock_khz = 0, bus_bits = 0;
    CUDA_OK(cudaGetDevice(&device));
    if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
        return 0.0;
    }
    return 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;  // DDR: two transfers per clock
}

// Bytes one decode call must move: K and V of every visible slot, the new K/V written, qkv, out.
double decode_bytes(const BandwidthShape& s) {
    const double kv = bytes_of(s.path.kv), io = bytes_of(s.path.io);
    const double slots = static_cast<double>(s.batch) * (s.context + 1);
    return slots * 2.0 * s.hkv * s.d * kv + s.batch * (s.hq + 2.0 * s.hkv) * s.d * io +
           s.batch * static_cast<double>(s.hq) * s.d * io;
}

int bandwidth_case(const BandwidthShape& s, double peak_gbps, int iterations) {
    std::mt19937 rng(7);
    const int pages_per_seq = (s.context + 1 + s.page_size - 1) / s.page_size;
    const int num_pages = s.batch * pages_per_seq;
    std::vector<int32_t> order(static_cast<size_t>(num_pages));
    for (int i = 0; i < num_pages; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    const std::vector<int32_t> past(s.batch, s.context), lengths(s.batch, 1);
    std::vector<int32_t> positions(past);
    const std::vector<float> rope = rope_table(s.d, s.context + 2);
    const std::vector<uint8_t> qkv =
        encode(randn(rng, static_cast<size_t>(s.batch) * (s.hq + 2 * s.hkv) * s.d), s.path.io);
    const size_t cache_bytes = static_cast<size_t>(num_pages) * 2 * s.hkv * s.page_size * s.d *
                               bytes_of(s.path.kv);
    const size_t out_bytes = static_cast<size_t>(s.batch) * s.hq * s.d * bytes_of(s.path.io);

    EbAttentionParams p{};
    p.struct_size = sizeof(EbAttentionParams);
    p.batch = s.batch, p.seq_len = 1, p.num_pages = num_pages, p.max_pages_per_seq = pages_per_seq;
    p.max_position = s.context + 2;
    p.num_q_heads = s.hq, p.num_kv_heads = s.hkv, p.head_dim = s.d, p.rotary_dim = s.d;
    p.page_size = s.page_size, p.causal = 1, p.write_kv = 1;
    p.io_dtype = s.path.io, p.kv_dtype = s.path.kv;
    p.scale = 1.0f / std::sqrt(static_cast<float>(s.d));
    p.rms_norm_eps = 1e-6f, p.kv_scale = 1.0f;
    std::vector<void*> allocations;
    auto upload = [&](const void* src, size_t n) {
        void* d = nullptr;
        CUDA_OK(cudaMalloc(&d, std::max<size_t>(n, 1)));
        if (src != nullptr) CUDA_OK(cudaMemcpy(d, src, n, cudaMemcpyHostToDevice));
        allocations.push_back(d);
        return d;
    };
    p.qkv = upload(qkv.data(), qkv.size());
    p.kv_cache = upload(nullptr, cache_bytes);
    CUDA_OK(cudaMemset(p.kv_cache, 0x1f, cache_bytes));  // small finite values in every dtype
    p.page_table = static_cast<const int32_t*>(upload(order.data(), order.size() * 4));
    p.past_lengths = static_cast<const int32_t*>(upload(past.data(), past.size() * 4));
    p.input_lengths = static_cast<const int32_t*>(upload(lengths.data(), lengths.size() * 4));
    p.positions = static_cast<const int32_t*>(upload(positions.data(), positions.size() * 4));
    p.rope_cos_sin = static_cast<const float*>(upload(rope.data(), rope.size() * 4));
    p.out = upload(nullptr, out_bytes);
    const size_t ws = eb_attention_workspace_size(s.batch, 1, s.hq, s.hkv, s.d, s.path.kv);
    void* workspace = upload(nullptr, ws);

    int failures = 0;
    char err[256] = {0};
    auto call = [&]() {
        return eb_attention_enqueue(&p, workspace, ws, nullptr, EB_KERNEL_ROW, err, sizeof(err));
    };
    if (call() != EB_OK || call() != EB_OK) {  // warm-up
        std::printf("FAIL bandwidth %s: enqueue: %s\n", s.name, err);
        failures = 1;
    } else {
        cudaEvent_t start, stop;
        CUDA_OK(cudaEventCreate(&start));
        CUDA_OK(cudaEventCreate(&stop));
        CUDA_OK(cudaEventRecord(start));
        for (int it = 0; it < iterations; ++it) call();
        CUDA_OK(cudaEventRecord(stop));
        CUDA_OK(cudaEventSynchronize(stop));
        CUDA_OK(cudaGetLastError());
        float ms = 0.0f;
        CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
        CUDA_OK(cudaEventDestroy(start));
        CUDA_OK(cudaEventDestroy(stop));
        std::vector<uint8_t> out(out_bytes);
        CUDA_OK(cudaMemcpy(out.data(), p.out, out_bytes, cudaMemcpyDeviceToHost));
        bool finite = true;
        for (size_t i = 0; i < out_bytes / bytes_of(s.path.io); ++i) {
            finite = finite && std::isfinite(load_as_float(out, s.path.io, i));
        }
        if (!finite) {
            std::printf("FAIL bandwidth %s: non-finite output\n", s.name);
            failures = 1;
        }
        const double bytes = decode_bytes(s), per_call_ms = ms / iterations;
        std::printf("BANDWIDTH %-34s %-11s bytes/call=%.4g", s.name, s.path.name, bytes);
        if (per_call_ms > 0) {
            const double gbps = bytes / (per_call_ms * 1e6);
            std::printf(" %.4f ms/call %.1f GB/s", per_call_ms, gbps);
            if (peak_gbps > 0) {
                std::printf(" = %.1f%% of the HBM roofline (%.0f GB/s)", 100.0 * gbps / peak_gbps,
                            peak_gbps);
            }
        } else {
            std::printf(" (no device clock: timing not measured)");
        }
        std::printf("\n");
    }
    for (void* d : allocations) cudaFree(d);
    return failures;
}

int run_bandwidth(bool dry, double peak_override) {
    const StoragePath fp16 = kPaths[1], fp8 = kPaths[3];
    const double peak = dry ? 0.0 : hbm_peak_gbps(peak_override);
    if (!dry) {
        std::printf("HBM roofline: %.0f GB/s%s\n", peak,
                    peak_override > 0 ? " (--peak-gbps)" : " (2 x memory clock x bus width)");
    }
    std::vector<BandwidthShape> shapes;
    if (dry) {
        shapes = {{"decode B2 ctx40 Hq4 Hkv2 D16", 2, 40, 4, 2, 16, 8, fp16},
                  {"decode B2 ctx40 Hq4 Hkv2 D16 fp8kv", 2, 40, 4, 2, 16, 8, fp8}};
    } else {  // pools of 1.07 GB (fp16) / 0.54 GB (fp8): far beyond the H200's 50 MB L2
        shapes = {{"decode B16 ctx16384 Hq32 Hkv8 D128", 16, 16384, 32, 8, 128, 64, fp16},
                  {"decode B64 ctx4096 Hq32 Hkv8 D128", 64, 4096, 32, 8, 128, 64, fp16},
                  {"decode B16 ctx16384 Hq32 Hkv8 D128", 16, 16384, 32, 8, 128, 64, fp8}};
    }
    int failures = 0;
    for (const BandwidthShape& s : shapes) {
        failures += bandwidth_case(s, peak, dry ? 1 : 50);
    }
    return failures;
}

}  // namespace

int main(int argc, char** argv) {
    int device = 0;
    cudaDeviceProp prop{};
    CUDA_OK(cudaGetDevice(&device));
    CUDA_OK(cudaGetDeviceProperties(&prop, device));
    std::printf("device: %s sm_%d%d\n", prop.name, prop.major, prop.minor);
    bool skip_timing = false, quick = false, correctness = true, bandwidth = false, dry = false;
    double peak_gbps = 0.0;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--no-timing") == 0) {
            skip_timing = true;
        } else if (std::strcmp(argv[i], "--quick") == 0) {
            quick = true;
        } else if (std::strcmp(argv[i], "--no-correctness") == 0) {
            correctness = false;
        } else if (std::strcmp(argv[i], "--bandwidth") == 0) {
            bandwidth = true;
        } else if (std::strcmp(argv[i], "--bandwidth-dry") == 0) {
            bandwidth = dry = true;
        } else if (std::strcmp(argv[i], "--peak-gbps") == 0 && i + 1 < argc) {
            peak_gbps = std::atof(argv[++i]);
        } else {
            std::fprintf(stderr,
                         "usage: %s [--no-timing] [--quick] [--no-correctness] [--bandwidth | "
                         "--bandwidth-dry] [--peak-gbps GBPS]\n",
                         argv[0]);
            return 2;
        }
    }
    int failures = correctness ? run_correctness(quick) : 0;
    if (!skip_timing) {
        failures += run_timings();
    }
    if (bandwidth) {
        failures += run_bandwidth(dry, peak_gbps);
    }
    std::printf("%s: %d failure(s)\n", failures == 0 ? "ALL PASS" : "SOME FAILED", failures);
    return failures == 0 ? 0 : 1;
}
