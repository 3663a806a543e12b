"""An independent draft model: a small LM with the target's tokenizer.

Leviathan et al. 2023 (arXiv 2211.17192), section 2.3: the draft model samples
γ tokens autoregressively from q (the same warp as the target's p), keeping
q for the rejection sampler. At temperature 0 it drafts greedily (q one-hot).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..cache import check_rewindable, prefill, speculative_cache, trim
from ..sampling import SamplingParams, process_logits, sample
from ..taps import logits_width
from .base import Draft, Drafter
from .registry import DrafterContext, DrafterType, register


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """Refuse a draft model whose tokenizer differs from the target's.

    Vocabularies must map the same strings to the same ids; sizes may differ
    only by padding rows of the embedding, which is checked separately.

    Raises:
        ValueError: naming the first token that differs.
    """
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = sorted(
        (set(target_vocab.items()) ^ set(draft_vocab.items())), key=lambda item: item[1]
    )
    token, token_id = differing[0]
    raise ValueError(
        f"draft model tokenizer differs from the target's ({len(draft_vocab)} vs {len(target_vocab)} "
        f"tokens; first difference: {token!r} -> id {token_id}); use a draft model from the "
        "same family as the target, or --drafter ngram"
    )


class DraftModelDrafter(Drafter):
    """Drafts with a small mlx-lm model that shares the target's tokenizer.

    Its KV cache holds a prefix of the committed tokens, whose ids it keeps in a list of
    its own; each round feeds the committed tokens it has not seen (the root, plus the
    last draft when every draft was accepted), then drafts one token per forward. A new
    prompt that starts with what the cache holds (the next turn of a chat) reads only
    the rest.

    Args:
        model: The draft model (any mlx-lm model with a trimmable KV cache).
        vocab_size: Target logits width V; draft logits are cut or ``-inf``-padded to it.
        num_real_tokens: Size of the tokenizer's vocabulary; ids at or above it are
            embedding padding and are never drafted.

    Raises:
        ValueError: if the draft model's cache cannot be rewound.
    """

    name = "draft"
    lazy = True
    reports_survival = True  # the draft's confidence (largest q) at each position, multiplied along the chain
    stops_early = True  # γ auto stops a round where the next token would not pay (costmodel.AutoGamma.keep_drafting)

    def __init__(self, model: nn.Module, vocab_size: int, num_real_tokens: int):
        self.model = model
        self.vocab_size = vocab_size
        self.num_real_tokens = min(num_real_tokens, vocab_size)
        self.cache = speculative_cache(model)
        check_rewindable(self.cache, role="draft")
        self._tokens: list[int] = []  # ids of the cached positions (a prefix of the committed tokens)
        self._num_cached = 0  # committed tokens in the cache
        self._round_start = 0  # committed tokens when the last round was proposed
        self._drafted: mx.array | None = None  # the last round's drafts [γ] (lazy)
        self._real = mx.arange(vocab_size) < self.num_real_tokens if self.num_real_tokens < vocab_size else None

    def prefill(self, prompt, hidden=None):
        """Read ``prompt[:-1]`` into the cache, keeping the longest prefix the cache already holds."""
        context = list(prompt[:-1])
        keep = 0
        for cached, token in zip(self._tokens, context):
            if cached != token:
                break
            keep += 1
        trim(self.cache, self.cache[0].offset - keep)
        prefill(self.model, self.cache, context[keep:])
        self._tokens = context
        self._num_cached = self._round_start = len(context)
        self.prefilled = len(context) - keep

    def _fit_vocab(self, logits: mx.array) -> mx.array:
        """[T, V_draft] → [T, V_target], padding ids masked."""
        V = self.vocab_size
        logits = logits[:, :V]
        if logits.shape[1] < V:
            pad = mx.full((logits.shape[0], V - logits.shape[1]), -mx.inf, dtype=logits.dtype)
            logits = mx.concatenate([logits, pad], axis=1)
        if self._real is not None:
            logits = mx.where(self._real, logits, -mx.inf)
        return logits

    def propose(self, history, num_draft_tokens, sampling: SamplingParams,
                keep_drafting: Callable[[int, float], bool] | None = None):
        """Draft up to ``num_draft_tokens`` tokens, one forward each.

        ``keep_drafting(k, survival)``, if given, is asked after each token but the last whether to draft
        another: k tokens so far, ``survival`` the product of their confidences (largest q). It costs a host
        read per token; the decision never looks at a token it would decide about, so the output stays exact
        (docs/acceptance.md 3.3).
        """
        processors = sampling.processors()
        context = mx.array(history, dtype=mx.int32)
        inputs = context[self._num_cached :]
        tokens, logprobs, confidence = [], [], []
        log_survival = 0.0
        for k in range(1, num_draft_tokens + 1):
            logits = self._fit_vocab(self.model(inputs[None], cache=self.cache)[0, -1:])
            if processors:
                logits = process_logits(logits, mx.concatenate([context, *tokens]), processors)
            token, token_logprobs = sample(logits, sampling)
            mx.async_eval(token)
            tokens.append(token)
            logprobs.append(token_logprobs)
            confidence.append(_confidence(logits if token_logprobs is None else token_logprobs))
            inputs = token
            if keep_drafting is not None and k < num_draft_tokens:
                log_survival += confidence[-1].item()
                if not keep_drafting(k, math.exp(log_survival)):
                    break
        self._tokens += history[len(self._tokens) :]
        self._round_start = len(history)
        self._drafted = mx.concatenate(tokens) if tokens else None
        if not tokens:
            return Draft.empty()
        q = None if sampling.greedy else mx.concatenate(logprobs, axis=0)
        survival = mx.exp(mx.cumsum(mx.concatenate(confidence)))  # lazy: only scheduling reads it
        return Draft.chain(mx.concatenate(tokens), q, survival)

    def commit(self, num_committed, accepted, hidden=None):
        # The cache holds history + drafts[:K - 1]; what the target kept of it stays,
        # except the newest committed token (the next root).
        offset = self.cache[0].offset
        valid = min(offset, self._round_start + len(accepted), num_committed - 1)
        trim(self.cache, offset - valid)
        del self._tokens[valid:]
        if valid > len(self._tokens):  # accepted drafts it fed while drafting (evaluated by the round's sync)
            self._tokens += self._drafted.tolist()[: valid - len(self._tokens)]
        self._num_cached = valid
        self._round_start = valid  # a round without a propose (plain) keeps what is cached


def _confidence(logits: mx.array) -> mx.array:
    """log max_x q(x) of each row [T] (greedy: under the unwarped softmax). Not q of the drawn token:
    a sampled position's survival estimate must not depend on its own token (docs/acceptance.md 3.2)."""
    logits = logits.astype(mx.float32)
    return logits.max(axis=-1) - mx.logsumexp(logits, axis=-1)


@dataclass(frozen=True)
class DraftOptions:
    """``--drafter draft``: the draft model itself is ``--draft-model`` (and ``--draft-dtype``),
    since mlx-lm's own speculative decoding in ``mlxspec bench`` uses it too."""


def build(options: DraftOptions, context: DrafterContext) -> DraftModelDrafter:
    """Raises ``ValueError`` without a draft model or with one whose tokenizer differs from the target's."""
    if context.draft_model is None:
        raise ValueError("--drafter draft needs a draft model: pass --draft-model PATH_OR_REPO")
    if context.draft_tokenizer is not None:
        check_same_tokenizer(context.tokenizer, context.draft_tokenizer)
    return DraftModelDrafter(context.draft_model, logits_width(context.target), len(context.tokenizer))


DRAFTER = register(DrafterType("draft", DraftOptions, build,
                               "an independent small LM with the target's tokenizer (Leviathan et al. 2023)",
                               order=10))
