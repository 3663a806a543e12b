"""DFlash drafting: one drafter forward proposes a whole block (DFlash, arXiv 2602.06036).

The network and its checkpoint layout are ``mlxspec.heads.dflash``; docs/heads.md 8.1 and 8.3 describe both.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from ..heads.dflash import DFlashNet, load_dflash
from ..core.sampling import SamplingParams, sample
from ..core.taps import model_body, output_head
from .base import Draft, Drafter, DraftProfile, feature_prefill, pending_features
from .registry import DrafterContext, DrafterType, option, register


class DFlashDrafter(Drafter):
    """A chain of up to B − 1 tokens per round from one forward over ``[anchor, MASK, …, MASK]``.

    Each round the drafter runs once over the full block (B positions, bidirectional inside the
    block; the target's features of every committed position as extra keys/values) and reads a
    distribution q_j for every block position j = 1 … B − 1 at once. At temperature 0 it drafts
    each q_j's argmax (deterministic, ``Draft.logprobs = None``: docs/acceptance.md 2.4 and 2.6).
    Otherwise x_j is drawn from q_j = warp(logits_j) (the target's temperature and filters) and q_j
    is passed on, so the target verifies with the Leviathan/Chen rule (docs/acceptance.md 2.1).

    Why a position-wise proposal is a valid q for that rule: exactness at position j needs only
    that, given the context and the already accepted x_1 … x_{j−1}, the draft x_j was drawn from
    the q_j the verifier is handed (the proof in docs/acceptance.md 2.1 is per position,
    conditional on the prefix). Here q_j depends on the committed context alone and x_j is drawn
    with randomness independent of x_1 … x_{j−1}, so its conditional distribution given any
    accepted prefix is exactly q_j: an autoregressive draft model is the special case where q_j
    also reads the prefix. The rule's min(1, p_j/q_j) acceptance and norm((p_j − q_j)₊) residual then
    make the emitted token at every position distributed as p_j, whatever q_j is; a poor q_j only
    lowers acceptance. (The block is always run at its trained size B; ``num_draft_tokens`` only
    cuts how many of its positions are proposed, so q_j does not depend on γ either.)

    The drafter's KV cache holds the fused context of committed positions only (docs/heads.md 8.2):
    each round appends the target features of the positions committed since the last round (the
    prompt at first, then the root and the accepted drafts of each verify forward); the block's
    own keys/values are never cached, so nothing has to be trimmed after a rejection.

    Args:
        net: A loaded ``DFlashNet`` that fits the target (``heads.dflash.check_fits``).
        target: The target model (its embedding and LM head).
    """

    name = "dflash"
    lazy = True
    needs_hidden = True

    def __init__(self, net: DFlashNet, target: nn.Module):
        self.net, self.config = net, net.config
        self.feature_layers = self.config.feature_layers
        # the block is always run whole (γ only cuts how much of it is proposed); survival: each position's
        # largest q, multiplied along the block (docs/acceptance.md 3.1)
        self.profile = DraftProfile(max_depth=self.max_draft_tokens, per_round=True, survival=True)
        self.embed, self.lm_head = model_body(target).embed_tokens, output_head(target)
        # and the tokens it was built from
        self.cache, self._history = [KVCache() for _ in self.net.layers], []
        self.prefill([], None)

    @property
    def max_draft_tokens(self) -> int:
        """B − 1, the drafts of one block."""
        return self.config.block_size - 1

    def prefill(self, prompt, hidden=None):
        """Keep the cached context the new prompt shares (a chat turn); the rest of ``hidden`` is pending.

        Entry i holds the fused features of position i alone, so it stays valid while the prompt
        agrees with the tokens it was built from up to position i."""
        # target features of committed positions not yet in the drafter's cache, [n, K H]
        self._pending = feature_prefill(self.cache, self._history, prompt, hidden, reads_next_token=False)
        self._history = prompt
        self.prefilled = 0 if self._pending is None else self._pending.shape[0]

    def commit(self, num_committed, accepted, hidden=None):
        self._pending = pending_features(self._pending, self.cache[0].offset, num_committed, accepted, hidden)

    def block_logits(self, anchor: int, position: int) -> tuple[mx.array, mx.array]:
        """One drafter forward over the block at ``position`` (the anchor's): hidden [B, H] and
        logits [B, V] (lazy); the pending features enter the cache first."""
        B = self.config.block_size
        tokens = mx.array([[anchor] + [self.config.mask_token_id] * (B - 1)], dtype=mx.int32)  # [1, B]
        features = self._pending[None] if self._pending is not None else None
        hidden, logits = self.net.block(tokens, features, self.embed, self.lm_head, self.cache, position)
        self._pending = None
        return hidden[0], logits[0]

    def propose(self, history, num_draft_tokens, sampling: SamplingParams, plan=None):
        K = min(num_draft_tokens, self.config.block_size - 1)
        if K < 1 or (self._pending is None and self.cache[0].offset == 0):
            return Draft.empty()
        self._history = history
        _, logits = self.block_logits(history[-1], len(history) - 1)
        tokens, q = sample(logits[1 : K + 1], sampling)  # [K], [K, V] or None (greedy)
        mx.async_eval(tokens)
        # never reads the drawn tokens (3.2)
        rows = (logits[1 : K + 1] if q is None else q).astype(mx.float32)
        survival = mx.exp(mx.cumsum(rows.max(axis=-1) - mx.logsumexp(rows, axis=-1)))
        return Draft.chain(tokens, q, survival)


@dataclass(frozen=True)
class DFlashOptions:
    """``--drafter dflash`` (spec ``dflash:heads=PATH``). The block size, mask token and target layers
    come from the checkpoint; ``--num-draft-tokens`` caps the drafts at B − 1."""

    heads: str | None = option(
        None,
        "DFlash drafter: a folder (config.json + *.safetensors, z-lab's layout) or a Hugging Face repo id",
        default_help="the drafter shipped in models/dflash/ for the target",
    )


def build(options: DFlashOptions, context: DrafterContext) -> DFlashDrafter:
    """Raises ``ValueError``/``FileNotFoundError``: no drafter for the target, or one that does not fit it."""
    return DFlashDrafter(load_dflash(context.asset("dflash", options.heads), context.target), context.target)


DRAFTER = register(DrafterType("dflash", DFlashOptions, build,
                               "a DFlash block drafter: one forward drafts a whole block from the target's "
                               "features (DFlash, arXiv 2602.06036)", order=45))
