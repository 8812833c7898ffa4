"""Image loading for the server: accepted sources, and a MediaError (HTTP 400) for every bad
image (corrupt bytes, zero size, huge dimensions, too many, outside the allowed folder, http)."""

from __future__ import annotations

import base64
import io

import pytest
from vlm_fixtures import noise_image, png_bytes

from edgebuild.errors import RequestError
from edgebuild.serve.media import (
    MediaError,
    MediaLimits,
    decode_image,
    load_image,
    load_images,
    message_image_urls,
)

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def test_a_data_url_decodes_to_the_same_rgb_pixels():
    image = noise_image(31, 17, seed=4)
    got = load_image(data_url(png_bytes(image)), MediaLimits())
    assert got.mode == "RGB" and got.size == (31, 17)
    assert got.tobytes() == image.tobytes()


def test_exif_orientation_is_applied_like_transformers_load_image():
    image = noise_image(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when displayed
    buf = io.BytesIO()
    image.save(buf, format="JPEG", exif=exif)
    assert load_image(data_url(buf.getvalue(), "image/jpeg"), MediaLimits()).size == (20, 40)


def test_local_files_only_inside_the_allowed_folder(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "ok.png").write_bytes(png_bytes(noise_image(8, 8)))
    (tmp_path / "secret.png").write_bytes(png_bytes(noise_image(8, 8)))
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    limits = MediaLimits(allowed_local_media_path=allowed)
    assert load_image(str(allowed / "ok.png"), limits).size == (8, 8)
    assert load_image((allowed / "ok.png").as_uri(), limits).size == (8, 8)
    for bad in (tmp_path / "secret.png", allowed / ".." / "secret.png", allowed / "link.png"):
        with pytest.raises(MediaError, match="outside the allowed folder"):
            load_image(str(bad), limits)
    with pytest.raises(MediaError, match="allowed-local-media-path"):
        load_image(str(allowed / "ok.png"), MediaLimits())
    with pytest.raises(MediaError, match="does not exist"):
        load_image(str(allowed / "missing.png"), limits)


BAD = {
    "http": ("http://example.com/cat.png", "not fetched"),
    "https": ("https://example.com/cat.png", "not fetched"),
    "ftp": ("ftp://example.com/cat.png", "unsupported image URL scheme"),
    "not-base64": ("data:image/png;base64,@@@@", "not valid base64"),
    "no-base64-flag": ("data:image/png,abcd", "data URL must look like"),
    "not-an-image-type": (data_url(b"hello", "text/plain"), "not an image"),
    "corrupt-bytes": (data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 50), "not a readable image"),
    "empty": ("data:image/png;base64,", "empty"),
    "truncated": (data_url(png_bytes(noise_image(64, 64))[:-200]), "corrupt or truncated"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_sources_and_bytes_raise_a_media_error(name):
    url, message = BAD[name]
    with pytest.raises(MediaError, match=message) as info:
        load_image(url, MediaLimits())
    assert isinstance(info.value, RequestError)  # the server maps it to 400


def test_zero_size_and_huge_dimensions_are_refused_before_decoding():
    # a PNG header declaring 0 x 5 and one declaring 100000 x 100000 (no pixel data needed)
    with pytest.raises(MediaError, match="zero size|not a readable"):
        decode_image(_png_header(0, 5), MediaLimits())
    with pytest.raises(MediaError, match="too large|exceed the limits"):
        decode_image(_png_header(100_000, 100_000), MediaLimits())
    with pytest.raises(MediaError, match="exceed the limits"):
        decode_image(png_bytes(noise_image(300, 10)), MediaLimits(max_image_side=256))
    with pytest.raises(MediaError, match="larger than"):
        decode_image(png_bytes(noise_image(64, 64)), MediaLimits(max_image_bytes=100))


def test_too_many_images_and_parts_without_urls():
    url = data_url(png_bytes(noise_image(4, 4)))
    with pytest.raises(MediaError, match="at most 2"):
        load_images([url] * 3, MediaLimits(max_images=2))
    msgs = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]},
        {"role": "user", "content": [{"type": "input_image", "image_url": url}]},
        {
            "role": "user",
            "content": [{"type": "image", "image": url}, {"type": "text", "text": "x"}],
        },
    ]
    assert message_image_urls(msgs) == [url] * 3
    with pytest.raises(MediaError, match="image_url.url"):
        message_image_urls([{"role": "user", "content": [{"type": "image_url"}]}])


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height (CRC valid; no image data)."""
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    crc = struct.pack(">I", zlib.crc32(chunk) & 0xFFFFFFFF)
    end = b"IEND"
    return (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", len(ihdr))
        + chunk
        + crc
        + struct.pack(">I", 0)
        + end
        + struct.pack(">I", zlib.crc32(end) & 0xFFFFFFFF)
    )
