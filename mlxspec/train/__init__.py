"""Head and draft training: conversations → cached target features or a corpus → a task on one loop.

- ``dataset``: sources (ShareGPT, JSONL), the assistant-token loss mask, the held-out split.
- ``corpus``: the target's own greedy answers with its features, in one batched pass.
- ``store``: the chunked on-disk format both of those write (manifest, atomic chunks, progress).
- ``features``: the frozen target's hidden states, cached on disk in chunks and streamed.
- ``loop``: the one training loop (``fit``: state, resume, AdamW schedule, checkpoints, records).
- ``medusa``, ``eagle``, ``draft``, ``mtp``, ``dflash``, ``dspark``: each method as a small task on the loop.
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
from .loop import EvalRecord, StepRecord, Task, TrainConfig, fit
from .medusa import (
    MedusaEvalRecord,
    MedusaTask,
    MedusaTrainConfig,
    evaluate,
    init_heads,
    medusa_loss,
    train_medusa,
)
from .store import StoreProgress

__all__ = [
    "Batch",
    "DataReport",
    "EvalRecord",
    "Example",
    "FeatureCache",
    "MedusaEvalRecord",
    "MedusaTask",
    "MedusaTrainConfig",
    "StepRecord",
    "StoreProgress",
    "Task",
    "TrainConfig",
    "assistant_mask",
    "cache_dir_for",
    "evaluate",
    "extract_features",
    "fit",
    "heldout_prompts",
    "init_heads",
    "medusa_loss",
    "read_conversations",
    "split_conversations",
    "tokenize_conversations",
    "train_medusa",
    "write_heldout_prompts",
]
