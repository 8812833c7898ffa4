/* plugins/include/edgebuild/attention_kernels.h
 *
 * Owns: the host-callable entry points of the CUDA attention kernels
 * (src/attention_kernels.cu). Free of CUDA and TensorRT types (the stream is a void*) so that
 * the TensorRT plugin wrapper, the standalone CUDA check and any other caller can include it.
 */
#ifndef EDGEBUILD_ATTENTION_KERNELS_H
#define EDGEBUILD_ATTENTION_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "edgebuild/attention_params.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Device workspace bytes one call needs: the prepared q (fp32) and this call's K/V in the cache
 * dtype, [B, S, H, D] each. Monotone in batch and seq_len, so the plugin sizes it from the
 * profile's maxima. */
size_t eb_attention_workspace_size(int32_t batch, int32_t seq_len, int32_t num_q_heads,
                                   int32_t num_kv_heads, int32_t head_dim, int32_t kv_dtype);

/* Enqueues one attention call on `stream` (a cudaStream_t): the prepare kernel (norm, RoPE,
 * KV write) then one attention kernel (EbKernelChoice). All pointers in `p` are device
 * pointers. Returns an EbStatus; errors name the field. The kernels do not check data
 * (page ids, lengths, positions); out-of-contract data gives undefined results. */
int32_t eb_attention_enqueue(const EbAttentionParams* p, void* workspace, size_t workspace_bytes,
                             void* stream, int32_t kernel_choice, char* err, int32_t err_len);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* EDGEBUILD_ATTENTION_KERNELS_H */
