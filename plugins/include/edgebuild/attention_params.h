/* plugins/include/edgebuild/attention_params.h
 *
 * Owns: the one description of an attention call (EbAttentionParams) shared by the three
 * callers of the attention math: the host build's C ABI (loaded with ctypes by the tests),
 * the CUDA launcher, and the TensorRT plugin's enqueue. Also the shape/attribute validation
 * every caller runs before touching memory.
 *
 * Plain C (no C++ features in the struct) so that Python's ctypes can mirror it; the first
 * field is the struct size so that a stale mirror is refused instead of read wrongly.
 * Shapes and meaning follow the contract in plugins/README.md (= the docstring of
 * edgebuild.ops.attention).
 */
#ifndef EDGEBUILD_ATTENTION_PARAMS_H
#define EDGEBUILD_ATTENTION_PARAMS_H

#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever EbAttentionParams or the C entry points change. */
#define EB_ATTENTION_ABI_VERSION 1

/* Largest head_dim the kernels are instantiated for (per-thread register arrays). */
#define EB_MAX_HEAD_DIM 256

typedef enum EbDtype {
    EB_DTYPE_FLOAT32 = 0,
    EB_DTYPE_FLOAT16 = 1,
    EB_DTYPE_BFLOAT16 = 2,
    EB_DTYPE_FP8_E4M3 = 3 /* KV cache only: value = fp8 * kv_scale */
} EbDtype;

typedef enum EbStatus {
    EB_OK = 0,
    EB_ERR_INVALID_ARGUMENT = 1, /* attributes or shapes that break the contract */
    EB_ERR_INVALID_DATA = 2,     /* page ids, lengths or positions out of range (host only) */
    EB_ERR_UNSUPPORTED = 3,      /* a valid request this build cannot serve (dtype combo) */
    EB_ERR_CUDA = 4              /* a CUDA launch failed */
} EbStatus;

/* Which CUDA attention kernel runs. AUTO: the decode kernel when seq_len == 1, else the tiled
 * kernel. The tests force each kernel on every phase since both must implement all of them. */
typedef enum EbKernelChoice {
    EB_KERNEL_AUTO = 0,
    EB_KERNEL_TILED = 1,  /* one block per (query tile, q head, sequence) */
    EB_KERNEL_ROW = 2     /* one block per (query row, q head, sequence): decode */
} EbKernelChoice;

typedef struct EbAttentionParams {
    int32_t struct_size; /* sizeof(EbAttentionParams) as the caller sees it */

    /* shapes */
    int32_t batch;             /* B */
    int32_t seq_len;           /* S: new rows per sequence (padded) */
    int32_t num_pages;         /* kv_cache.shape[0] */
    int32_t max_pages_per_seq; /* page_table.shape[1] */
    int32_t max_position;      /* rope_cos_sin.shape[0] */

    /* attributes (plugin fields of the same names) */
    int32_t num_q_heads;    /* Hq */
    int32_t num_kv_heads;   /* Hkv, Hq % Hkv == 0 */
    int32_t head_dim;       /* D, even, <= EB_MAX_HEAD_DIM */
    int32_t rotary_dim;     /* even, 0..D; 0 = no RoPE */
    int32_t page_size;      /* kv_cache.shape[3] */
    int32_t causal;         /* 1: new row i sees new rows j <= i; 0: all new rows */
    int32_t write_kv;       /* 1: store the new K/V in the cache */
    int32_t sliding_window; /* 0 = off; else slot t visible to query slot q iff q - t < w */
    int32_t qk_norm;        /* 1: q_norm_weight and k_norm_weight are given */
    int32_t has_tree_mask;  /* 1: tree_mask is given and replaces the causal rule */
    int32_t io_dtype;       /* EbDtype of qkv, norm weights and the output */
    int32_t kv_dtype;       /* EbDtype of kv_cache */
    float scale;            /* softmax scale */
    float rms_norm_eps;
    float kv_scale; /* fp8 cache only: stored = fp8(x / kv_scale), read = fp8 * kv_scale */

    /* tensors (device pointers for the CUDA launcher, host pointers for the host build) */
    const void* qkv;             /* [B, S, (Hq + 2*Hkv) * D] io_dtype */
    void* kv_cache;              /* [num_pages, 2, Hkv, page_size, D] kv_dtype, in place */
    const int32_t* page_table;   /* [B, max_pages_per_seq] */
    const int32_t* past_lengths; /* [B] */
    const int32_t* input_lengths;/* [B] */
    const int32_t* positions;    /* [B, S] */
    const float* rope_cos_sin;   /* [max_position, rotary_dim] fp32 */
    const void* q_norm_weight;   /* [D] io_dtype, or NULL */
    const void* k_norm_weight;   /* [D] io_dtype, or NULL */
    const uint8_t* tree_mask;    /* [B, S, S] bool bytes (nonzero = may attend), or NULL */
    void* out;                   /* [B, S, Hq * D] io_dtype */
} EbAttentionParams;

/* Writes a message into err (if given) and returns code. */
static inline int32_t eb_fail(char* err, int32_t err_len, int32_t code, const char* message) {
    if (err != NULL && err_len > 0) {
        snprintf(err, (size_t)err_len, "%s", message);
    }
    return code;
}

/* Checks the attributes alone (the plugin's PluginFieldCollection, plus io_dtype/kv_dtype and
 * kv_scale): no shape except the attributes' own, no tensor pointer. This is what a TensorRT
 * creator can check in createPlugin, where no tensor exists yet (the ONNX parser calls it with
 * the node's attributes only). Returns EB_OK or EB_ERR_INVALID_ARGUMENT with a message naming
 * the field and the fix. eb_validate_params runs it first. */
