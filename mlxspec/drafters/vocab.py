"""A draft vocabulary for a draft model: its most frequent tokens, plus what the text so far holds.

FR-Spec (Zhao et al. 2025, arXiv 2502.14856, section 3) observes that a small draft model with a
large vocabulary spends a large share of each step in its LM head: Qwen2.5-Coder-0.5B's head is
151936 × 896 weights, about a quarter of the model. Drafting from the N most frequent tokens only
multiplies the hidden state by N rows of the head. The draft's q is then the softmax over those
rows (zero elsewhere): still a distribution over the target's vocabulary, so the exact rule keeps
the output the target's at any temperature; a target token outside the set is never drafted (the
residual or the bonus can still emit it). What it costs is acceptance where the target's token
falls outside the set, so the drafter also drafts from every token of the prompt and of the answer
so far (what a code edit copies), docs/drafters.md "A draft vocabulary".

The ranking is per tokenizer: token counts over ShareGPT's assistant turns (``rank_tokens``), keyed by
a digest of the tokenizer's vocabulary (``tokenizer_digest``). One ships in ``models/vocab/`` for each
tokenizer this team measured (Qwen2.5's, which its 0.5B-72B models share); another is counted on first
use and cached in ``$MLXSPEC_CACHE/vocab/``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..loading.assets import cache_dir, models_dir
from ..runtime.files import written_whole

#: The draft vocabulary ``vocab=auto`` takes (FR-Spec's choice for Llama-3's 128k vocabulary too).
DEFAULT_DRAFT_VOCAB = 32768
#: ``vocab=auto`` reduces only vocabularies at least this large (below it the head is a small share).
MIN_AUTO_VOCAB = 2 * DEFAULT_DRAFT_VOCAB
#: Characters of assistant text counted for a ranking (about 7 M Qwen2.5 tokens of ShareGPT).
RANKING_CHARS = 32_000_000


def tokenizer_digest(tokenizer) -> str:
    """16 hex digits of sha256 over the tokenizer's (token, id) pairs: models that share a tokenizer
    share it (Qwen2.5-0.5B ... 72B, the Coder models)."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


def ranking_paths(digest: str) -> list[Path]:
    """Where a ranking for the tokenizer ``digest`` may be: shipped first, then the cache."""
    return [models_dir() / "vocab" / f"{digest}.safetensors", cache_dir() / "vocab" / f"{digest}.safetensors"]


def load_ranking(digest: str) -> np.ndarray | None:
    """The shipped or cached ranking for a tokenizer: distinct token ids, most frequent first, [V'] int32.

    Raises:
        ValueError: a file that is not a ranking (naming it and the fix).
    """
    for path in ranking_paths(digest):
        if path.is_file():
            ids = np.array(mx.load(str(path)).get("ids", mx.zeros((0, 0))))
            if ids.ndim != 1 or ids.size == 0 or np.unique(ids).size != ids.size or ids.min() < 0:
                raise ValueError(f"{path} must hold 'ids', distinct token ids most frequent first; delete it "
                                 "and it is counted again")
            return ids.astype(np.int32)
    return None


def save_ranking(path: str | Path, ids: np.ndarray, metadata: dict[str, str]) -> Path:
    """Write a ranking (``ids`` [V'] int32, most frequent first) atomically, with string ``metadata``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(path, suffix=".part.safetensors") as partial:
        mx.save_safetensors(str(partial), {"ids": mx.array(np.asarray(ids, dtype=np.int32))},
                            metadata=metadata)
    return path


def rank_tokens(
    tokenizer, texts: Iterable[str], vocab_size: int, *, max_chars: int = RANKING_CHARS
) -> np.ndarray:
    """The ids that occur in ``texts``, most frequent first (ties: smaller id first).

    Args:
        tokenizer: A tokenizer with ``encode`` (an mlx-lm ``TokenizerWrapper``).
        texts: The text to count, read until ``max_chars`` characters.
        vocab_size: V, the logits width (every id below it is ranked).
        max_chars: Most characters read. Default: ``RANKING_CHARS``.

    Returns:
        np.ndarray: [V'] int32, V' <= V the ids seen (``draft_ids`` adds unseen ones in id order if asked for
            more).
    """
    counts, read, batch = np.zeros(vocab_size, dtype=np.int64), 0, []
    encode = _batch_encoder(tokenizer)

    def flush():
        for ids in encode(batch):
            ids = np.asarray(ids, dtype=np.int64)
            counts[:] += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
        batch.clear()

    for text in texts:
        batch.append(text)
        read += len(text)
        if len(batch) == 256:
            flush()
        if read >= max_chars:
            break
    flush()
    order = np.lexsort((np.arange(vocab_size), -counts))
    return order[: int((counts > 0).sum())].astype(np.int32)


def draft_ids(ranking: np.ndarray, size: int, num_real_tokens: int) -> np.ndarray:
    """The ``size`` most frequent real token ids of ``ranking`` (unseen ids after it, in id order), sorted.

    Args:
        ranking: Ids most frequent first, [V'] (``rank_tokens``).
        size: N, how many to keep (all real ids when N exceeds them).
        num_real_tokens: Ids at or above it (embedding padding) are never kept.

    Returns:
        np.ndarray: [min(N, num_real_tokens)] int32, sorted.
    """
    ranking = ranking[ranking < num_real_tokens]
    if ranking.size < size:
        ranking = np.concatenate([ranking, np.setdiff1d(np.arange(num_real_tokens), ranking)])
    return np.sort(ranking[:size]).astype(np.int32)


def _batch_encoder(tokenizer) -> Callable[[list[str]], list[list[int]]]:
    """A fast tokenizer's batch call when there is one (ShareGPT in seconds), else ``encode`` per text."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    if getattr(inner, "is_fast", False):
        return lambda texts: inner(texts, add_special_tokens=False)["input_ids"] if texts else []
    return lambda texts: [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def sharegpt_ranking(
    tokenizer, vocab_size: int, on_measure: Callable[[str], None] | None = None
) -> np.ndarray:
    """The tokenizer's ranking: shipped or cached, else counted over ShareGPT's assistant turns and cached.

    Args:
        tokenizer: The target's tokenizer.
        vocab_size: V, the target's logits width.
        on_measure: Told before counting (the first use for a tokenizer; ShareGPT is fetched once).

    Raises:
        ValueError: ShareGPT cannot be had (offline, first use), or a bad ranking file.
    """
    digest = tokenizer_digest(tokenizer)
    ids = load_ranking(digest)
    if ids is not None:
        return ids
    from ..loading.data import load_sharegpt  # only on first use: it reads 126 MB

    if on_measure is not None:
        on_measure(
            "the draft vocabulary: counting tokens over ShareGPT's answers (first use for this tokenizer)"
        )
    conversations, _ = load_sharegpt()
    texts = (turn.text for c in conversations for turn in c.turns if turn.role == "assistant")
    ids = rank_tokens(tokenizer, texts, vocab_size)
    save_ranking(ranking_paths(digest)[1], ids, {"corpus": "ShareGPT V3 assistant turns",
                                                 "max_chars": str(RANKING_CHARS), "tokenizer": digest})
    return ids
