"""Qwen2-VL / Qwen2.5-VL image preprocessing: PIL image -> patch rows for the vision tower.

Same pixels as transformers' ``Qwen2VLImageProcessorPil`` (the PIL backend; the torchvision
backend is unavailable beside the CPU torch wheel here), step by step:

1. convert to RGB (PIL ``convert("RGB")``);
2. ``smart_resize``: both sides to multiples of ``patch_size * merge_size``, total pixels in
   ``[min_pixels, max_pixels]``, aspect ratio kept as well as possible; PIL resize (bicubic)
   of the uint8 image;
3. rescale (``x * 1/255`` in fp64, then fp32) and normalize (``(x - mean) / std`` in fp32,
   CLIP mean / std by default);
4. patchify: a still image is repeated ``temporal_patch_size`` times along time; rows are
   ``[t, h/m, w/m, m, m]`` (2x2 merge-block order, not raster order), each row
   ``[C, T, P, P]`` flattened.

Settings come from the checkpoint's ``preprocessor_config.json`` (``min_pixels`` /
``max_pixels`` or ``size.shortest_edge`` / ``size.longest_edge``, mean, std, patch sizes).
Sources: transformers 5.14 ``models/qwen2_vl/image_processing_pil_qwen2_vl.py``
(``smart_resize``, ``_preprocess``), ``image_transforms.py`` (``resize``, ``rescale``,
``normalize``), ``image_processing_backends.py`` (``PilBackend``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgebuild.errors import ConfigError, MissingDependencyError, RequestError
from edgebuild.models.vision import VisionConfig

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # HF smart_resize refuses more


class ImageSizeError(RequestError):
    """An image whose shape the model cannot take (aspect ratio over 200, zero size)."""


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Target ``(height, width)``: multiples of ``factor``, area in ``[min_pixels, max_pixels]``.

    Raises:
        ImageSizeError: a zero side or an aspect ratio over 200 (HF raises ValueError there).
    """
    if height <= 0 or width <= 0:
        raise ImageSizeError(f"image has zero size ({width}x{height} pixels)")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageSizeError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} ({width}x{height}) "
            f"is over {MAX_ASPECT_RATIO}; crop or pad the image"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image.

    pixel_values: fp32 [t * h * w, C * T * P * P] patch rows (merge-block order).
    grid_thw: (t, h, w) in patches.
    num_tokens: LLM tokens it becomes: t * h * w / merge_size ** 2 (image pad tokens).
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    num_tokens: int


@dataclass(frozen=True)
class ImageProcessor:
    """Qwen2-VL image processor settings (``preprocessor_config.json`` keys)."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL.Image.Resampling.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @classmethod
    def from_dir(cls, model_dir: str | Path, vision: VisionConfig) -> ImageProcessor:
        """Settings of ``model_dir/preprocessor_config.json`` (defaults when it is absent).

        Raises:
            ConfigError: unreadable JSON, or patch / temporal / merge sizes that differ from
                the checkpoint's ``vision_config``.
        """
        path = Path(model_dir) / "preprocessor_config.json"
        raw: dict = {}
        if path.is_file():
            try:
                raw = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
        fields = {
            "min_pixels": raw.get("min_pixels", size.get("shortest_edge", cls.min_pixels)),
            "max_pixels": raw.get("max_pixels", size.get("longest_edge", cls.max_pixels)),
            "patch_size": raw.get("patch_size", vision.patch_size),
            "temporal_patch_size": raw.get("temporal_patch_size", vision.temporal_patch_size),
            "merge_size": raw.get("merge_size", vision.spatial_merge_size),
        }
        for key in ("image_mean", "image_std"):
            if raw.get(key) is not None:
                fields[key] = tuple(float(v) for v in raw[key])
        for key in ("rescale_factor", "resample", "do_resize", "do_rescale", "do_normalize"):
            if raw.get(key) is not None:
                fields[key] = raw[key]
        if raw.get("do_convert_rgb") is not None:
            fields["do_convert_rgb"] = bool(raw["do_convert_rgb"])
        proc = cls(**fields)
        want = (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)
        got = (proc.patch_size, proc.temporal_patch_size, proc.merge_size)
        if got != want:
            raise ConfigError(
                f"{path}: patch_size / temporal_patch_size / merge_size {got} differ from "
                f"vision_config {want} in {vision.source}"
            )
        if len(proc.image_mean) != vision.in_channels or len(proc.image_std) != vision.in_channels:
            raise ConfigError(f"{path}: image_mean / image_std need {vision.in_channels} values")
        return proc

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` the image is resized to (see :func:`smart_resize`)."""
        if not self.do_resize:
            return height, width
        factor = self.patch_size * self.merge_size
        return smart_resize(height, width, factor, self.min_pixels, self.max_pixels)

    def num_tokens(self, height: int, width: int) -> int:
        """Image pad tokens of a still ``height x width`` image."""
        h, w = self.target_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def __call__(self, image) -> ImageInput:
        """Preprocess one PIL image (see the module docstring).

        Raises:
            ImageSizeError: zero size or aspect ratio over 200.
            MissingDependencyError: Pillow is not installed.
        """
        try:
            from PIL import Image
        except ImportError as exc:  # pragma: no cover - pillow is a dependency
            raise MissingDependencyError("image input needs Pillow: pip install pillow") from exc
        if self.do_convert_rgb and image.mode != "RGB":
            image = image.convert("RGB")
        width, height = image.size
        h, w = self.target_size(height, width)
        if self.do_resize:
            image = image.resize((w, h), resample=Image.Resampling(self.resample))
        array = np.array(image)  # uint8 [H, W, C]
        if array.ndim == 2:
            array = array[:, :, None]
        array = array.transpose(2, 0, 1)  # [C, H, W]
        if self.do_rescale:
            array = (array.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            array = (
                array.astype(np.float32) if not np.issubdtype(array.dtype, np.floating) else array
            )
            mean = np.array(self.image_mean, dtype=array.dtype)
            std = np.array(self.image_std, dtype=array.dtype)
            array = ((array.T - mean) / std).T
        return self._patchify(array.astype(np.float32, copy=False))

    def _patchify(self, array: np.ndarray) -> ImageInput:
        """[C, H, W] fp32 -> patch rows in merge-block order, time repeated to T frames."""
        c, height, width = array.shape
        p, t, m = self.patch_size, self.temporal_patch_size, self.merge_size
        frames = np.repeat(array[None], t, axis=0)  # [T, C, H, W]: a still image, repeated
        gh, gw = height // p, width // p
        x = frames.reshape(1, t, c, gh // m, m, p, gw // m, m, p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [1, h/m, w/m, m, m, C, T, P, P]
        rows = np.ascontiguousarray(x).reshape(gh * gw, c * t * p * p)
        return ImageInput(torch.from_numpy(rows), (1, gh, gw), gh * gw // m**2)
