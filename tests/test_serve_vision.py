"""Images through `edgellm-serve` with the official `openai` client (tiny random-weight VLM).

Chat requests with `image_url` data URLs (and allowed local files) answer exactly what the
target-only runtime answers for the same conversation, streamed or not, served target-only or
with a DSpark draft (lossless); bad images get a 400 with a clear message and the server keeps
serving.
"""

from __future__ import annotations

import base64

import openai
import pytest
from dspark_fixtures import make_random_draft
from serve_fixtures import serving, torch_threads
from vlm_fixtures import noise_image, png_bytes, write_tiny_vlm

from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.sampling import SamplingParams

pytest.importorskip("PIL")
OPTIONS = RuntimeOptions(max_kv_rows=4096, page_size=16, max_images=2)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_tiny_vlm(tmp_path_factory.mktemp("serve-vlm") / "vlm")


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png_bytes(noise_image(120, 80, seed=9)))
    return folder


@pytest.fixture(scope="module")
def base(vlm_dir):
    """The target-only runtime: the oracle of every served answer."""
    return LLM(vlm_dir, options=OPTIONS)


@pytest.fixture(scope="module", params=["target-only", "dspark"])
def served(request, vlm_dir, media_dir, tmp_path_factory):
    spec = None
    if request.param == "dspark":
        draft = make_random_draft(tmp_path_factory.mktemp("draft") / "d", vlm_dir, block_size=5)
        spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(vlm_dir, speculative=spec, options=OPTIONS)
    with torch_threads(1), serving(llm, allowed_local_media_path=media_dir) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield llm, client


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def user(*parts):
    content = [
        {"type": "text", "text": p} if not p.startswith(("data:", "/", "file:", "http"))
        else {"type": "image_url", "image_url": {"url": p}}
        for p in parts
    ]  # fmt: skip
    return [{"role": "user", "content": content}]


def runtime_text(llm, messages, pil_images):
    images = llm.process_images(pil_images)
    ids = llm.encode_messages(messages, images)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    state = llm.generate_ids([ids], params, images=[images])[0]
    return state.stopper.final_text(), len(ids)


def test_chat_with_a_data_url_image_answers_what_the_runtime_answers(served, base):
    _, client = served
    image = noise_image(150, 100, seed=1)
    messages = user(data_url(image), "What is in this image?")
    r = client.chat.completions.create(
        model="vlm", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
    )
    text, prompt_tokens = runtime_text(base, messages, [image])
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == prompt_tokens  # image pads counted
    stream = client.chat.completions.create(
        model="vlm", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_two_images_and_an_allowed_local_file(served, base, media_dir):
    _, client = served
    from PIL import Image

    first = noise_image(60, 90, seed=2)
    local = Image.open(media_dir / "cat.png").convert("RGB")
    messages = user(data_url(first), "and", str(media_dir / "cat.png"))
    r = client.chat.completions.create(
        model="vlm", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert r.choices[0].message.content == runtime_text(base, messages, [first, local])[0]


BAD = {
    "corrupt": ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "readable"),
    "http": ("http://example.com/a.png", "not fetched"),
    "outside-folder": ("/etc/passwd", "outside the allowed folder"),
    "huge": ("HUGE", "exceed the limits"),
    "too-many": ("MANY", "at most 2"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_images_get_400_and_the_server_keeps_serving(served, name):
    _, client = served
    url, message = BAD[name]
    if url == "HUGE":
        url = data_url(noise_image(17000, 1, seed=0))
    parts = (url,) if url != "MANY" else (data_url(noise_image(8, 8)),) * 3
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="vlm", messages=user(*parts, "hi"), max_tokens=2, temperature=0.0
        )
    assert info.value.status_code == 400 and message in info.value.message
    r = client.chat.completions.create(
        model="vlm", messages=user("still there?"), max_tokens=2, temperature=0.0
    )
    assert r.choices[0].finish_reason in ("length", "stop")
