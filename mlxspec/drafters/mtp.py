"""MTP drafting: the target's own multi-token-prediction layers (or a module trained here) draft a chain.

DeepSeek-V3 technical report (arXiv 2412.19437), section 2.2, used for speculative decoding as in its
section 5.4.3. The module (``mlxspec.heads.mtp``) reads the target's final normalised hidden state at
position t, taken from the verify forward that the round makes anyway (``taps.HiddenTap``), and the
embedding of token t + 1, and gives q over token t + 2; chained on its own output it drafts depth
1-3. Drafts are sampled from q (argmax at temperature 0) and verified with the exact rule for
sampled chains (docs/acceptance.md 2.1), so the output is distributed as the target's at any
temperature (docs/heads.md 7.3). A module with a draft vocabulary (``draft_vocab.safetensors``, written
by ``mlxspec train mtp``) samples from those ids' rows of the shared head only: on a small target
with a large vocabulary the head is most of a draft step (docs/heads.md 7.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..loading.assets import PUBLISHED, shipped
from ..heads.mtp import TRAIN_COMMAND, MTPStack, has_mtp, load_mtp
from ..core.sampling import SamplingParams, sample
from ..core.taps import head_slice, logits_width, model_body, output_head
from .base import Draft, Drafter, DraftProfile, feature_prefill, pending_features
from .registry import DrafterContext, DrafterType, at_least, option, register

#: Chain depth when neither the option nor the checkpoint's ``draft_depth`` sets one.
DEFAULT_DEPTH = 2


class MTPDrafter(Drafter):
    """Drafts a chain of ``depth`` tokens with the first MTP module, fed its own output after step 1.

    The module's KV cache holds committed positions only: each round it takes in the pairs
    (feature of committed position m, token m + 1) it has not seen, drafts, and trims its
    speculative entries away (as EAGLE's cache, docs/heads.md 4.6). Everything stays lazy until
    the round's one sync.

    Args:
        stack: Loaded MTP modules (``heads.mtp.load_mtp``).
        target: The target (its embedding and LM head are shared).
        depth: Tokens drafted per round (``--num-draft-tokens`` caps it).

    Raises:
        ValueError: ``depth`` < 1.
    """

    name = "mtp"
    lazy = True
    needs_hidden = True

    def __init__(self, stack: MTPStack, target: nn.Module, depth: int = DEFAULT_DEPTH):
        if depth < 1:
            raise ValueError(f"--mtp-depth must be >= 1, got {depth}")
        body = model_body(target)
        self.stack, self.depth = stack, depth
        self.embed, self.lm_head = body.embed_tokens, output_head(target)
        # A draft vocabulary: sample from these ids' rows of the head only (docs/heads.md 7.4)
        self.vocab_ids = self.sub_head = None
        if stack.draft_ids is not None and not stack.config.own_head:
            ids = mx.array(stack.draft_ids, dtype=mx.int32)
            sliced = head_slice(target, ids)  # a quantized head stays quantized
            if sliced is not None:
                self.vocab_ids, self.sub_head, self.vocab_size = ids, sliced, logits_width(target)
        # and the tokens it was built from
        self.cache, self._history = [KVCache() for _ in self.stack.first.blocks], []
        self.prefill([], None)

    @property
    def profile(self) -> DraftProfile:
        """A chain of its depth (what ``--num-draft-tokens auto`` gives a round at most)."""
        return DraftProfile(max_depth=self.depth)

    def prefill(self, prompt, hidden=None):
        """Keep the cache entries the new prompt shares (a chat turn), as EAGLE does: entry i holds
        (feature of position i, token i + 1); the rest of ``hidden`` is pending."""
        self._pending = feature_prefill(self.cache, self._history, prompt, hidden, reads_next_token=True)
        self._history = prompt
        self.prefilled = 0 if self._pending is None else self._pending.shape[0]

    def commit(self, num_committed, accepted, hidden=None):
        self._pending = pending_features(self._pending, self.cache[0].offset, num_committed, accepted, hidden)

    def propose(self, history, num_draft_tokens, sampling: SamplingParams, plan=None):
        depth = min(num_draft_tokens, self.depth)
        if depth < 1 or self._pending is None:
            return Draft.empty()
        self._history = history
        module, n = self.stack.first, self._pending.shape[0]
        raw = module(self._pending[None], mx.array(history[-n:], dtype=mx.int32)[None], self.embed,
                     cache=self.cache, raw=True)[0][-1:]  # [1, H]
        self._pending, committed = None, self.cache[0].offset
        h, tokens, logprobs = module.norm(raw), [], []  # h [1, H]: predicts the token after the root
        for step in range(depth):
            token, q = self._sample(module, h, sampling)  # [1], [1, V] or None
            tokens.append(token)
            if q is not None:
                logprobs.append(q)
            if step + 1 < depth:
                raw = module(
                    module.chain_feature(raw, h)[None], token[None], self.embed, cache=self.cache, raw=True
                )[0]
                h = module.norm(raw)
        for c in self.cache:
            c.trim(c.offset - committed)  # speculative entries go; later writes overwrite them
        draft = Draft.chain(mx.concatenate(tokens), mx.concatenate(logprobs) if logprobs else None)
        mx.async_eval(draft.tokens, *([draft.logprobs] if logprobs else []))
        return draft


    def _sample(self, module, h: mx.array, sampling: SamplingParams) -> tuple[mx.array, mx.array | None]:
        """One draft token [1] from the module's output ``h`` [1, H] and q [1, V] (``None`` when greedy).

        With a draft vocabulary q is the softmax over its N ids (zero elsewhere): a distribution over
        the target's vocabulary like any other, so the exact rule keeps the output the target's.
        """
        if self.sub_head is None:
            return sample(module.logits(h, self.lm_head), sampling)
        token, q = sample(self.sub_head(h), sampling)  # [1] draft-vocabulary index, [1, N]
        if q is not None:
            wide = mx.full((q.shape[0], self.vocab_size), -mx.inf, dtype=q.dtype)
            wide[:, self.vocab_ids] = q
            q = wide
        return self.vocab_ids[token], q


@dataclass(frozen=True)
class MTPOptions:
    """``--drafter mtp`` (spec ``mtp:weights=FOLDER,depth=2``).

    Raises:
        ValueError: ``depth`` < 1.
    """

    weights: str | None = option(
        None,
        "folder of a checkpoint with MTP layers (DeepSeek-V3/GLM model.layers.N.*, Qwen3.5 mtp.*) or of a "
        "module 'mlxspec train mtp' wrote",
        default_help="the target's own folder if it has MTP layers, else the module shipped in models/mtp/ "
        "for the target",
    )
    depth: int | None = option(
        None,
        "MTP chain depth: tokens drafted per round, the module fed its own output after the first",
        parse=int,
        default_help=f"the module's draft_depth, else {DEFAULT_DEPTH}",
    )

    def __post_init__(self):
        at_least(1, self.depth, "--mtp-depth")


def mtp_weights(context: DrafterContext, given: str | None) -> Path:
    """Where the MTP layers come from: ``given``, the target's own folder, or the module shipped for it.

    Raises:
        ValueError: none of them has MTP layers (naming how to get a module).
    """
    if given:
        return Path(given).expanduser()
    own = Path(context.target_path).expanduser() if context.target_path else None
    if own is not None and own.is_dir() and has_mtp(own):
        return own
    ships = shipped("mtp", context.target_name) if context.target_name else None
    if ships is not None:
        return ships
    name = context.target_name or "this target"
    raise ValueError(
        f"no MTP layers for {name}: its checkpoint has none (no model.layers.{{N}}.eh_proj or mtp.* tensors) "
        f"and no module ships for it; pass --mtp-weights FOLDER ({PUBLISHED['mtp']}), or train one: "
        f"{TRAIN_COMMAND}"
    )


def build(options: MTPOptions, context: DrafterContext) -> MTPDrafter:
    """Raises ``ValueError``/``FileNotFoundError``: no MTP layers, or layers that do not fit the target."""
    stack = load_mtp(mtp_weights(context, options.weights), context.target)
    depth = options.depth if options.depth is not None else stack.config.draft_depth or DEFAULT_DEPTH
    return MTPDrafter(stack, context.target, depth)


DRAFTER = register(
    DrafterType(
        "mtp",
        MTPOptions,
        build,
        "the target's own multi-token-prediction layers (DeepSeek-V3, GLM, Qwen3.5) or one trained here, a "
        "sampled chain",
        order=45,
    )
)
