"""The torch (CPU) DSpark draft backend: context cache, block pass and the Markov walk.

The walk (spec/draft-checkpoint-formats.md section 3, "Drafting" and "Top-k pruning"): for
k = 0..n-1, take the top-k candidates of the base logits z_k, add the Markov bias of the
previous token (anchor for k = 0) on those candidates, and draw x_k from the resulting
distribution q_k (argmax when greedy, softmax(scores / T) otherwise); q_k is zero outside the
candidates, which keeps rejection sampling exact. `draft_top_k` 0 uses the full vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from edgebuild.checkpoint.config import ModelConfig
from edgebuild.checkpoint.pairing import PairedSources
from edgebuild.checkpoint.source import COMPONENT, TARGET, WeightSource
from edgebuild.models.dspark import DSparkDraft, check_draft
from edgebuild.runtime.backend import Proposal
from edgebuild.runtime.kv_cache import PageAllocator, Sequence, allocate_pools
from edgebuild.runtime.sampling import SamplingParams
from edgebuild.runtime.speculative import SpeculativeConfig
from edgebuild.runtime.torch_backend import make_batch, pad_rows

log = logging.getLogger("edgebuild.runtime")


class TorchDraft:
    """DraftBackend for a :class:`DSparkDraft` on the CPU.

    Args:
        model: the loaded draft (head and embedding already resolved).
        max_kv_rows: context-cache capacity in rows across sequences.
        page_size: rows per page.
        top_k: candidates per position for the Markov walk (0 = full vocabulary).
    """

    def __init__(self, model: DSparkDraft, max_kv_rows: int, page_size: int, top_k: int = 16):
        cfg = model.config
        self.model, self.config = model, cfg
        self.block_size = cfg.block_size
        self.target_layer_ids = tuple(cfg.target_layer_ids)
        self.top_k = top_k
        # + one block per page budget: block rows are reserved (never written) during a pass
        num_pages = -(-max_kv_rows // page_size) + 4 * (-(-cfg.block_size // page_size))
        self.allocator = PageAllocator(num_pages, page_size)
        dtype = next(model.parameters()).dtype
        self.pools = allocate_pools(
            cfg.num_hidden_layers,
            num_pages,
            page_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype,
        )

    def new_sequence(self) -> Sequence:
        return self.allocator.new_sequence()

    def free(self, seq: Sequence) -> None:
        self.allocator.free(seq)

    @torch.inference_mode()
    def update_context(self, seqs: list[Sequence], features: list[torch.Tensor]) -> None:
        """Append target features [m_b, n_t * d] of sequence b's new context rows."""
        lengths = [int(f.shape[0]) for f in features]
        batch = make_batch(self.allocator, seqs, lengths)
        self.model.context_update(pad_rows(features, 0), self.pools, batch)
        for s, n in zip(seqs, lengths, strict=True):
            self.allocator.advance(s, n)

    @torch.inference_mode()
    def propose(
        self,
        seqs: list[Sequence],
        anchors: list[int],
        num_tokens: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> list[Proposal]:
        """One block pass at positions s..s+B-1 (s = context length), then the Markov walk."""
        bs = self.block_size
        batch = make_batch(self.allocator, seqs, [bs] * len(seqs))
        try:
            ids = self.model.block_input_ids(torch.tensor(anchors))
            h = self.model.block_forward(ids, self.pools, batch)  # [B, Bs, d]
        finally:
            for s in seqs:  # block K/V never persist: release the reserved pages
                self.allocator.truncate(s, s.length)
        base = self.model.base_logits(h)  # fp32 [B, Bs, V]
        return self.walk(h, base, anchors, num_tokens, params, generators)

    def walk(
        self,
        h: torch.Tensor,  # [B, Bs, d] post-norm draft hidden
        base: torch.Tensor,  # fp32 [B, Bs, V] base logits
        anchors: list[int],
        num_tokens: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> list[Proposal]:
        """Left-to-right Markov walk over each row's top-k candidates (module docstring)."""
        model, vocab = self.model, base.shape[-1]
        n_max = max(num_tokens, default=0)
        batch = len(anchors)
        prev = torch.tensor(anchors, dtype=torch.long)
        state = None
        q = torch.zeros(batch, n_max, vocab)
        conf = torch.ones(batch, n_max)
        tokens = torch.zeros(batch, n_max, dtype=torch.long)
        k_cand = self.top_k if 0 < self.top_k < vocab else vocab
        for k in range(n_max):
            z = base[:, k]  # [B, V]
            cand = z.topk(k_cand, dim=-1).indices if k_cand < vocab else None  # [B, K]
            scores = z if cand is None else z.gather(1, cand)
            if model.markov_head is not None:
                if cand is None:
                    bias, new_state = model.markov_head.step(prev, h[:, k], state)
                else:
                    bias, new_state = model.markov_head.candidate_bias(prev, h[:, k], state, cand)
                scores = scores + bias
            else:
                new_state = None
            if model.confidence_head is not None:
                conf[:, k] = model.confidence(h[:, k], prev)
            for b in range(batch):
                local = _draw(scores[b], params[b], generators[b])  # [K] probs, chosen index
                probs, choice = local
                ids = torch.arange(vocab) if cand is None else cand[b]
                q[b, k].index_copy_(0, ids, probs)
                tokens[b, k] = ids[choice]
            prev, state = tokens[:, k].clone(), new_state
        return [
            Proposal(tokens[b, :n].tolist(), q[b, :n], conf[b, :n])
            for b, n in enumerate(num_tokens)
        ]


def _draw(
    scores: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, int]:
    """q over the candidates (one-hot when greedy) and the chosen candidate index."""
    if params.greedy:
        choice = int(scores.argmax())
        return torch.nn.functional.one_hot(torch.tensor(choice), scores.shape[0]).float(), choice
    probs = torch.softmax(scores.float() / params.temperature, dim=-1)
    return probs, int(torch.multinomial(probs, 1, generator=generator))


def prepare_draft(
    spec: SpeculativeConfig, target_source: WeightSource
) -> Callable[..., TorchDraft]:
    """Validate a draft against its target before loading anything large.

    Returns a loader `loader(options) -> TorchDraft`.

    Raises:
        ConfigError / PairingError / CheckpointError: bad speculative config, a draft that
            does not fit its target (hidden, vocab, taps, mask id, heads), or bad files.
    """
    draft_source = WeightSource(spec.model, COMPONENT)
    pair = PairedSources(draft_source, WeightSource(target_source.path, TARGET))
    target_cfg = ModelConfig.from_dict(target_source.config, str(target_source.config_path))
    checked = check_draft(pair, target_cfg)  # the same checks as `edgebuild inspect --draft`
    spec.check_block(checked.config.block_size, str(draft_source.config_path))
    head, embed = checked.lm_head, checked.embed_tokens
    log.info(
        "draft %s: lm_head from %s (%s), embed_tokens from %s",
        spec.model,
        head.checkpoint_source,
        head.format,
        embed.checkpoint_source,
    )

    def load(options) -> TorchDraft:
        model = DSparkDraft.from_source(
            draft_source,
            target_cfg,
            head.value,
            embed.value,
            options.dtype,
            lm_head_origin=f"{head.file}: {head.name}",
            embed_origin=f"{embed.file}: {embed.name}",
        )
        return TorchDraft(model, options.max_kv_rows, options.page_size, spec.draft_top_k)

    return load
