"""Images of chat requests: where they may come from, decoding, and the limits that keep the
server safe. Every refusal is a :class:`MediaError` (a ``RequestError``: HTTP 400, the server
keeps serving).

Accepted sources, per image content part (``image_url`` with ``{"url": ...}`` or a string,
``input_image`` with ``image_url``, ``image`` with ``image``):

* ``data:image/...;base64,...`` URLs (the OpenAI client's way to send a local image);
* local files (``file://`` URL or a plain path) only inside ``--allowed-local-media-path``
  (the resolved path, symlinks followed, must stay inside that folder);
* ``http://`` / ``https://`` URLs are refused: the device may be offline, and fetching
  arbitrary URLs from a server is a request-forgery risk. Send the bytes as a data URL.

Decoding checks, in order, before any pixel is decoded: the encoded size (``max_image_bytes``),
that Pillow recognizes the format, the declared size (zero width/height, ``max_image_side``,
``max_image_pixels``: a decompression bomb never gets decoded), then a full decode (truncated
or corrupt data fails here). EXIF orientation is applied and the image converted to RGB, as
transformers' ``load_image`` does.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from edgebuild.errors import MissingDependencyError, RequestError
from edgebuild.serve.protocol import ImagePart

IMAGE_PART_TYPES = ("image_url", "input_image", "image")
_DATA_URL = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?),(?P<data>.*)$", re.S
)


class MediaError(RequestError):
    """An image in a request cannot be used (source, size, count or content); HTTP 400."""


@dataclass(frozen=True)
class MediaLimits:
    """What the server accepts.

    Attributes:
        max_images: images per request.
        max_image_bytes: encoded bytes per image (after base64 decoding).
        max_image_pixels: width * height declared by the image header.
        max_image_side: longest side in pixels.
        allowed_local_media_path: folder local files may come from (None = no local files).
    """

    max_images: int = 8
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 64 * 1024 * 1024
    max_image_side: int = 16384
    allowed_local_media_path: Path | None = None


def part_image_url(part: dict) -> str:
    """The URL / data URL / path of one image content part.

    Raises:
        MediaError: the part has no URL string where its type puts it.
    """
    kind = part.get("type")
    value = part.get("image" if kind == "image" else "image_url")
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value.strip():
        where = "image" if kind == "image" else "image_url.url"
        raise MediaError(f"{kind} content part needs a non-empty '{where}' string")
    return value.strip()


def message_image_urls(messages: Sequence[dict]) -> list[str]:
    """Image URLs of OpenAI-style chat messages, in order."""
    return [
        part_image_url(p)
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
    ]


def has_image_parts(messages: Sequence) -> bool:
    """Whether parsed chat messages (``protocol.ChatMessage``) carry any image part."""
    return any(
        isinstance(m.content, list) and any(isinstance(p, ImagePart) for p in m.content)
        for m in messages
    )


def chat_messages(messages: Sequence) -> tuple[list[dict], list[str]]:
    """Parsed chat messages -> (template messages with image parts kept, image URLs in order).

    Raises:
        MediaError: an image part without a URL.
    """
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = [p.model_dump() for p in content]
        out.append({"role": m.role, "content": content})
    return out, message_image_urls(out)


def load_images(urls: Sequence[str], limits: MediaLimits) -> list:
    """Decode every image of a request (count checked first). Returns RGB PIL images."""
    if len(urls) > limits.max_images:
        raise MediaError(
            f"{len(urls)} images in one request; at most {limits.max_images} are accepted"
        )
    return [load_image(u, limits, index=i) for i, u in enumerate(urls)]


def load_image(url: str, limits: MediaLimits, index: int = 0):
    """One image from a data URL or an allowed local file, checked and decoded (RGB PIL image).

    Raises:
        MediaError: refused source (http(s), path outside the allowed folder, unknown scheme),
            bad base64, too many bytes, unrecognized or corrupt data, zero or excessive size.
    """
    what = f"image {index}"
    scheme = urlparse(url).scheme.lower() if "://" in url or url.startswith("data:") else ""
    if scheme in ("http", "https"):
        raise MediaError(
            f"{what}: http(s) image URLs are not fetched (the device may be offline); "
            "send the image inline as a 'data:image/...;base64,...' URL"
        )
    if scheme == "data":
        data = _data_url_bytes(url, what, limits)
    elif scheme in ("", "file"):
        data = _local_file_bytes(url, what, limits)
    else:
        raise MediaError(f"{what}: unsupported image URL scheme {scheme!r}; use a data: URL")
    return decode_image(data, limits, what)


def _data_url_bytes(url: str, what: str, limits: MediaLimits) -> bytes:
    match = _DATA_URL.match(url)
    if match is None or ";base64" not in (match.group("params") or ""):
        raise MediaError(f"{what}: a data URL must look like 'data:image/png;base64,<data>'")
    mime = (match.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise MediaError(f"{what}: data URL media type {mime!r} is not an image")
    payload = match.group("data")
    if len(payload) * 3 // 4 > limits.max_image_bytes + 3:
        raise MediaError(
            f"{what}: image is larger than {limits.max_image_bytes} bytes (encoded size limit)"
        )
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{what}: the data URL is not valid base64") from None


def _local_file_bytes(url: str, what: str, limits: MediaLimits) -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise MediaError(
            f"{what}: local image files are disabled; start the server with "
            "--allowed-local-media-path DIR, or send a data: URL"
        )
    raw = unquote(urlparse(url).path) if url.lower().startswith("file:") else url
    try:
        path = Path(raw).resolve(strict=True)
    except (OSError, RuntimeError):
        raise MediaError(f"{what}: local image file {raw!r} does not exist") from None
    base = Path(root).resolve()
    if not path.is_relative_to(base):
        raise MediaError(
            f"{what}: local image {raw!r} is outside the allowed folder "
            "(--allowed-local-media-path)"
        )
    if not path.is_file():
        raise MediaError(f"{what}: local image {raw!r} is not a file")
    if path.stat().st_size > limits.max_image_bytes:
        raise MediaError(f"{what}: image file is larger than {limits.max_image_bytes} bytes")
    return path.read_bytes()


def decode_image(data: bytes, limits: MediaLimits, what: str = "image"):
    """Bytes -> RGB PIL image, with the size checks of the module docstring."""
    try:
        from PIL import Image, ImageOps
    except ImportError as exc:  # pragma: no cover - pillow is a dependency
        raise MissingDependencyError("image input needs Pillow: pip install pillow") from exc
    if not data:
        raise MediaError(f"{what}: the image is empty (0 bytes)")
    if len(data) > limits.max_image_bytes:
        raise MediaError(f"{what}: image is larger than {limits.max_image_bytes} bytes")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise MediaError(f"{what}: image dimensions are too large") from None
        except Exception as exc:  # Pillow raises many types on bad input
            raise MediaError(
                f"{what}: not a readable image ({type(exc).__name__}); send PNG, JPEG, WebP, "
                "GIF or BMP data"
            ) from None
        width, height = image.size
        if width <= 0 or height <= 0:
            raise MediaError(f"{what}: the image has zero size ({width}x{height})")
        if max(width, height) > limits.max_image_side or width * height > limits.max_image_pixels:
            raise MediaError(
                f"{what}: image dimensions {width}x{height} exceed the limits (longest side "
                f"{limits.max_image_side}, {limits.max_image_pixels} pixels)"
            )
        try:
            image.load()
            image = ImageOps.exif_transpose(image)
            return image.convert("RGB")
        except Exception as exc:
            raise MediaError(
                f"{what}: the image data is corrupt or truncated ({type(exc).__name__}: {exc})"
            ) from None
