"""The TensorRT vision tower: :class:`TrtVisual`, the ``visual`` engine as an image tower (one
call per request). The overview is :mod:`edgebuild.runtime.trt_backend`'s docstring."""

from __future__ import annotations

import torch

from edgebuild.errors import EngineError
from edgebuild.models.image_processing import ImageInput
from edgebuild.models.vision import VisionConfig, VisionPlan
from edgebuild.runtime.multimodal import ImageInputError
from edgebuild.runtime.trt.buffers import (
    EngineRunner,
    RoleBuffers,
    _on,
)
from edgebuild.runtime.trt_plan import (
    DTYPES,
    BufferPlan,
    Profile,
    RoleIO,
    choose_profile,
)


class TrtVisual:
    """The ``visual`` engine as an image tower (:class:`~edgebuild.runtime.multimodal.ImageTower`).

    One engine call per request (all its images in one pass, :mod:`edgebuild.runtime.trt_backend` images step 1).

    Args:
        runner: the visual engine runner.
        io, profiles, plan: the role's declared I/O, optimization profile and the buffer plan.
        config: the checkpoint's vision config (patch geometry, merge size, window size).
        device, stream: as for :class:`TrtTarget`.

    Attributes:
        max_tokens: image tokens one pass accepts (``build.max_image_tokens``).
        max_images: images one pass accepts (``build.max_images``).
    """

    def __init__(
        self,
        runner: EngineRunner,
        io: RoleIO,
        profiles: list[Profile],
        plan: BufferPlan,
        config: VisionConfig,
        device: torch.device | str = "cuda",
        stream=None,
    ):
        self.runner, self.io, self.profiles, self.stream = runner, io, profiles, stream
        self.config = config
        self.buffers = RoleBuffers(plan, "visual", io, device)
        self.dtype = DTYPES[io.get("pixel_values").dtype]
        self.width = int(io.get("image_embeds").dims[-1])
        if self.width != config.out_hidden_size:
            raise EngineError(
                f"the visual engine's image_embeds are {self.width} wide but the checkpoint's "
                f"vision_config.out_hidden_size is {config.out_hidden_size}; rebuild the bundle"
            )
        # the profile's largest token axis (merge_order) and segment axis (one per image)
        self.max_tokens = max(p.shapes["merge_order"][2][0] for p in profiles)
        self.max_images = max(p.shapes["full_index"][2][0] for p in profiles)

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Embeddings of preprocessed images: one ``[tokens_k, out_hidden_size]`` device tensor
        per image (engine dtype), in order.

        Raises:
            ImageInputError: more image tokens or images than the engine was built for.
        """
        plan = VisionPlan.build(self.config, [im.grid_thw for im in images])
        frames = int(plan.full.index.shape[0])
        if plan.num_tokens > self.max_tokens or frames > self.max_images:
            raise ImageInputError(
                f"{len(images)} images of {plan.num_tokens} image tokens in one request; the "
                f"visual engine takes at most {self.max_images} images of {self.max_tokens} "
                "tokens (build.max_images / build.max_image_tokens): send fewer or smaller "
                "images, or rebuild the bundle with larger limits"
            )
        pixels = torch.cat([im.pixel_values for im in images]).to(self.dtype)
        inputs = plan.engine_inputs(pixels)
        profile = choose_profile(self.profiles, {k: tuple(v.shape) for k, v in inputs.items()})
        with _on(self.stream):
            views = self.buffers.bind(inputs, {"image_embeds": (plan.num_tokens, self.width)})
            self.runner.execute(profile, views, None)
            out = views["image_embeds"].clone()  # the request's copy: the buffer is reused
        if self.stream is not None:
            self.stream.synchronize()  # the host staging of this pass is reused by the next
        cu = plan.cu_tokens
        return [out[cu[k] : cu[k + 1]] for k in range(len(images))]
