"""Images in prompts: the runtime side of a vision-language target (Qwen2.5-VL layout).

:class:`VisionEncoder` owns an image tower and the image processor of a VLM checkpoint and
turns a prompt with images into what the target's prefill needs. The tower is anything with
the :class:`ImageTower` surface: the torch :class:`~edgebuild.models.vision.VisionTower` (CPU
backend) or the bundle's visual engine (:class:`edgebuild.runtime.trt_backend.TrtVisual`).

1. :meth:`VisionEncoder.process`: PIL images -> :class:`ImageInput` (patch rows + grid);
2. :meth:`VisionEncoder.expand_placeholders`: the chat template renders one image pad token
   per image (``<|vision_start|><|image_pad|><|vision_end|>``); the k-th pad becomes
   ``images[k].num_tokens`` pads (what transformers' processor does to the text);
3. :meth:`VisionEncoder.prepare`: runs the tower and returns a
   :class:`~edgebuild.runtime.backend.MultimodalPrefill`: the pad rows of the prompt, the
   tower's embeddings for them, the 3-axis mrope positions of the prompt (``[3, P]``) and
   ``rope_delta`` (decode step j then runs at position ``P + j + rope_delta`` on every axis).
   The target backend splices the embeddings over the pad rows (torch: over its token
   embeddings; TensorRT: inside the base engine, see :mod:`edgebuild.export.graphs`).

The DSpark draft needs nothing special: the prefill returns the target's taps of every prompt
row (image rows included) and the draft's context starts from them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from edgebuild.checkpoint.source import WeightSource
from edgebuild.errors import RequestError
from edgebuild.models.image_processing import ImageInput, ImageProcessor
from edgebuild.models.vision import VisionConfig, VisionTower
from edgebuild.ops.mrope import mrope_position_ids
from edgebuild.runtime.backend import MultimodalPrefill

log = logging.getLogger("edgebuild.runtime")

IMAGE_PART_TYPES = ("image", "image_url", "input_image")


class ImageInputError(RequestError):
    """Images and their placeholders in a prompt do not fit (count, model without vision)."""


class ImageTower(Protocol):
    """What :class:`VisionEncoder` needs of a vision tower (torch module or visual engine)."""

    config: VisionConfig

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """One ``[tokens_k, out_hidden_size]`` embedding tensor per image, in order."""
        ...


def count_image_parts(messages: Sequence[dict]) -> int:
    """Number of image content parts in OpenAI-style chat messages."""
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
    )


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages for the chat template: image parts become ``{"type": "image"}`` (no payload)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [
                {"type": "image"}
                if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                else p
                for p in content
            ]
        out.append({**m, "content": content})
    return out


class VisionEncoder:
    """An image tower + the image processor of a VLM checkpoint.

    Args:
        tower: the loaded :class:`VisionTower` (CPU) or the visual engine
            (:class:`~edgebuild.runtime.trt_backend.TrtVisual`).
        processor: the checkpoint's :class:`ImageProcessor`.
        max_images: most images accepted in one prompt.
    """

    def __init__(self, tower: ImageTower, processor: ImageProcessor, max_images: int = 8):
        self.tower, self.processor = tower, processor
        self.config = tower.config
        self.image_token_id = self.config.image_token_id
        self.max_images = max_images

    @classmethod
    def from_source(
        cls, source: WeightSource, model_dir: Path, dtype: torch.dtype, max_images: int = 8
    ) -> VisionEncoder:
        """Load ``visual.*`` and ``preprocessor_config.json`` (CheckpointError / ConfigError)."""
        tower = VisionTower.from_source(source, dtype)
        return cls(tower, ImageProcessor.from_dir(model_dir, tower.config), max_images)

    def process(self, images: Sequence) -> list[ImageInput]:
        """Preprocess PIL images (ImageSizeError / ImageInputError on bad sizes or counts)."""
        if len(images) > self.max_images:
            raise ImageInputError(
                f"{len(images)} images in one request; at most {self.max_images} are accepted"
            )
        return [self.processor(im) for im in images]

    def expand_placeholders(self, ids: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
        """Replace the k-th image pad token of ``ids`` by ``images[k].num_tokens`` pads.

        Raises:
            ImageInputError: the number of pads differs from the number of images.
        """
        pad = self.image_token_id
        found = sum(1 for t in ids if t == pad)
        if found != len(images):
            raise ImageInputError(
                f"the prompt has {found} image placeholders (token id {pad}) for "
                f"{len(images)} images; send one image content part per image"
            )
        out: list[int] = []
        k = 0
        for t in ids:
            if t == pad:
                out.extend([pad] * images[k].num_tokens)
                k += 1
            else:
                out.append(t)
        return out

    def prepare(self, prompt_ids: Sequence[int], images: Sequence[ImageInput]) -> MultimodalPrefill:
        """Run the tower; the image rows, their embeddings and the mrope positions of a prompt.

        Args:
            prompt_ids: token ids with image pads already expanded (P of them).
            images: the preprocessed images, in prompt order.

        Returns:
            ``image_rows`` int64 [N] (the pad rows), ``image_embeds`` [N, d] (the tower's
            dtype and device), ``positions`` int64 [3, P], ``rope_delta``.

        Raises:
            ImageInputError: pad runs that do not match the images (or, on the TensorRT
                backend, more image tokens / images than the visual engine was built for).
        """
        pad = self.image_token_id
        ids = torch.tensor(list(prompt_ids), dtype=torch.int64)
        is_pad = ids == pad
        want = sum(im.num_tokens for im in images)
        if int(is_pad.sum()) != want:
            raise ImageInputError(
                f"the prompt has {int(is_pad.sum())} image pad tokens (id {pad}) but its "
                f"{len(images)} images need {want}; build the prompt with encode_messages"
            )
        try:
            positions, delta = mrope_position_ids(
                prompt_ids, pad, [im.grid_thw for im in images], self.config.spatial_merge_size
            )
        except ValueError as exc:
            raise ImageInputError(f"image placeholders do not match the images: {exc}") from None
        rows = is_pad.nonzero().flatten()  # [N]
        if images:
            with torch.inference_mode():
                embeds = torch.cat(self.tower.encode(images))  # [N, d]
        else:
            embeds = torch.zeros(0, self.config.out_hidden_size)
        return MultimodalPrefill(rows, embeds, positions, delta)