static inline int32_t eb_validate_attributes(const EbAttentionParams* p, char* err,
                                             int32_t err_len) {
    char msg[256];
    if (p == NULL) {
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, "params is NULL");
    }
    if (p->struct_size != (int32_t)sizeof(EbAttentionParams)) {
        snprintf(msg, sizeof(msg),
                 "EbAttentionParams.struct_size is %d but this library expects %d: the caller's "
                 "struct mirror is stale (ABI version %d)",
                 p->struct_size, (int)sizeof(EbAttentionParams), EB_ATTENTION_ABI_VERSION);
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, msg);
    }
    if (p->num_q_heads <= 0 || p->num_kv_heads <= 0 || p->num_q_heads % p->num_kv_heads != 0) {
        snprintf(msg, sizeof(msg),
                 "num_q_heads (%d) must be a positive multiple of num_kv_heads (%d)",
                 p->num_q_heads, p->num_kv_heads);
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, msg);
    }
    if (p->head_dim <= 0 || p->head_dim % 2 != 0 || p->head_dim > EB_MAX_HEAD_DIM) {
        snprintf(msg, sizeof(msg), "head_dim (%d) must be even and in [2, %d]", p->head_dim,
                 EB_MAX_HEAD_DIM);
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, msg);
    }
    if (p->rotary_dim < 0 || p->rotary_dim > p->head_dim || p->rotary_dim % 2 != 0) {
        snprintf(msg, sizeof(msg), "rotary_dim (%d) must be even and in [0, head_dim=%d]",
                 p->rotary_dim, p->head_dim);
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, msg);
    }
    if (p->page_size <= 0 || p->sliding_window < 0) {
        snprintf(msg, sizeof(msg), "page_size (%d) must be > 0 and sliding_window (%d) >= 0",
                 p->page_size, p->sliding_window);
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, msg);
    }
    if ((p->causal != 0 && p->causal != 1) || (p->write_kv != 0 && p->write_kv != 1) ||
        (p->qk_norm != 0 && p->qk_norm != 1) || (p->has_tree_mask != 0 && p->has_tree_mask != 1)) {
        snprintf(msg, sizeof(msg),
                 "causal (%d), write_kv (%d), qk_norm (%d) and has_tree_mask (%d) must be 0 or 1",
                 p->causal, p->write_kv, p->qk_norm, p->has_tree_mask);
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, msg);
    }
    if (p->io_dtype < EB_DTYPE_FLOAT32 || p->io_dtype > EB_DTYPE_BFLOAT16) {
        snprintf(msg, sizeof(msg), "io_dtype %d must be float32 (0), float16 (1) or bfloat16 (2)",
                 p->io_dtype);
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, msg);
    }
    if (p->kv_dtype < EB_DTYPE_FLOAT32 || p->kv_dtype > EB_DTYPE_FP8_E4M3) {
        snprintf(msg, sizeof(msg), "kv_dtype %d is not an EbDtype", p->kv_dtype);
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, msg);
    }
    if (p->kv_dtype == EB_DTYPE_FP8_E4M3 && !(p->kv_scale > 0.0f)) {
        snprintf(msg, sizeof(msg), "kv_scale (%g) must be > 0 for an fp8 KV cache",
                 (double)p->kv_scale);
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, msg);
    }
    return EB_OK;
}

/* Checks one call: the attributes (eb_validate_attributes), then the shapes and the tensor
 * pointers (everything that does not need to read tensor contents). Run where the tensors
 * exist: the host build, the CUDA launcher (the plugin's enqueue). Returns EB_OK or an error
 * code with a message naming the field and the fix. */
static inline int32_t eb_validate_params(const EbAttentionParams* p, char* err, int32_t err_len) {
    const int32_t status = eb_validate_attributes(p, err, err_len);
    if (status != EB_OK) {
        return status;
    }
    if (p->batch < 0 || p->seq_len < 0 || p->num_pages < 0 || p->max_pages_per_seq < 0 ||
        p->max_position < 0) {
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT,
                       "batch, seq_len, num_pages, max_pages_per_seq and max_position must be >= 0");
    }
    if (p->rotary_dim > 0 && p->max_position <= 0) {
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT,
                       "rope_cos_sin has no rows (max_position = 0) but rotary_dim > 0");
    }
    if (p->batch > 0 && p->seq_len > 0 &&
        (p->qkv == NULL || p->past_lengths == NULL || p->input_lengths == NULL ||
         p->positions == NULL || p->out == NULL)) {
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT,
                       "qkv, past_lengths, input_lengths, positions and out must be non-NULL");
    }
    if (p->batch > 0 && p->max_pages_per_seq > 0 && p->page_table == NULL) {
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, "page_table is NULL");
    }
    if (p->num_pages > 0 && p->kv_cache == NULL) {
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, "kv_cache is NULL");
    }
    if (p->rotary_dim > 0 && p->rope_cos_sin == NULL) {
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, "rope_cos_sin is NULL");
    }
    if (p->qk_norm && (p->q_norm_weight == NULL || p->k_norm_weight == NULL)) {
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT,
                       "qk_norm = 1 needs both q_norm_weight and k_norm_weight");
    }
    if (p->has_tree_mask && p->tree_mask == NULL) {
        return eb_fail(err, err_len, EB_ERR_INVALID_ARGUMENT, "has_tree_mask = 1 needs tree_mask");
    }
    return EB_OK;
}

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* EDGEBUILD_ATTENTION_PARAMS_H */
