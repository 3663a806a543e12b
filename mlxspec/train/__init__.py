"""Head training: conversations → cached target features → Medusa heads (EAGLE reuses the first two).

- ``dataset``: sources (ShareGPT, JSONL), the assistant-token loss mask, the held-out split.
- ``corpus``: the target's own greedy answers with its features, in one batched pass.
- ``features``: the frozen target's hidden states, cached on disk in chunks and streamed.
- ``medusa``: Medusa-1 training and held-out accuracy.
- ``measure``: τ, acceptance per depth and tokens/s of trained heads on held-out prompts.
"""

from __future__ import annotations

from .dataset import (
    DataReport,
    Example,
    assistant_mask,
    heldout_prompts,
    read_conversations,
    split_conversations,
    tokenize_conversations,
    write_heldout_prompts,
)
from .features import Batch, FeatureCache, cache_dir_for, extract_features
from .store import StoreProgress
from .medusa import EvalRecord, MedusaTrainConfig, StepRecord, evaluate, init_heads, medusa_loss, train_medusa

__all__ = [
    "Batch",
    "DataReport",
    "EvalRecord",
    "Example",
    "StoreProgress",
    "FeatureCache",
    "MedusaTrainConfig",
    "StepRecord",
    "assistant_mask",
    "cache_dir_for",
    "evaluate",
    "extract_features",
    "heldout_prompts",
    "init_heads",
    "medusa_loss",
    "read_conversations",
    "split_conversations",
    "tokenize_conversations",
    "train_medusa",
    "write_heldout_prompts",
]
