"""An independent draft model: a small LM with the target's tokenizer.

Leviathan et al. 2023 (arXiv 2211.17192), section 2.3: the draft model samples
γ tokens autoregressively from q (the same warp as the target's p), keeping
q for the rejection sampler. At temperature 0 it drafts greedily (q one-hot).
With a draft vocabulary (FR-Spec, arXiv 2502.14856; ``mlxspec.drafters.vocab``) q lives on
the most frequent tokens plus those of the text so far, and the draft's LM head
multiplies only their rows.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..core.cache import check_rewindable, prefill, speculative_cache, trim
from ..core.sampling import SamplingParams, process_logits, sample
from ..core.taps import head_slice, logits_width, model_body
from .vocab import (
    DEFAULT_DRAFT_VOCAB,
    MIN_AUTO_VOCAB,
    draft_ids,
    load_ranking,
    sharegpt_ranking,
    tokenizer_digest,
)
from .base import AUTO, Draft, Drafter, DraftProfile, Plan
from .registry import DrafterContext, DrafterType, at_least, int_or_auto, option, register


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
        f"draft model tokenizer differs from the target's ({len(draft_vocab)} vs {len(target_vocab)} tokens; "
        f"first difference: {token!r} -> id {token_id}); use a draft model from the "
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
        vocab_ids: A draft vocabulary, token ids [N] (``vocab.draft_ids``), or ``None`` = every id.
            Drafts then come from these ids plus every id of the prompt and of the answer so far,
            through those rows of the draft's LM head only (``taps.head_slice``; FR-Spec).

    Raises:
        ValueError: if the draft model's cache cannot be rewound, or ``vocab_ids`` is given for a
            model whose head cannot be sliced (``check_sliceable``).
    """

    name = "draft"
    lazy = True
    #: It stops each round on its confidence (``Plan.keep_above``); survival: its confidence (largest q) at
    #: each
    #: position, multiplied along the chain.
    profile = DraftProfile(confidence=True, survival=True)

    def __init__(self, model: nn.Module, vocab_size: int, num_real_tokens: int,
                 vocab_ids: Sequence[int] | np.ndarray | None = None):
        self.model = model
        self.vocab_size = vocab_size
        self.num_real_tokens = min(num_real_tokens, vocab_size)
        self.cache = speculative_cache(model)
        check_rewindable(self.cache, role="draft")
        self._tokens: list[int] = []  # ids of the cached positions (a prefix of the committed tokens)
        self._num_cached = 0  # committed tokens in the cache
        self._round_start = 0  # committed tokens when the last round was proposed
        self._drafted: mx.array | None = None  # the last round's drafts [γ] (lazy)
        self._real = (
            mx.arange(vocab_size) < self.num_real_tokens if self.num_real_tokens < vocab_size else None
        )
        self.draft_vocab = None  # N of the draft vocabulary, or None (``describe`` says it)
        if vocab_ids is not None:
            base = np.unique(np.asarray(vocab_ids, dtype=np.int32))
            base = base[(base >= 0) & (base < self.num_real_tokens)]
            if base.size == 0:
                raise ValueError(f"the draft vocabulary holds no token id below {self.num_real_tokens}")
            check_sliceable(model, base)
            self._body, self._base_ids = model_body(model), mx.array(base)
            self._base_head = head_slice(model, self._base_ids)
            self._base_set = np.zeros(vocab_size, dtype=bool)
            self._base_set[base] = True
            self.draft_vocab = int(base.size)
            self._start_vocab()

    def fork(self) -> DraftModelDrafter:
        """The same draft model (weights shared) with a cache of its own."""
        twin = copy.copy(self)
        twin.cache = speculative_cache(self.model)
        twin._tokens, twin._num_cached, twin._round_start, twin._drafted = [], 0, 0, None
        if self.draft_vocab is not None:
            twin._start_vocab()
        return twin

    def vocab_summary(self) -> str | None:
        """``"draft vocabulary 32768 + 41 ids of the text"``, or ``None`` when it drafts from every id."""
        if self.draft_vocab is None:
            return None
        return f"draft vocabulary {self.draft_vocab} + {len(self._extra)} ids of the text"

    def _start_vocab(self) -> None:
        """The draft vocabulary back to its frequent ids (a new prompt brings its own tokens)."""
        self._in_vocab, self._extra, self._scanned = self._base_set.copy(), [], 0
        self._ids, self._extra_head = self._base_ids, None

    def _take_in(self, tokens: Sequence[int]) -> None:
        """Add the ids of ``tokens[self._scanned:]`` the draft vocabulary lacks (a few rows of the head)."""
        new = np.asarray(tokens[self._scanned :], dtype=np.int64)
        self._scanned = len(tokens)
        new = np.unique(new[(new >= 0) & (new < self.num_real_tokens)])
        new = new[~self._in_vocab[new]]
        if new.size:
            self._in_vocab[new] = True
            self._extra += new.tolist()
            extra = mx.array(self._extra, dtype=mx.int32)
            self._ids, self._extra_head = (
                mx.concatenate([self._base_ids, extra]),
                head_slice(self.model, extra),
            )

    def _logits(self, inputs: mx.array, last: int = 1) -> mx.array:
        """The draft's next-token logits after each of the last ``last`` of ``inputs`` [T], [last, V_target]:
        -inf outside the draft vocabulary."""
        return self.to_logits(self.forward(inputs[None], self.cache)[0, -last:])

    def forward(self, inputs: mx.array, cache: list) -> mx.array:
        """The draft model on ``inputs`` [B, T] through ``cache`` (its own, or a batch's): logits
        [B, T, V_draft], or with a draft vocabulary the final normalised hidden states [B, T, H];
        ``to_logits`` finishes a row."""
        if self.draft_vocab is None:
            return self.model(inputs, cache=cache)
        return self._body(inputs, cache=cache)

    def to_logits(self, out: mx.array) -> mx.array:
        """One row's ``forward`` output [T, V_draft or H] → next-token logits [T, V_target], -inf outside
        the draft vocabulary (its frequent ids plus this generation's own)."""
        if self.draft_vocab is None:
            return self._fit_vocab(out)
        h, last = out, out.shape[0]
        rows = self._base_head(h)
        if self._extra_head is not None:
            rows = mx.concatenate([rows, self._extra_head(h)], axis=-1)
        full = mx.full((last, self.vocab_size), -mx.inf, dtype=rows.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(self._ids[None], rows.shape), rows, axis=-1)

    def prefill(self, prompt, hidden=None):
        """Read ``prompt[:-1]`` into the cache, keeping the longest prefix the cache already holds."""
        if self.draft_vocab is not None:
            self._start_vocab()
            self._take_in(prompt)
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

    def propose(self, history, num_draft_tokens, sampling: SamplingParams, plan: Plan | None = None):
        """Draft up to ``num_draft_tokens`` tokens, one forward each.

        With ``plan.keep_above``, after each token k but the last it drafts another only while the product of
        the confidences (largest q) of the k tokens exceeds ``keep_above[k - 1]``. It costs a host read per
        token; the decision never looks at a token it would decide about, so the output stays exact
        (docs/acceptance.md 3.3).
        """
        keep_above = plan.keep_above if plan is not None else None
        processors = sampling.processors()
        inputs = mx.array(self.unseen(history), dtype=mx.int32)
        context = mx.array(history, dtype=mx.int32)
        tokens, logprobs, confidence = [], [], []
        log_survival = 0.0
        for k in range(1, num_draft_tokens + 1):
            logits = self._logits(inputs)
            if processors:
                logits = process_logits(logits, mx.concatenate([context, *tokens]), processors)
            token, token_logprobs = sample(logits, sampling)
            mx.async_eval(token)
            tokens.append(token)
            logprobs.append(token_logprobs)
            confidence.append(log_confidence(logits if token_logprobs is None else token_logprobs))
            inputs = token
            if keep_above is not None and k < num_draft_tokens:
                log_survival += confidence[-1].item()
                if math.exp(log_survival) <= keep_above[k - 1]:
                    break
        self.proposed(history, mx.concatenate(tokens) if tokens else None)
        if not tokens:
            return Draft.empty()
        q = None if sampling.greedy else mx.concatenate(logprobs, axis=0)
        survival = mx.exp(mx.cumsum(mx.concatenate(confidence)))  # lazy: only scheduling reads it
        return Draft.chain(mx.concatenate(tokens), q, survival)

    def unseen(self, history: list[int]) -> list[int]:
        """The committed tokens of ``history`` its cache lacks, to feed before drafting (the root; also the
        last draft when all were accepted; more after plain rounds), once ``history``'s ids are in the draft
        vocabulary."""
        if self.draft_vocab is not None:
            self._take_in(history)
        return history[self._num_cached :]

    def proposed(self, history: list[int], drafted: mx.array | None) -> None:
        """Note a round's proposal: the cache now holds ``history`` and ``drafted`` [γ] int32 (lazy) follows
        it; ``commit`` keeps what the target accepted (``engine.batch_draft`` drafts rows together and tells
        each fork this)."""
        self._tokens += history[len(self._tokens) :]
        self._round_start = len(history)
        self._drafted = drafted

    def describe(self):
        return f"draft vocabulary of {self.draft_vocab} ids" if self.draft_vocab is not None else None

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


