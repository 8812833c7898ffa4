"""Loading the TensorRT backend: :func:`open_trt_runtime` (engines onto the GPU) and
:func:`assemble_runtime` (the backends over loaded engine runners, the CPU tests' entry), which
return a :class:`TrtRuntime` record (the TensorRT side of
:class:`edgebuild.runtime.torch_backend.TorchRuntime`); the checks of a speculative config and
a vision-language bundle against the engines."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgebuild.errors import ConfigError, MissingDependencyError
from edgebuild.models.vision import VisionConfig
from edgebuild.runtime.multimodal import VisionEncoder
from edgebuild.runtime.trt.buffers import (
    EngineRunner,
)
from edgebuild.runtime.trt.draft import TrtDraft
from edgebuild.runtime.trt.target import IMAGE_TABLE, TrtTarget
from edgebuild.runtime.trt.visual import TrtVisual
from edgebuild.runtime.trt_plan import (
    BufferPlan,
    EngineLimits,
    plan_buffers,
    role_io,
    role_profiles,
)

log = logging.getLogger("edgebuild.runtime")


@dataclass(frozen=True)
class TrtOptions:
    """How the TensorRT backend runs.

    plugin_library: the plugin ``.so`` (default: ``$EDGEBUILD_PLUGIN_LIB`` or plugins/build).
    cuda_graphs: capture decode / verify / draft shapes that repeat.
    """

    plugin_library: Path | None = None
    cuda_graphs: bool = True


@dataclass
class TrtRuntime:
    """The loaded TensorRT backends of a bundle, and what the LLM needs around them (the
    TensorRT side of :class:`edgebuild.runtime.torch_backend.TorchRuntime`)."""

    target: TrtTarget
    draft: TrtDraft | None
    config: object  # the target's ModelConfig
    plan: BufferPlan
    runners: dict[str, object] = field(default_factory=dict)
    vision: VisionEncoder | None = None  # the visual engine + image processor (VLM bundles)
    target_model: None = None  # no torch target model on this backend (TorchRuntime has one)

    def runtime_options(self, options):
        """RuntimeOptions clamped to the engines: the KV pool (every page of the engines'
        pools), the per-sequence capacity (build.max_kv_cache_capacity), prompt, page size,
        images per prompt."""
        from dataclasses import replace

        lim = self.plan.limits
        images = options.max_images
        if self.vision is not None:
            images = min(images, self.vision.max_images)
        return replace(
            options,
            max_kv_rows=lim.num_pages * lim.page_size,
            max_seq_rows=lim.kv_capacity,
            max_input_len=lim.max_input_len,
            page_size=lim.page_size,
            max_images=images,
        )

    def decoder(self, spec, prefill=None):
        """The decoder over these engines (`prefill`: a resolved PrefillConfig; the prefix
        cache lives in the target's page allocator, shared with the engines' pools).

        Raises:
            ConfigError: a `quantization` or `token_map` given in the speculative config
                (torch runtime only), or a `draft_top_k` given there that differs from
                the candidate count the draft engine was built with (it is part of the
                engine's shapes and cannot change at run time).
        """
        from edgebuild.runtime.decoding import TargetOnlyDecoder
        from edgebuild.runtime.prefill import PrefillConfig
        from edgebuild.speculative.registry import get_method

        lim = self.plan.limits  # chunks never above the engines' max input length
        prefill = (prefill or PrefillConfig()).resolved(lim.page_size, lim.max_input_len)
        if prefill.enable_prefix_caching or prefill.enable_chunked_prefill:
            log.info(
                "tensorrt: chunked prefill %s (%d rows), prefix caching %s; cached pages are "
                "reused as the engines' context phase wrote them (bit-identity with a one-pass "
                "prefill is checked on the CPU backend only)",
                "on" if prefill.enable_chunked_prefill else "off",
                prefill.prefill_chunk,
                "on" if prefill.enable_prefix_caching else "off",
            )
        if self.draft is None:
            return TargetOnlyDecoder(self.target, prefill)
        spec.check_engine_backend("the bundle's engines")
        if spec.draft_top_k_given and spec.draft_top_k != self.draft.top_k:
            raise ConfigError(
                f"--speculative-config: draft_top_k {spec.draft_top_k} cannot be honoured: the "
                f"bundle's draft engine was built for {self.draft.top_k} candidates per "
                f"position; omit draft_top_k, set it to {self.draft.top_k}, or rebuild the "
                "bundle with speculative.draft_top_k in its recipe"
            )
        return get_method(spec.method).resolve("decoder")(
            self.target, self.draft, spec.num_speculative_tokens, spec.confidence_threshold,
            prefill=prefill,
        )  # fmt: skip


def _check_spec(manifest: dict, spec, limits: EngineLimits, bundle: Path) -> bool:
    """True when the draft engine is to be loaded; refuses a spec the engines cannot run."""
    if spec is None:
        return False
    roles = manifest.get("roles") or {}
    if "draft" not in roles:
        raise ConfigError(
            f"{bundle} has no draft engine; the TensorRT backend runs the bundle's own draft "
            "only (rebuild with --draft, or use --backend torch for another draft)"
        )
    built = Path(((manifest.get("sources") or {}).get("draft") or {}).get("path", ""))
    if Path(spec.model).resolve() != built.resolve():
        raise ConfigError(
            f"--speculative-config names the draft {spec.model}, but {bundle}'s draft engine "
            f"was built from {built}; use the bundle's draft or --backend torch"
        )
    if spec.num_speculative_tokens > limits.num_speculative_tokens:
        raise ConfigError(
            f"num_speculative_tokens {spec.num_speculative_tokens} exceeds the "
            f"{limits.num_speculative_tokens} the engines were built for (verify length "
            f"{limits.verify_len}); lower it or rebuild the bundle"
        )
    return True


def _check_vision(manifest: dict, config, bundle: Path) -> bool:
    """True when the target is a VLM (the visual engine is to be loaded).

    Raises:
        ConfigError: a VLM target whose bundle has no built visual engine, or whose base
            engine has no image inputs (built before image support).
    """
    if config.vision_config is None:
        return False
    roles = manifest.get("roles") or {}
    if not (roles.get("visual") or {}).get("engine"):
        raise ConfigError(
            f"{bundle}: the target is a vision-language model but the bundle has no visual "
            "engine (manifest roles.visual); rebuild it with `edgebuild build`, or use "
            "--backend torch"
        )
    names = {e.get("name") for e in (roles.get("base") or {}).get("inputs") or ()}
    if IMAGE_TABLE not in names:
        raise ConfigError(
            f"{bundle}: the target is a vision-language model but the base engine has no "
            f"{IMAGE_TABLE} input (built before image support); rebuild the bundle with "
            "`edgebuild build`, or use --backend torch"
        )
    return True


def assemble_runtime(
    manifest: dict,
    source,
    runners: dict[str, EngineRunner],
    device: torch.device | str = "cuda",
    stream=None,
) -> TrtRuntime:
    """The backends over already loaded engine runners (``base``, and ``draft`` / ``visual``
    when present): buffers from :func:`plan_buffers`, the draft's settings from the manifest,
    the vision config and image processor from ``source`` (the target checkpoint's
    :class:`~edgebuild.checkpoint.source.WeightSource`, as on the torch backend). The CPU
    tests pass stand-in runners and ``device="cpu"``.

    Raises:
        BundleError / ConfigError / EngineError: a manifest that does not describe the roles.
    """
    from edgebuild.checkpoint.config import ModelConfig
    from edgebuild.models.image_processing import ImageProcessor

    config = ModelConfig.from_dict(source.config, str(source.config_path))
    plan = plan_buffers(manifest)
    base = manifest["roles"]["base"]
    target = TrtTarget(
        runners["base"],
        role_io(manifest, "base"),
        role_profiles(manifest, "base"),
        plan,
        tuple(base.get("tap_layers") or ()),
        config.max_position_embeddings,
        device,
        stream,
    )
    draft = None
    if "draft" in runners:
        dspark = manifest["dspark"]
        draft = TrtDraft(
            runners["draft"],
            role_io(manifest, "draft"),
            role_profiles(manifest, "draft"),
            plan,
            int(dspark["block_size"]),
            tuple(dspark["target_layer_ids"]),
            target.vocab_size,
            device,
            stream,
        )
    vision = None
    if "visual" in runners:
        vcfg = VisionConfig.from_model_config(source.config, str(source.config_path))
        tower = TrtVisual(
            runners["visual"],
            role_io(manifest, "visual"),
            role_profiles(manifest, "visual"),
            plan,
            vcfg,
            device,
            stream,
        )
        processor = ImageProcessor.from_dir(Path(source.path), vcfg)
        vision = VisionEncoder(tower, processor, tower.max_images)
    log.info("TensorRT backend: %s", plan.summary())
    return TrtRuntime(target, draft, config, plan, dict(runners), vision)


def open_trt_runtime(resolved, spec, options: TrtOptions | None = None, source=None) -> TrtRuntime:
    """Load a bundle's engines onto the GPU (``resolved``: :func:`resolve_model_path`'s result).

    ``source``: the target checkpoint's WeightSource when the caller has opened it already
    (:class:`~edgebuild.runtime.llm.LLM`; not re-read), else it is opened here.

    A VLM bundle also loads its ``visual`` engine (:class:`TrtVisual`). Not run here: this
    needs TensorRT and a CUDA GPU (the CPU tests go through :func:`assemble_runtime`).

    Raises:
        ConfigError: not a bundle, a VLM bundle without a visual engine or image inputs
            (:func:`_check_vision`), a speculative config the engines cannot run.
        MissingDependencyError: no tensorrt / CUDA torch / plugin library (how to build it).
        EngineError / BundleError: engines that do not match the manifest.
    """
    from edgebuild.checkpoint.config import ModelConfig
    from edgebuild.checkpoint.source import WeightSource
    from edgebuild.engine.plugin_library import plugin_library_path
    from edgebuild.runtime.trt_engine import (
        TrtEngineRunner,
        load_plugin_library,
        load_tensorrt_runtime,
    )

    options = options or TrtOptions()
    if resolved.bundle is None:
        raise ConfigError(f"{resolved.target}: the TensorRT backend runs bundles (edgebuild build)")
    bundle, manifest = Path(resolved.bundle), resolved.manifest
    source = source if source is not None else WeightSource(resolved.target)
    config = ModelConfig.from_dict(source.config, str(source.config_path))
    with_visual = _check_vision(manifest, config, bundle)
    trt = load_tensorrt_runtime()
    if not torch.cuda.is_available():
        raise MissingDependencyError("the TensorRT backend needs a CUDA GPU visible to torch")
    if manifest.get("graph_kind") == "plugin":
        library = options.plugin_library or plugin_library_path()
        load_plugin_library(trt.get_plugin_registry(), manifest["plugin"], library, bundle)
    limits = EngineLimits.from_manifest(manifest)
    with_draft = _check_spec(manifest, spec, limits, bundle)
    stream = torch.cuda.Stream()
    roles = ["base", *(["draft"] if with_draft else []), *(["visual"] if with_visual else [])]
    runners = {
        role: TrtEngineRunner(
            trt,
            bundle / manifest["roles"][role]["engine"],
            role_io(manifest, role),
            role_profiles(manifest, role),
            stream,
            options.cuda_graphs,
        )
        for role in roles
    }
    return assemble_runtime(manifest, source, runners, "cuda", stream)
