"""Custom ops shared by the models: RoPE, RMSNorm and the paged attention reference op.

``edgebuild.ops.attention`` registers ``torch.ops.edgebuild.paged_attention`` (CPU golden
implementation + fake for tracing) on import; its module docstring is the attention plugin
contract.
"""

from edgebuild.ops.attention import gather_kv, paged_attention
from edgebuild.ops.norm import rms_norm
from edgebuild.ops.rope import (
    SUPPORTED_ROPE_TYPES,
    RopeScaling,
    apply_rope,
    compute_inv_freq,
    rope_cos_sin_table,
)

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "RopeScaling",
    "apply_rope",
    "compute_inv_freq",
    "gather_kv",
    "paged_attention",
    "rms_norm",
    "rope_cos_sin_table",
]
