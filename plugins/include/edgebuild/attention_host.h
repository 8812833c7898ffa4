/* plugins/include/edgebuild/attention_host.h
 *
 * Owns: the C ABI of the host build (libedgebuild_attention_host.so), the CPU implementation
 * of the attention contract. Loaded with ctypes by tests/test_plugin_host.py and linked into
 * the CUDA check (plugins/tests/cuda_check.cu) as the trusted side of the comparison.
 */
#ifndef EDGEBUILD_ATTENTION_HOST_H
#define EDGEBUILD_ATTENTION_HOST_H

#include <stdint.h>

#include "edgebuild/attention_params.h"

#if defined(_WIN32)
#define EB_HOST_EXPORT __declspec(dllexport)
#else
#define EB_HOST_EXPORT __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* EB_ATTENTION_ABI_VERSION of the library, and its sizeof(EbAttentionParams). */
EB_HOST_EXPORT int32_t eb_host_abi_version(void);
EB_HOST_EXPORT int32_t eb_host_params_size(void);

/* eb_validate_attributes (attention_params.h): the attributes alone, no shape or tensor pointer
 * (what the TensorRT plugin's createPlugin checks). Returns an EbStatus; message in err. */
EB_HOST_EXPORT int32_t eb_host_validate_attributes(const EbAttentionParams* params, char* err,
                                                   int32_t err_len);

/* Runs the contract on host memory: validates attributes and data (page ids, lengths,
 * positions) before any write, then writes `out` and, with write_kv, the cache in place.
 * Returns an EbStatus; on error a message naming the field is written to err. */
EB_HOST_EXPORT int32_t eb_host_paged_attention(const EbAttentionParams* params, char* err,
                                               int32_t err_len);

/* Converts `count` elements between EbDtypes through fp32 with the same rounding code the
 * kernels use (tests compare it bit for bit with torch's casts). */
EB_HOST_EXPORT int32_t eb_host_convert(const void* src, int32_t src_dtype, void* dst,
                                       int32_t dst_dtype, int64_t count);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* EDGEBUILD_ATTENTION_HOST_H */
