"""The torch DSpark draft loader (the registry's ``torch_loader``): one DraftPlan, then weights.

``edgebuild run`` and ``edgellm-serve`` (through :class:`edgebuild.runtime.llm.LLM`) validate
the draft against the target with :func:`edgebuild.checkpoint.draft.pair_draft` before the
(large) target is loaded, reusing the target's already opened :class:`WeightSource`, and load
the draft's weights from that plan afterwards: each checkpoint is opened once, the draft's
config read and validated once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from edgebuild.checkpoint.draft import pair_draft
from edgebuild.checkpoint.source import WeightSource
from edgebuild.models.dspark import DSparkDraft
from edgebuild.runtime.cpu import resolve_dtype
from edgebuild.runtime.dspark_backend import TorchDraft
from edgebuild.speculative.config import SpeculativeConfig

log = logging.getLogger("edgebuild.runtime")


def prepare_torch_draft(
    spec: SpeculativeConfig, target_source: WeightSource
) -> Callable[..., TorchDraft]:
    """Validate the draft of ``spec`` against the opened target before loading anything large.

    Args:
        spec: the parsed speculative config (``model`` is the draft directory).
        target_source: the target checkpoint, as the runtime opened it (not re-read).

    Returns:
        ``loader(options) -> TorchDraft``: reads the draft's weights in ``options.dtype``
        (``RuntimeOptions``: ``max_draft_kv_rows`` (else ``max_kv_rows``), ``page_size``,
        ``quant`` too).

    Raises:
        ConfigError / PairingError / CheckpointError: a draft that does not fit its target
            (hidden, vocab, tokenizer, taps, mask id, heads, tensors), or
            ``num_speculative_tokens`` above the draft's ``block_size``.
    """
    plan = pair_draft(target_source, spec.model)  # the same checks as `edgebuild inspect --draft`
    spec.check_block(plan.config.block_size, str(plan.draft.config_path))
    head, embed = plan.lm_head, plan.embed_tokens
    log.info(
        "draft %s: lm_head from %s (%s), embed_tokens from %s",
        spec.model,
        head.checkpoint_source,
        head.format,
        embed.checkpoint_source,
    )

    def load(options) -> TorchDraft:
        model = DSparkDraft.from_plan(plan, resolve_dtype(options.dtype))
        rows = getattr(options, "max_draft_kv_rows", None) or options.max_kv_rows
        return TorchDraft(model, rows, options.page_size, spec.draft_top_k, options.quant)

    return load