def log_confidence(logits: mx.array) -> mx.array:
    """log max_x q(x) of each row [T] (greedy: under the unwarped softmax). Not q of the drawn token:
    a sampled position's survival estimate must not depend on its own token (docs/acceptance.md 3.2)."""
    logits = logits.astype(mx.float32)
    return logits.max(axis=-1) - mx.logsumexp(logits, axis=-1)


#: Config fields of mlx-lm models whose logits are not the head applied to the body's output.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling")


def check_sliceable(model: nn.Module, ids: np.ndarray) -> None:
    """Refuse a draft vocabulary for a model whose logits are not its LM head applied to ``model.model``'s
    output (a soft-capped or scaled head, a head with a bias): checked on its config and on one forward.

    Raises:
        ValueError: naming the reason and the fix (``--draft-vocab 0``).
    """
    args = getattr(model, "args", None)
    transforms = [name for name in _LOGIT_TRANSFORMS if getattr(args, name, None) not in (None, 1, 1.0)]
    probe = mx.array(ids[:: max(1, ids.size // 64)][:64], dtype=mx.int32)
    head = head_slice(model, probe) if not transforms else None
    if head is not None:
        x = mx.array([[int(i) for i in ids[:4]]], dtype=mx.int32)
        body = model_body(model)
        full, sliced = model(x)[0, -1, probe].astype(mx.float32), head(body(x)[0, -1]).astype(mx.float32)
        scale = 1.0 + float(mx.abs(full).max())
        if float(mx.abs(full - sliced).max()) <= (1e-4 if full.dtype == mx.float32 else 1e-2) * scale:
            return
    why = (
        f"its logits go through {', '.join(transforms)}"
        if transforms
        else "its logits are not its LM head applied to its last hidden state"
    )
    raise ValueError(f"the draft model cannot draft from a draft vocabulary: {why}; pass --draft-vocab 0 "
                     "(the whole vocabulary)")


@dataclass(frozen=True)
class DraftOptions:
    """``--drafter draft``: the draft model itself is ``--draft-model`` (and ``--draft-dtype``),
    since mlx-lm's own speculative decoding in ``mlxspec bench`` uses it too.

    Raises:
        ValueError: ``vocab`` < 0.
    """

    vocab: int | str = option(
        AUTO,
        "draft from the N most frequent tokens of the tokenizer plus every token of the prompt and answer so "
        "far, multiplying only their rows of the draft's LM head (FR-Spec); 0 = the whole vocabulary; "
        f"auto = {DEFAULT_DRAFT_VOCAB} when the vocabulary has at least {MIN_AUTO_VOCAB} tokens and a "
        "ranking for its tokenizer ships or was counted before, else 0; a number counts one over ShareGPT on "
        "first use",
        parse=int_or_auto,
    )

    def __post_init__(self):
        at_least(0, self.vocab, "--draft-vocab")


def _vocab_ids(
    options: DraftOptions, context: DrafterContext, vocab_size: int, num_real: int
) -> np.ndarray | None:
    """The draft vocabulary ``options.vocab`` asks for, or ``None`` (the whole vocabulary)."""
    if options.vocab == 0:
        return None
    if options.vocab == AUTO:
        if num_real < MIN_AUTO_VOCAB:
            return None
        ranking = load_ranking(tokenizer_digest(context.tokenizer))
        if ranking is None:
            return None
        size = DEFAULT_DRAFT_VOCAB
    else:
        size = options.vocab
        if size >= num_real:
            raise ValueError(
                f"--draft-vocab {size} is not below the vocabulary's {num_real} tokens, so it would "
                "draft from the whole vocabulary; pass --draft-vocab 0 for that, or a smaller number"
            )
        ranking = sharegpt_ranking(context.tokenizer, vocab_size, context.on_measure)
    return draft_ids(ranking, size, num_real)


#: The Python side of the missing-draft-model advice (the chat leaves it out).
PYTHON_DRAFT_ADVICE = " (in Python: make_drafter(..., draft_model=..., draft_tokenizer=...))"


def _with_shipped_draft(context: DrafterContext) -> DrafterContext:
    """``context`` with the draft model shipped for its target (``models/draft/*/``, matched by the target's
    card as heads are, so ``make_drafter("draft", target, tokenizer)`` works in Python as ``--drafter draft``
    does).

    Raises:
        ValueError: no target, or no draft model ships for it.
    """
    from ..loading.assets import PUBLISHED
    from ..loading.identity import shipped_for
    from ..loading.models import load

    path = shipped_for("draft", context.target) if context.target is not None else None
    if path is None:
        raise ValueError(
            f"--drafter draft needs a draft model: pass --draft-model PATH_OR_REPO ({PUBLISHED['draft']}); "
            f"none ships for this model{PYTHON_DRAFT_ADVICE}"
        )
    model, tokenizer = load(str(path))
    return dataclasses.replace(context, draft_model=model, draft_tokenizer=tokenizer)


def build(options: DraftOptions, context: DrafterContext) -> DraftModelDrafter:
    """Without a draft model in ``context``, the one shipped for the target. Raises ``ValueError`` without a
    draft model (none given, none ships), with one whose tokenizer differs from the target's, with a draft
    vocabulary its head cannot take (``check_sliceable``) or one not below the vocabulary's size."""
    if context.draft_model is None:
        context = _with_shipped_draft(context)
    if context.draft_tokenizer is not None:
        check_same_tokenizer(context.tokenizer, context.draft_tokenizer)
    vocab_size, num_real = logits_width(context.target), len(context.tokenizer)
    ids = _vocab_ids(options, context, vocab_size, min(num_real, vocab_size))
    return DraftModelDrafter(context.draft_model, vocab_size, num_real, vocab_ids=ids)


DRAFTER = register(DrafterType("draft", DraftOptions, build,
                               "an independent small LM with the target's tokenizer (Leviathan et al. 2023)",
                               order=10, needs_draft_model=True))
