"""DSpark drafters: the DFlash block backbone plus a serial low-rank Markov head and a confidence head.

DSpark (DeepSeek's DeepSpec, arXiv 2607.05147; docs/heads.md 9.1). One backbone forward
(``heads.dflash.DFlashNet.block``) gives every block position's hidden state h_j and base logits
b_j. A light serial head then samples left to right inside the block: position j's logits are
b_j + W2 W1[x_{j−1}] (``MarkovHead``; W1 [V, r] an embedding of the previous token, W2 [r → V]),
so later positions depend on earlier ones. The confidence head gives c_j = σ(w · [h_j, W1[x_{j−1}]] + b),
the probability that position j survives given that the positions before it did.

The checkpoint layout is the published one (mlx-vlm's ``dspark`` drafters, DeepSpec): a Qwen3
DFlash ``config.json`` whose ``dflash_config`` has ``projector_type: "dspark"``, ``markov_rank``,
``markov_head_type: "vanilla"``, ``enable_confidence_head``, ``confidence_head_with_markov`` and
``sample_from_anchor``; tensors ``markov_head.markov_w1.weight`` [V, r],
``markov_head.markov_w2.weight`` [V, r], ``confidence_head.proj.{weight [1, H (+ r)], bias [1]}``
beside the DFlash backbone's. The block's ``block_size`` counts proposals; with
``sample_from_anchor`` (the default) block row j − 1 scores draft j, so the drafter's forward is
``[anchor, MASK × (P − 1)]`` and proposes up to P tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .checkpoints import write_checkpoint
from .dflash import DFlashConfig, DFlashNet, load_block_drafter

#: How an error about a file that holds no usable DSpark drafter ends: what to pass instead.
PASS_DSPARK = (
    "pass a DSpark drafter instead: a folder with config.json and model.safetensors (as 'mlxspec train "
    "dspark' writes) or a Hugging Face repo id"
)


#: DSpark fields DeepSpec's ``build_draft_config`` puts at the top of ``config.json`` (the published layout
#: nests them in ``dflash_config``); DeepSpec's row layout is ``sample_from_anchor``'s (row j − 1 scores draft
#: j).
_DEEPSPEC_FIELDS = ("block_size", "mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type",
                    "enable_confidence_head", "confidence_head_with_markov")


@dataclass(frozen=True)
class DSparkConfig:
    """Shape of a DSpark drafter.

    Attributes:
        backbone: The DFlash backbone's config; its ``block_size`` is the forward's length.
        markov_rank: r, the rank of the transition bias.
        confidence: Whether the checkpoint has a confidence head.
        confidence_with_markov: The confidence head also reads W1[x_{j−1}].
        sample_from_anchor: Block row j − 1 scores draft j (P = block_size proposals); otherwise row j
            does, as in DFlash (P = block_size − 1).
    """

    backbone: DFlashConfig
    markov_rank: int
    confidence: bool = True
    confidence_with_markov: bool = True
    sample_from_anchor: bool = True

    @property
    def proposals(self) -> int:
        """P, the most tokens one round drafts."""
        return self.backbone.block_size - (0 if self.sample_from_anchor else 1)

    @classmethod
    def from_dict(cls, config: dict) -> DSparkConfig:
        """Read a DSpark ``config.json``: the published layout (the DSpark fields in ``dflash_config``) or
        DeepSpec's own save (``Qwen3DSparkModel``: the same fields at the top).

        Raises:
            ValueError: not a DSpark config, or a variant this drafter cannot run exactly as trained
                (another Markov head type, a bonus anchor inside the block, what ``DFlashConfig`` refuses).
        """
        extra = config.get("dflash_config") or {}
        if not isinstance(extra, dict):
            raise ValueError(
                "DSpark config's dflash_config must be a JSON object; is this a DSpark drafter's config.json?"
            )
        # DeepSpec's own save: the fields at the top
        if "markov_rank" not in extra and "markov_rank" in config:
            extra = {**{k: config[k] for k in _DEEPSPEC_FIELDS if k in config}, **extra}
        if extra.get("projector_type") != "dspark" and not any(
            "DSpark" in a for a in config.get("architectures") or ()
        ):
            raise ValueError(
                "this config.json is not a DSpark drafter's (no dflash_config.projector_type 'dspark'); "
                "for a DFlash drafter use --drafter dflash"
            )
        if extra.get("markov_head_type", "vanilla") != "vanilla":
            raise ValueError(
                f"DSpark Markov head {extra['markov_head_type']!r} is not supported; use a 'vanilla' one"
            )
        if config.get("dspark_bonus_anchor") or extra.get("dspark_bonus_anchor"):
            raise ValueError("DSpark checkpoints with the bonus anchor inside the block are not supported")
        if "markov_rank" not in extra:
            raise ValueError("DSpark config lacks dflash_config.markov_rank")
        rank = extra["markov_rank"]
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(
                f"DSpark config gives dflash_config.markov_rank = {rank!r}, not a whole number of at "
                "least 1; is this a DSpark drafter's config.json?"
            )
        backbone = copy.deepcopy(config)
        backbone["dflash_config"] = {k: v for k, v in extra.items() if k not in ("projector_type",)}
        return cls(
            DFlashConfig.from_dict(backbone),
            rank,
            bool(extra.get("enable_confidence_head", False)),
            bool(extra.get("confidence_head_with_markov", True)),
            bool(extra.get("sample_from_anchor", True)),
        )

    def to_dict(self) -> dict:
        """``config.json`` in the published layout."""
        out = self.backbone.to_dict()
        out["architectures"] = ["DSparkDraftModel"]
        out["dflash_config"].update(
            {
                "projector_type": "dspark",
                "markov_rank": self.markov_rank,
                "markov_head_type": "vanilla",
                "enable_confidence_head": self.confidence,
                "confidence_head_with_markov": self.confidence_with_markov,
                "sample_from_anchor": self.sample_from_anchor,
            }
        )
        return out


class MarkovHead(nn.Module):
    """The transition bias W2 W1[x_prev]: [..] int32 previous tokens -> [.., V] logits to add."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def __call__(self, previous: mx.array) -> tuple[mx.array, mx.array]:
        """Bias [.., V] and the previous token's embedding W1[x_prev] [.., r]."""
        e = self.markov_w1(previous)
        return self.markov_w2(e), e


