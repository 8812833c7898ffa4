"""`edgebuild inspect`: what a checkpoint (or a draft/target pair) holds, without loading it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from edgebuild.checkpoint.config import text_config_view
from edgebuild.checkpoint.source import TARGET, WeightSource


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} GiB"


# Draft packagings: checked against their target (`--draft`), not as a standalone decoder.
_DRAFT_ARCHITECTURES = ("DSparkDraftModel", "Qwen3DSparkModel")


def summarize(source: WeightSource) -> dict:
    """Architecture, dtypes, quant format, tensor count and bytes of one checkpoint.

    A decoder's report also says which ids end generation (:func:`stop_report`).
    """
    cfg = text_config_view(source.config)  # a VLM's language model may sit in text_config
    dtypes = Counter(str(source.info(n).dtype).replace("torch.", "") for n in source.names())
    report = {
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
    if report["architecture"] not in _DRAFT_ARCHITECTURES:  # a decoder: what ends generation
        report.update(stop_report(source))
    return report


def stop_report(source: WeightSource) -> dict[str, str]:
    """Which ids end generation (generation_config.json, else config.json, plus the
    tokenizer's EOS, as :meth:`edgebuild.runtime.llm.LLM.eos_ids`) and the sampling defaults.
    """
    from edgebuild.checkpoint.generation import read_generation_defaults, tokenizer_eos

    gen = read_generation_defaults(source.path, source.config)
    out = gen.describe()
    tok = tokenizer_eos(source.path)
    if tok is not None:
        name, tok_id = tok
        ids = sorted({*gen.eos_token_ids, *([tok_id] if tok_id is not None else [])})
        out["eos_token_ids"] += f" + tokenizer eos_token {name!r} = {tok_id}"
        out["stop_ids"] = str(ids)
    else:
        out["stop_ids"] = str(sorted(gen.eos_token_ids))
    return out


def check_decoder(source: WeightSource) -> None:
    """Refuse a decoder checkpoint that could not be loaded: config, tensor names, shapes,
    dtypes and quantization scales (the checks `LlamaForCausalLM.from_source` runs first).

    Draft packagings are skipped (they are validated against their target with `--draft`).

    Raises:
        ConfigError / CheckpointError / QuantFormatError: naming the file and the problem.
    """
    archs = source.config.get("architectures")
    if isinstance(archs, list) and archs and archs[0] in _DRAFT_ARCHITECTURES:
        return
    from edgebuild.checkpoint.config import ModelConfig
    from edgebuild.models.llama import check_tensors, expected_shapes

    cfg = ModelConfig.from_dict(source.config, source=str(source.config_path))
    check_tensors(source, cfg, expected_shapes(cfg))


def inspect_checkpoint(ckpt: Path, draft: Path | None = None) -> dict:
    """Report for `edgebuild inspect`; with `draft`, which draft tensors come from the target.

    The checkpoint (the target, with `draft`) is checked as `LlamaForCausalLM.from_source`
    would check it (:func:`check_decoder`), and a draft goes through
    :func:`edgebuild.checkpoint.draft.pair_draft`, the validation `edgebuild run`, the server
    and `build` run before loading it: a draft they refuse fails here with the same message.

    Raises:
        CheckpointError / ConfigError / PairingError: unreadable or inconsistent checkpoints,
            or a draft that does not fit.
    """
    if draft is None:
        source = WeightSource(ckpt)
        check_decoder(source)
        return summarize(source)
    from edgebuild.checkpoint.draft import pair_draft

    draft_source, target = WeightSource(draft), WeightSource(ckpt, TARGET)
    check_decoder(target)
    plan = pair_draft(target, draft_source)  # what run, serve and build validate
    head, embed, cfg = plan.lm_head, plan.embed_tokens, plan.config
    return {
        "target": summarize(plan.target),
        "draft": {
            **summarize(plan.draft),
            "block_size": cfg.block_size,
            "target_layer_ids": list(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id,
            "markov_head": f"{cfg.markov_head_type} rank {cfg.markov_rank}"
            if cfg.markov_rank
            else "none",
            "confidence_head": cfg.enable_confidence_head,
            # the draft's context cache, counted with the target's pages (bf16 values)
            "kv_cache_bf16": cfg.kv_budget(2),
        },
        "borrowed": {
            "lm_head": f"{head.name} from {head.checkpoint_source} ({head.format}, {head.file})",
            "embed_tokens": f"{embed.name} from {embed.checkpoint_source} ({embed.format}, {embed.file})",
        },
    }


def inspect_bundle(bundle: Path) -> dict:
    """Report for ``edgebuild inspect BUNDLE``: what its ``manifest.json`` records (the
    files are not re-hashed: that is ``edgebuild verify``).

    Returns:
        ``{"bundle", "format_version", "roles": {role: "graph_kind dtype, onnx, engine"},
        "sources": {name: checkpoint path}, "limits": the manifest's ``build`` fields,
        "speculative", "dspark_kv_cache" (the draft's attention and K+V bytes per token),
        "engines"}``; keys the manifest lacks are left out.

    Raises:
        BundleError: no manifest, bad JSON, another format or format version.
    """
    from edgebuild.bundle.manifest import read_manifest

    m = read_manifest(bundle)
    roles = {
        name: f"{r.get('graph_kind')} {r.get('dtype')}, {r.get('onnx')}, "
        f"engine {r.get('engine') or 'not built'}"
        for name, r in sorted(m.get("roles", {}).items())
    }
    report = {
        "bundle": str(Path(bundle).resolve()),
        "format_version": m.get("format_version"),
        "roles": roles,
        "sources": {k: v.get("path") for k, v in sorted(m.get("sources", {}).items())},
        "limits": m.get("build"),
        "speculative": m.get("speculative"),
        "dspark_kv_cache": (m.get("dspark") or {}).get("kv_cache"),
        "engines": (m.get("engines") or {}).get("status"),
    }
    return {k: v for k, v in report.items() if v is not None}
