"""`edgebuild inspect`: what a checkpoint (or a draft/target pair) holds, without loading it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from edgebuild.checkpoint.source import TARGET, WeightSource


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} GiB"


def summarize(source: WeightSource) -> dict:
    """Architecture, dtypes, quant format, tensor count and bytes of one checkpoint."""
    cfg = source.config
    dtypes = Counter(str(source.info(n).dtype).replace("torch.", "") for n in source.names())
    return {
        "path": str(source.path),
        "architecture": (cfg.get("architectures") or [cfg.get("model_type", "?")])[0],
        "layers": cfg.get("num_hidden_layers"),
        "hidden_size": cfg.get("hidden_size"),
        "vocab_size": cfg.get("vocab_size"),
        "quant_format": source.quant.algo.value,
        "quant_config_source": source.quant.source or "-",
        "tensors": len(source.names()),
        "bytes": _fmt_bytes(source.total_bytes()),
        "dtypes": dict(dtypes),
    }


def inspect_checkpoint(ckpt: Path, draft: Path | None = None) -> dict:
    """Report for `edgebuild inspect`; with `draft`, which draft tensors come from the target.

    Raises:
        CheckpointError / PairingError: unreadable checkpoints or a draft that does not fit.
    """
    if draft is None:
        return summarize(WeightSource(ckpt))
    from edgebuild.checkpoint.pairing import PairedSources

    pair = PairedSources(WeightSource(draft), WeightSource(ckpt, TARGET))
    pair.validate()
    head, embed = pair.lm_head(), pair.embed_tokens()
    return {
        "target": summarize(pair.target),
        "draft": summarize(pair.draft),
        "borrowed": {
            "lm_head": f"{head.name} from {head.checkpoint_source} ({head.format}, {head.file})",
            "embed_tokens": f"{embed.name} from {embed.checkpoint_source} ({embed.format}, {embed.file})",
        },
    }