class ConfidenceHead(nn.Module):
    """c = σ(proj([h, W1[x_prev]])): P(this position survives | the ones before it did), float32."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1, bias=True)

    def logits(self, hidden: mx.array, markov: mx.array) -> mx.array:
        """The logit of c: hidden [.., H] and W1[x_prev] [.., r] -> [..] float32 (training uses it for a
        stable BCE)."""
        x = mx.concatenate([hidden, markov.astype(hidden.dtype)], axis=-1) if self.with_markov else hidden
        return self.proj(x)[..., 0].astype(mx.float32)

    def __call__(self, hidden: mx.array, markov: mx.array) -> mx.array:
        return mx.sigmoid(self.logits(hidden, markov))


class DSparkNet(DFlashNet):
    """The DFlash backbone (``DFlashNet``, unchanged) with DSpark's Markov and confidence heads.

    Args:
        config: Its shape.
    """

    def __init__(self, config: DSparkConfig):
        super().__init__(config.backbone)
        self.dspark = config
        H, V = config.backbone.hidden_size, config.backbone.vocab_size
        self.markov_head = MarkovHead(V, config.markov_rank)
        if config.confidence:
            self.confidence_head = ConfidenceHead(H, config.markov_rank, config.confidence_with_markov)

    def proposal_rows(self, hidden: mx.array, logits: mx.array) -> tuple[mx.array, mx.array]:
        """The block rows that score drafts 1..P: hidden [P, H] and base logits [P, V] of a block's [B, ·]."""
        start = 0 if self.dspark.sample_from_anchor else 1
        P = self.dspark.proposals
        return hidden[start : start + P], logits[start : start + P]


def load_dspark(spec: str | Path, target: nn.Module | None = None, dtype=None) -> DSparkNet:
    """Load a DSpark drafter in the published layout from a folder or a Hugging Face repo.

    Args:
        spec: A folder (``config.json`` + ``*.safetensors``) or a repo id (fetched without code).
        target: The target model; when given the drafter must fit it (``dflash.check_fits``).
        dtype: Cast float weights to this dtype. Default: the target's embedding dtype, else float32.

    Returns:
        DSparkNet: Evaluated, in eval mode.

    Raises:
        FileNotFoundError: no config or weights.
        ValueError: not a DSpark config, an unsupported variant, config and tensors that disagree, or
            a drafter that does not fit the target (both sizes named).
    """
    return load_block_drafter(
        spec,
        target,
        dtype,
        DSparkConfig.from_dict,
        DSparkNet,
        "DSpark drafter",
        lambda c: (
            f"for its config.json (markov_rank {c.markov_rank}, confidence head "
            f"{'on' if c.confidence else 'off'}); are they from the same checkpoint?"
        ),
        PASS_DSPARK,
    )


def save_dspark(net: DSparkNet, folder: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the published layout."""
    write_checkpoint(folder, dict(tree_flatten(net.parameters())), net.dspark.to_dict())
