"""A tiny random-weight Qwen2.5-VL through the runtime matches transformers with images.

Both config layouts (transformers-5 nested `text_config` and the flat hub layout): the prompt
ids equal those of transformers' processor (image pads expanded), prefill logits of every row
equal `Qwen2_5_VLForConditionalGeneration` (given `mm_token_type_ids`, so transformers uses
3-axis positions) within 1e-4 in fp32, and greedy generation is identical token for token,
also when image and text requests share a batch.
"""

from __future__ import annotations

import pytest
import torch
from serve_fixtures import torch_threads
from vlm_fixtures import hf_model, hf_processor, noise_image, write_tiny_vlm

from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.multimodal import ImageInputError
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.torch_backend import TorchTarget

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the CPU here is shared, and oversubscription is very slow."""
    with torch_threads(1):
        yield


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["nested", "flat"])
def vlm(request, tmp_path_factory):
    path = write_tiny_vlm(tmp_path_factory.mktemp("vlm") / request.param, layout=request.param)
    llm = LLM(path, options=RuntimeOptions(max_kv_rows=2048, page_size=16))
    return llm, hf_model(path), hf_processor(path)


def messages(*parts):
    """One user message; "IMG" is an image part, other strings text parts."""
    content = [
        {"type": "image_url", "image_url": {"url": "data:,"}}
        if p == "IMG"
        else {"type": "text", "text": p}
        for p in parts
    ]
    return [{"role": "user", "content": content}]


def hf_inputs(processor, parts, images):
    hf_msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image"} if p == "IMG" else {"type": "text", "text": p} for p in parts
            ],
        }
    ]
    text = processor.apply_chat_template(hf_msgs, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=images or None, return_tensors="pt")


CASES = {
    "one-image": (("IMG", "What is in the picture?"), [(200, 130)]),
    "two-images": (("Compare", "IMG", "with", "IMG"), [(84, 56), (150, 230)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_logits_of_every_row_match_transformers(vlm, case):
    llm, hf, processor = vlm
    parts, sizes = CASES[case]
    pil = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    images = llm.process_images(pil)
    ids = llm.encode_messages(messages(*parts), images)
    inputs = hf_inputs(processor, parts, pil)
    assert ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        ref = hf(**inputs).logits[0]
        flat_positions = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}
        ref_1d = hf(**flat_positions).logits[0]  # transformers' silent 1-D fallback
    mm = llm.vision.prepare(ids, images)
    target = TorchTarget(llm.target_model, max_kv_rows=1024, page_size=16)
    seq = target.new_sequence()
    out = target.forward([seq], [torch.tensor(ids)], [list(range(len(ids)))], (), [mm])
    assert (out.logits[0] - ref).abs().max() <= TOL
    assert (out.logits[0] - ref_1d).abs().max() > 1e-2  # the positions matter


def test_greedy_generation_with_images_equals_transformers(vlm):
    llm, hf, processor = vlm
    parts = ("Describe", "IMG", "briefly.")
    pil = [noise_image(170, 110, seed=7)]
    inputs = hf_inputs(processor, parts, pil)
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    images = llm.process_images(pil)
    ids = llm.encode_messages(messages(*parts), images)
    state = llm.generate_ids([ids], GREEDY, images=[images])[0]
    assert state.output_ids == ref[0, n:].tolist()


def test_image_and_text_requests_in_one_batch_decode_as_if_alone(vlm):
    llm = vlm[0]
    pil = [noise_image(120, 90, seed=11)]
    images = llm.process_images(pil)
    with_image = llm.encode_messages(messages("IMG", "What?"), images)
    text = llm.encode_messages([{"role": "user", "content": "Just text, a bit longer."}])
    alone = [
        llm.generate_ids([with_image], GREEDY, images=[images])[0].output_ids,
        llm.generate_ids([text], GREEDY)[0].output_ids,
    ]
    batched = llm.generate_ids([with_image, text], GREEDY, images=[images, None])
    assert [s.output_ids for s in batched] == alone
    assert alone[0] != alone[1]


def test_image_placeholders_and_images_must_match(vlm):
    llm = vlm[0]
    images = llm.process_images([noise_image(60, 60)])
    with pytest.raises(ImageInputError, match="1 image content parts but 0 images"):
        llm.encode_messages(messages("IMG", "hi"))
    ids = llm.encode_messages(messages("IMG", "hi"), images)
    with pytest.raises(ImageInputError, match="image pad tokens"):
        llm.new_request(ids, GREEDY)  # the images were not passed along
    with pytest.raises(ImageInputError, match="at most"):
        llm.process_images([noise_image(30, 30)] * (llm.options.max_images + 1))
