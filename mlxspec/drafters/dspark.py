"""DSpark drafting: a DFlash block forward, then a serial Markov head inside the block, with confidence.

DSpark (DeepSeek's DeepSpec, arXiv 2607.05147). The network and its checkpoint layout are
``mlxspec.heads.dspark`` (the backbone is DFlash's, ``mlxspec.heads.dflash``); docs/heads.md 9.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..heads.dspark import DSparkNet, load_dspark
from ..core.sampling import SamplingParams, sample
from .base import Draft, DraftProfile
from .dflash import DFlashDrafter
from .registry import DrafterContext, DrafterType, option, register


class DSparkDrafter(DFlashDrafter):
    """A chain of up to P tokens per round: one backbone forward, then P cheap serial steps.

    The backbone forward over ``[anchor, MASK, …]`` gives every position's hidden state h_j and
    base logits b_j at once (``DFlashDrafter.block_logits``: its cache of committed features is
    reused unchanged). Left to right, position j's proposal is q_j = warp(b_j + W2 W1[x_{j−1}])
    (x_0 the anchor) and x_j is drawn from it (its argmax at temperature 0). q_j is exactly the
    distribution x_j was drawn from given the drafted prefix, as for a draft model, so the chain is
    verified by the Leviathan/Chen rule at any temperature (docs/acceptance.md 2.1), and at
    temperature 0 by the greedy rule (2.6).

    Survival (``Draft.survival``, for ``--num-draft-tokens scheduled``): the product over positions
    up to j of the confidence head's c_i = σ(w · [h_i, W1[x_{i−1}]] + b), or without a confidence
    head of max q_i. Either reads the tokens before position i but never x_i itself, as scheduling
    a sampled chain requires (docs/acceptance.md 3.2).

    Args:
        net: A loaded ``DSparkNet`` that fits the target.
        target: The target model (its embedding and LM head).
    """

    name = "dspark"

    def __init__(self, net: DSparkNet, target: nn.Module):
        super().__init__(net, target)
        self.profile = DraftProfile(max_depth=self.max_draft_tokens, per_round=True, survival=True)

    @property
    def max_draft_tokens(self) -> int:
        """P, the proposals of one block."""
        return self.net.dspark.proposals

    def propose(self, history, num_draft_tokens, sampling: SamplingParams, plan=None):
        K = min(num_draft_tokens, self.max_draft_tokens)
        if K < 1 or (self._pending is None and self.cache[0].offset == 0):
            return Draft.empty()
        self._history = history
        # [P, H], [P, V]
        hidden, logits = self.net.proposal_rows(*self.block_logits(history[-1], len(history) - 1))
        previous = mx.array(history[-1:], dtype=mx.int32)
        tokens, qs, confidence = [], [], []
        for j in range(K):  # the serial head: one embedding row and one [r, V] product per position
            bias, markov = self.net.markov_head(previous)  # [1, V], [1, r]
            step = logits[j : j + 1].astype(mx.float32) + bias.astype(mx.float32)
            token, q = sample(step, sampling)  # [1], [1, V] or None (greedy)
            if hasattr(self.net, "confidence_head"):
                confidence.append(self.net.confidence_head(hidden[j : j + 1], markov))
            else:
                confidence.append(largest_probability(step if q is None else q))
            tokens.append(token)
            qs.append(q)
            previous = token
        tokens = mx.concatenate(tokens)
        mx.async_eval(tokens)
        q = None if sampling.greedy else mx.concatenate(qs, axis=0)
        return Draft.chain(tokens, q, mx.cumprod(mx.concatenate(confidence)))


def largest_probability(logits: mx.array) -> mx.array:
    """max_x softmax(logits)(x) per row, [T, V] -> [T] float32 (logits may be log-probabilities)."""
    logits = logits.astype(mx.float32)
    return mx.exp(logits.max(axis=-1) - mx.logsumexp(logits, axis=-1))


@dataclass(frozen=True)
class DSparkOptions:
    """``--drafter dspark`` (spec ``dspark:heads=PATH``). Block size, mask token, target layers, Markov rank
    and the confidence head come from the checkpoint; ``--num-draft-tokens`` caps the drafts at its P."""

    heads: str | None = option(
        None,
        "DSpark drafter: a folder (config.json + *.safetensors, the published DSpark layout) or a Hugging "
        "Face repo id",
        default_help="the drafter shipped in models/dspark/ for the target",
    )


def build(options: DSparkOptions, context: DrafterContext) -> DSparkDrafter:
    """Raises ``ValueError``/``FileNotFoundError``: no drafter for the target, or one that does not fit it."""
    return DSparkDrafter(load_dspark(context.asset("dspark", options.heads), context.target), context.target)


DRAFTER = register(
    DrafterType(
        "dspark",
        DSparkOptions,
        build,
        "a DSpark drafter: a DFlash block forward plus a serial low-rank Markov head and a confidence head "
        "(DeepSpec, arXiv 2607.05147)",
        order=46,
    )
)
