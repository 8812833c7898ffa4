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

import torch

from edgebuild.checkpoint.draft import pair_draft
from edgebuild.checkpoint.source import WeightSource
from edgebuild.models.dspark import DSparkDraft
from edgebuild.runtime.cpu import resolve_dtype
from edgebuild.runtime.dspark_backend import TorchDraft
from edgebuild.speculative.config import SpeculativeConfig
from edgebuild.speculative.token_map import read_token_map

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
            ``num_speculative_tokens`` above the draft's ``block_size``, or a ``token_map``
            that does not fit the draft's vocabulary (names the file).
    """
    plan = pair_draft(target_source, spec.model)  # the same checks as `edgebuild inspect --draft`
    spec.check_block(plan.config.block_size, str(plan.draft.config_path))
    token_map = None
    if spec.token_map is not None:  # the draft's vocabulary cut (speculative/token_map.py)
        token_map = read_token_map(spec.token_map, plan.config.vocab_size)
    head, embed = plan.lm_head, plan.embed_tokens
    log.info(
        "draft %s: lm_head from %s (%s), embed_tokens from %s",
        spec.model,
        head.checkpoint_source,
        head.format,
        embed.checkpoint_source,
    )

    def load(options) -> TorchDraft:
        dtype = resolve_dtype(options.dtype)
        model = DSparkDraft.from_plan(plan, dtype)
        rows = getattr(options, "max_draft_kv_rows", None) or options.max_kv_rows
        quant = draft_quant(spec.quantization, dtype, options.quant, plan.config)
        if quant != options.quant:
            log.info("draft %s: linears and lm_head packed %s (target: %s)", spec.model,
                     quant or "unquantized", options.quant or "unquantized")  # fmt: skip
        if token_map is not None:
            log.info("draft %s: vocabulary cut to the %d tokens of %s", spec.model,
                     len(token_map), spec.token_map)  # fmt: skip
        return TorchDraft(
            model, rows, options.page_size, spec.draft_top_k, quant, token_map=token_map
        )

    return load


def draft_quant(
    given: str | None, dtype: torch.dtype, target_quant: str | None, cfg=None
) -> str | None:
    """The packing of the draft's linears and ``lm_head`` on the torch runtime (None, ``"int8"``
    or ``"int4"``): ``given`` (the speculative ``quantization``; ``"none"``: unquantized), else
    int4 where the runtime is fp32, the target unquantized, edgebuild's int4 kernels run
    (:func:`edgebuild.ops.f32_linear.available`) and every input width of the draft
    (``cfg``: its :class:`~edgebuild.checkpoint.dspark_config.DSparkConfig`; hidden,
    intermediate, heads x head_dim) is a multiple of int4's group of 32, else the target's
    ``--quant``.

    Why int4 by default there: the draft reads its borrowed fp32 ``lm_head`` (SmolLM2: 113 MB)
    on every pass, so a 1-token proposal cost 0.43 of a target decode; W4A8 int4 cuts it to a
    quarter of the bytes. Every emitted token is still the target's (verification decides);
    measured on SmolLM2 + the shipped draft, 3 eval prompts x 128 tokens, one thread: fixed
    lengths tau 2.105 -> 2.056, scheduled DSpark x1.13 -> x1.31 of target-only.
    """
    if given is not None:
        return None if given == "none" else given
    if dtype == torch.float32 and target_quant is None:
        from edgebuild.ops import f32_linear
        from edgebuild.ops.linear import INT4_GROUP_SIZE

        widths = (
            []
            if cfg is None
            else [cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim]
        )
        if f32_linear.available() and all(w % INT4_GROUP_SIZE == 0 for w in widths):
            return "int4"
    return target_quant
