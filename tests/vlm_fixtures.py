"""Writers of tiny random-weight Qwen2.5-VL checkpoints (transformers is the oracle).

`write_tiny_vlm` saves `Qwen2_5_VLForConditionalGeneration` with tiny vision and text configs
through `save_pretrained` (hub tensor names `visual.*`, `model.*`, `lm_head`), a byte-level
tokenizer with the Qwen2-VL special tokens and chat template, and a preprocessor config; the
"flat" layout rewrites config.json the way hub checkpoints are (text fields at the top level,
`rope_scaling: {type: mrope, mrope_section}`).
`hf_processor` builds transformers' processor from its parts (PIL backend, no torchvision).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# ids: 256 byte tokens, then the specials in this order
IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 258, 259, 260, 261, 262
VOCAB = 264

# The Qwen2-VL chat template (hub `chat_template.json`), trimmed of video handling.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=56,  # 2 x 2 merged tokens per window
    fullatt_block_indexes=[1],
    initializer_range=0.2,  # large random weights: outputs depend on the image and the text
)
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=IM_END,
    initializer_range=0.2,
)
MROPE_SECTION = [4, 2, 2]  # head_dim 16: 8 frequencies
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64


def write_tokenizer(out: Path):
    """A byte-level BPE tokenizer (no merges) with the Qwen2-VL specials and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    assert fast.convert_tokens_to_ids("<|image_pad|>") == IMAGE_PAD
    return fast


def write_tiny_vlm(out: Path, layout: str = "nested", seed: int = 0):
    """Save a random-weight tiny Qwen2.5-VL (layout "nested" = transformers 5, "flat" = hub)."""
    import transformers

    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            TEXT,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": MROPE_SECTION,
                "rope_theta": 10000.0,
            },
        ),
        vision_config=dict(VISION, out_hidden_size=TEXT["hidden_size"]),
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    out = Path(out)
    model.save_pretrained(str(out))
    write_tokenizer(out)
    hf_image_processor().save_pretrained(str(out))
    if layout == "flat":
        flatten_config(out / "config.json")
    return out


def vlm_with_random_draft(root: Path, options):
    """(target dir, random DSpark draft dir (block 5, 1 layer), ``LLM`` of the target)."""
    from dspark_fixtures import make_random_draft

    from edgebuild.runtime.llm import LLM

    target = write_tiny_vlm(root / "vlm")
    draft = make_random_draft(root / "draft", target, block_size=5, num_layers=1)
    return target, draft, LLM(target, options=options)


def flatten_config(path: Path) -> None:
    """Rewrite a nested transformers-5 VLM config.json in the flat hub layout."""
    cfg = json.loads(path.read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    for key in ("model_type", "layer_types"):
        text.pop(key, None)
    cfg.update(text)
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    path.write_text(json.dumps(cfg, indent=2))


def hf_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def hf_processor(model_dir: Path):
    """transformers' Qwen2.5-VL processor from its parts (PIL image backend, no video)."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        """Accepts video_processor=None (the video processor needs torchvision)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return ImageOnlyProcessor(
        image_processor=hf_image_processor(),
        tokenizer=tok,
        video_processor=None,
        chat_template=CHAT_TEMPLATE,
    )


def hf_model(model_dir: Path):
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(model_dir), dtype=torch.float32
    )
    return model.eval()


def noise_image(width: int = 90, height: int = 50, seed: int = 0, mode: str = "RGB"):
    """A random-noise PIL image."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    array = (rng.rand(height, width, 3) * 255).astype(np.uint8)
    return Image.fromarray(array).convert(mode)


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
