"""DSpark speculative decoding after a multimodal prefill is lossless.

The draft is paired to the VLM's language model (its config written from `text_config`);
its context starts from the target taps of every prefill row, image rows included. Oracles:
target-only greedy decoding of the same requests (random draft: mostly rejections; a rigged
draft proposing the target's own continuation: everything accepted, so verify rows at
positions slot + rope_delta must reproduce decode exactly), and the target's own taps.
"""

from __future__ import annotations

import pytest
import torch
from serve_fixtures import torch_threads
from vlm_fixtures import noise_image, vlm_with_random_draft

from edgebuild.runtime.backend import Proposal
from edgebuild.runtime.decoding import DSparkDecoder, RequestState, run_to_completion
from edgebuild.runtime.kv_cache import PageAllocator
from edgebuild.runtime.llm import LLM, RuntimeOptions
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.torch_backend import TorchTarget

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
OPTIONS = RuntimeOptions(max_kv_rows=4096, page_size=16)
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the CPU here is shared, and oversubscription is very slow."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return vlm_with_random_draft(tmp_path_factory.mktemp("vlm-dspark"), OPTIONS)


def requests(llm):
    """An image request, a two-image request and a text request (ids, images)."""
    one = llm.process_images([noise_image(200, 130, seed=1)])
    two = llm.process_images([noise_image(60, 100, seed=2), noise_image(90, 50, seed=3)])
    img = {"type": "image_url", "image_url": {"url": "data:,"}}
    return [
        (llm.encode_messages([{"role": "user", "content": [img, {"type": "text", "text": "Hi"}]}], one), one),
        (llm.encode_messages([{"role": "user", "content": [img, {"type": "text", "text": "vs"}, img]}], two), two),
        (llm.encode_messages([{"role": "user", "content": "text only"}]), None),
    ]  # fmt: skip


def run(llm, reqs):
    states = llm.generate_ids([r[0] for r in reqs], GREEDY, images=[r[1] for r in reqs])
    return [s.output_ids for s in states], states


@pytest.mark.parametrize("n", [2, 4])
def test_random_draft_outputs_with_images_equal_target_only(setup, n):
    target, draft, base = setup
    spec = LLM(
        target,
        speculative={
            "method": "dspark",
            "model": str(draft),
            "num_speculative_tokens": n,
            "confidence_scheduling": False,
        },  # every step verifies n image-aware rows
        options=OPTIONS,
    )
    reqs = requests(base)
    expected, _ = run(base, reqs)
    got, states = run(spec, reqs)
    assert got == expected
    assert all(s.metrics.steps > 0 for s in states)
    assert len({tuple(o) for o in expected}) == 3  # the prompts (and images) matter


class RiggedDraft:
    """Proposes the target-only continuation (from `full[seq_id]`): every draft is accepted."""

    block_size = 5

    def __init__(self, taps, vocab):
        self.target_layer_ids = taps
        self.alloc = PageAllocator(1024, 16)
        self.full: dict[int, list[int]] = {}
        self.vocab = vocab
        self.features: list[torch.Tensor] = []

    def new_sequence(self):
        return self.alloc.new_sequence()

    def free(self, seq):
        self.alloc.free(seq)

    def update_context(self, seqs, features):
        for s, f in zip(seqs, features, strict=True):
            self.features.append(f.clone())
            self.alloc.reserve(s, f.shape[0])
            self.alloc.advance(s, f.shape[0])

    def propose(self, seqs, anchors, num_tokens, params, generators):
        out = []
        for s, n in zip(seqs, num_tokens, strict=True):
            toks = self.full[s.seq_id][s.length + 1 : s.length + 1 + n]
            toks = toks + [0] * (n - len(toks))
            q = torch.nn.functional.one_hot(torch.tensor(toks, dtype=torch.long), self.vocab)
            out.append(Proposal(toks, q.float().reshape(n, self.vocab), torch.ones(n)))
        return out


def test_rigged_draft_accepts_everything_and_context_starts_from_the_prefill_taps(setup):
    _, _, base = setup
    ids, images = requests(base)[0]
    expected = base.generate_ids([ids], GREEDY, images=[images])[0].output_ids
    taps = (0, 2)
    draft = RiggedDraft(taps, base.config.vocab_size)
    target = TorchTarget(base.target_model, max_kv_rows=2048, page_size=16)
    decoder = DSparkDecoder(target, draft, 4)
    mm = base.vision.prepare(ids, images)
    st = RequestState.create("r0", ids, GREEDY)
    st.prompt_images = mm
    decoder.start(st)
    draft.full[st.draft_seq.seq_id] = list(ids) + expected
    run_to_completion(decoder, [st])
    assert st.output_ids == expected
    assert st.metrics.steps > 0 and sum(st.metrics.accepted_at) == sum(st.metrics.proposed_at)
    # the draft's first context = target taps of every prompt row (image rows included)
    ref_target = TorchTarget(base.target_model, max_kv_rows=2048, page_size=16)
    seq = ref_target.new_sequence()
    ref = ref_target.forward([seq], [torch.tensor(ids)], [[len(ids) - 1]], taps, [mm]).taps[0]
    assert draft.features[0].shape == (len(ids), 2 * base.config.hidden_size)
    assert torch.equal(draft.features[0], ref)
