"""The target's features, computed once and cached on disk in chunks.

Medusa-1 and EAGLE keep the target frozen, so its final normalised hidden states are a fixed
function of the training text: ``extract_features`` runs the target once over the examples and
stores, per chunk of about ``chunk_tokens`` tokens, the hidden states (float16), the token ids,
the loss mask and the target's greedy next token. A ``manifest.json`` lists the chunks; a chunk
is written to a temporary name and renamed when complete, so an interrupted extraction resumes
at the first missing chunk. ``FeatureCache`` streams one chunk at a time, so memory stays flat
with the size of the data, and yields the same batches, in the same order, for the same seed
and epoch.

Layout: ``<root>/<model fingerprint>/<data fingerprint>/{manifest.json, chunk-00000.npz, ...}``
with ``<root>`` = ``$MLXSPEC_CACHE/features`` by default.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..loading.models import default_cache_dir
from ..core.taps import HiddenTap, output_head
from .dataset import Example
from .loop import cast_copy
from .store import MANIFEST, StoreProgress, model_fingerprint, open_manifest, write_chunk, write_json

DEFAULT_CHUNK_TOKENS = 32_768
FORMAT_VERSION = 1
LABELS = ("data", "target")
"""Label sources: ``data`` = the text's own token t + k + 2 (Medusa-1); ``target`` = the target's
greedy prediction of that token given the text up to t + k + 1 (a cheap self-distillation)."""


def default_features_root() -> Path:
    """``$MLXSPEC_CACHE/features`` (default ``~/.cache/mlxspec/features``)."""
    return default_cache_dir() / "features"


def data_fingerprint(examples: list[Example], chunk_tokens: int) -> str:
    """A short hash of the examples' tokens and masks, in order, and the chunk size."""
    sha = hashlib.sha256(f"v{FORMAT_VERSION}:{chunk_tokens};".encode())
    for ex in examples:
        sha.update(len(ex.tokens).to_bytes(8, "little"))
        sha.update(ex.tokens.astype(np.int32).tobytes())
        sha.update(ex.mask.astype(np.uint8).tobytes())
    return sha.hexdigest()[:16]


def plan_chunks(examples: list[Example], chunk_tokens: int) -> list[tuple[int, int]]:
    """Consecutive ``(start, end)`` example ranges of about ``chunk_tokens`` tokens each."""
    chunks, start, tokens = [], 0, 0
    for i, ex in enumerate(examples):
        tokens += len(ex.tokens)
        if tokens >= chunk_tokens:
            chunks.append((start, i + 1))
            start, tokens = i + 1, 0
    if start < len(examples):
        chunks.append((start, len(examples)))
    return chunks


def cache_dir_for(model: nn.Module, examples: list[Example], *, root: str | Path | None = None,
                  chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Path:
    """Where the features of ``examples`` under ``model`` live."""
    root = Path(root).expanduser() if root is not None else default_features_root()
    return root / model_fingerprint(model) / data_fingerprint(examples, chunk_tokens)


def extract_features(model: nn.Module, examples: list[Example], directory: str | Path, *,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Iterator[StoreProgress]:
    """Run the frozen target over ``examples`` and store its features in ``directory``.

    Chunks already on disk are skipped, so calling this again after an interruption resumes.

    Args:
        model: The target (float32 for faithful features).
        examples: Tokenized conversations.
        directory: The cache folder (``cache_dir_for``).
        chunk_tokens: Tokens per chunk (about). Default: ``32768``.

    Yields:
        ``StoreProgress`` in tokens after each example and each chunk found on disk.

    Raises:
        ValueError: if ``directory`` holds a cache of other data or another model.
    """
    directory = Path(directory)
    chunks = plan_chunks(examples, chunk_tokens)
    manifest = _open_manifest(directory, model, examples, chunks, chunk_tokens)
    tap = HiddenTap(model)
    lm_head = output_head(model)
    total = sum(len(ex.tokens) for ex in examples)
    done = computed = 0
    start = time.perf_counter()
    for c, (lo, hi) in enumerate(chunks):
        info = manifest["chunks"][c]
        if info["complete"] and (directory / info["file"]).is_file():
            done += info["tokens"]
            yield StoreProgress(c, len(chunks), done, total, computed, time.perf_counter() - start, True)
            continue
        hidden, greedy = [], []
        for ex in examples[lo:hi]:
            h, g = _forward(model, tap, lm_head, ex)
            hidden.append(h)
            greedy.append(g)
            done += len(ex.tokens)
            computed += len(ex.tokens)
            yield StoreProgress(c, len(chunks), done, total, computed, time.perf_counter() - start, False)
        mx.clear_cache()
        _write_chunk(
            directory / info["file"], examples[lo:hi], np.concatenate(hidden), np.concatenate(greedy)
        )
        info["complete"] = True
        write_json(directory / MANIFEST, manifest)


def _forward(model, tap: HiddenTap, lm_head, ex: Example) -> tuple[np.ndarray, np.ndarray]:
    """Hidden states [T, H] (float16) and the greedy next token [T] (-1 where the next token is not
    an assistant token: no label ever reads it there, and skipping those rows saves LM-head work)."""
    model.model(mx.array(ex.tokens)[None])  # the body only: the tap records the final hidden state
    h = tap.final[0]  # [T, H]
    rows = np.flatnonzero(ex.mask[1:])  # t whose token t + 1 is an assistant token
    g = (
        mx.argmax(lm_head(h[mx.array(rows)]), axis=-1).astype(mx.int32)
        if len(rows)
        else mx.zeros((0,), mx.int32)
    )
    h = h.astype(mx.float16)
    mx.eval(h, g)
    greedy = np.full(len(ex.tokens), -1, dtype=np.int32)
    greedy[rows] = np.array(g)
    return np.array(h), greedy


def _open_manifest(directory: Path, model, examples, chunks, chunk_tokens) -> dict:
    hidden_size, vocab_size = _shape(model)
    manifest = {
        "version": FORMAT_VERSION,
        "model": model_fingerprint(model),
        "data": data_fingerprint(examples, chunk_tokens),
        "hidden_size": hidden_size,
        "vocab_size": vocab_size,
        "examples": len(examples),
        "tokens": sum(len(ex.tokens) for ex in examples),
        "masked_tokens": int(sum(ex.mask.sum() for ex in examples)),
        "chunks": [{"file": f"chunk-{c:05d}.npz", "examples": [lo, hi],
                    "tokens": int(sum(len(ex.tokens) for ex in examples[lo:hi])), "complete": False}
                   for c, (lo, hi) in enumerate(chunks)],
    }
    return open_manifest(directory, manifest, "features of another model or data set")


def _shape(model) -> tuple[int | None, int | None]:
    args = getattr(model, "args", None)
    return getattr(args, "hidden_size", None), getattr(args, "vocab_size", None)


def _write_chunk(path: Path, examples: list[Example], hidden: np.ndarray, greedy: np.ndarray) -> None:
    offsets = np.cumsum([0] + [len(ex.tokens) for ex in examples]).astype(np.int64)
    write_chunk(
        path,
        {
            "hidden": hidden,
            "tokens": np.concatenate([ex.tokens for ex in examples]),
            "mask": np.concatenate([ex.mask for ex in examples]),
            "greedy": greedy,
            "offsets": offsets,
        },
    )


@dataclass(frozen=True)
class Batch:
    """Training positions for K heads.

    Attributes:
        hidden: Final normalised hidden states h_t, shape [B, H], float32.
        labels: Head k's target at each position (token t + k + 2), shape [K, B], int32.
        valid: Whether head k has a target there (an assistant token inside the example),
            shape [K, B], float32 (0 on padding rows).
        greedy_labels: The target's greedy prediction of token t + k + 2 given the text up to
            t + k + 1, shape [K, B], int32.
    """

    hidden: mx.array
    labels: mx.array
    valid: mx.array
    greedy_labels: mx.array


class FeatureCache:
    """A finished feature cache, read one chunk at a time.

    Args:
        directory: A folder written by ``extract_features``.

    Raises:
        FileNotFoundError: no manifest there.
        ValueError: the extraction is not finished.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        path = self.directory / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"no feature cache in {self.directory} (no {MANIFEST})")
        self.manifest = json.loads(path.read_text())
        missing = [c["file"] for c in self.manifest["chunks"] if not c["complete"]]
        if missing:
            raise ValueError(f"the feature cache in {self.directory} is unfinished ({len(missing)} chunks "
                             "missing); run the extraction again to resume it")

    @property
    def num_chunks(self) -> int:
        return len(self.manifest["chunks"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["tokens"])

    def load_chunk(self, c: int) -> dict[str, np.ndarray]:
        """Arrays of chunk ``c``: ``hidden`` [N, H] f16, ``tokens``, ``mask``, ``greedy`` [N], ``offsets``
        [E + 1]."""
        with np.load(self.directory / self.manifest["chunks"][c]["file"]) as data:
            return {k: data[k] for k in data.files}

    def load_arrays(self, c: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Only the arrays ``names`` of chunk ``c`` (npz members load on access: skip the large features).

        Raises:
            ValueError: the chunk lacks some of them (the folder is another kind of store).
        """
        with np.load(self.directory / self.manifest["chunks"][c]["file"]) as data:
            missing = [k for k in names if k not in data.files]
            if missing:
                raise ValueError(f"{self.directory} has no {', '.join(missing)}: it is not the kind of store "
                                 "this needs (a corpus from 'mlxspec train corpus' has every array)")
            return {k: data[k] for k in names}

    def chunk_positions(self, c: int, num_heads: int, arrays: dict | None = None) -> np.ndarray:
        """Positions t of chunk ``c`` where at least one of ``num_heads`` heads has a target."""
        arrays = arrays if arrays is not None else self.load_chunk(c)
        return np.flatnonzero(valid_targets(arrays, num_heads).any(axis=0))

    def steps_per_epoch(self, num_heads: int, batch_size: int) -> int:
        """Batches per epoch for ``batches(num_heads, batch_size)`` (reads only the small arrays)."""
        steps = 0
        for c in range(self.num_chunks):
            arrays = self.load_arrays(c, ("mask", "offsets"))
            steps += -(-len(self.chunk_positions(c, num_heads, arrays)) // batch_size)
        return steps

    def batches(self, num_heads: int, batch_size: int, *, epoch: int = 0, seed: int = 0,
                shuffle: bool = True, start: int = 0) -> Iterator[Batch]:
        """Batches of ``batch_size`` positions; each chunk's last batch is padded (``valid`` = 0).

        With ``shuffle`` the chunk order and the positions inside a chunk are permuted by a
        generator seeded with (seed, epoch[, chunk]), so the same arguments always give the
        same batches. Without it, positions come in cache order. The first ``start`` batches
        are skipped without being built (a resumed epoch).
        """
        order = np.arange(self.num_chunks)
        if shuffle:
            order = np.random.default_rng([seed, epoch]).permutation(self.num_chunks)
        index = 0
        for c in order:
            arrays = self.load_chunk(int(c))
            valid = valid_targets(arrays, num_heads)  # [K, N]
            positions = np.flatnonzero(valid.any(axis=0))
            if shuffle:
                positions = np.random.default_rng([seed, epoch, int(c)]).permutation(positions)
            for i in range(0, len(positions), batch_size):
                index += 1
                if index > start:
                    yield _batch(arrays, valid, positions[i : i + batch_size], num_heads, batch_size)


def valid_targets(arrays: dict, num_heads: int) -> np.ndarray:
    """Which (head, position) pairs of a chunk have a training target.

    Args:
        arrays: A chunk's arrays (``FeatureCache.load_chunk``): ``mask`` [N] bool (assistant
            tokens) and ``offsets`` [E + 1] (example boundaries).
        num_heads: K, the heads to train.

    Returns:
        np.ndarray: [K, N] bool: head k at t has a target, i.e. t + k + 2 is an assistant token
        of t's example.
    """
    mask, offsets = arrays["mask"], arrays["offsets"]
    n = len(mask)
    ends = np.repeat(offsets[1:], np.diff(offsets))  # [N]: end of each position's example
    t = np.arange(n)
    out = np.zeros((num_heads, n), dtype=bool)
    for k in range(num_heads):
        target = t + k + 2
        inside = target < ends
        out[k] = inside & mask[np.minimum(target, n - 1)]
    return out


def _batch(arrays: dict, valid: np.ndarray, positions: np.ndarray, num_heads: int, batch_size: int) -> Batch:
    n, pad = len(arrays["tokens"]), batch_size - len(positions)
    k = np.arange(num_heads)[:, None]
    target = np.minimum(positions[None] + k + 2, n - 1)  # [K, b]
    hidden = np.pad(arrays["hidden"][positions].astype(np.float32), ((0, pad), (0, 0)))
    labels = np.pad(arrays["tokens"][target], ((0, 0), (0, pad)))
    # -1 only where not valid
    greedy = np.pad(np.maximum(arrays["greedy"][target - 1], 0), ((0, 0), (0, pad)))
    ok = np.pad(valid[:, positions].astype(np.float32), ((0, 0), (0, pad)))
    return Batch(
        mx.array(hidden), mx.array(labels.astype(np.int32)), mx.array(ok), mx.array(greedy.astype(np.int32))
    )


# --- reading a self-distillation corpus (what the EAGLE, MTP, DFlash and DSpark trainers share) ---------


def check_corpus_arrays(cache: FeatureCache, target: nn.Module | None, need: set[str], method: str) -> None:
    """Refuse a corpus of another model, or one without the arrays ``need`` (one line naming the fix).

    Args:
        cache: The corpus (or a Medusa feature cache, which lacks the soft labels).
        target: The target it must have been made by, or ``None`` to skip that check.
        need: Array names every chunk must hold (``tokens``, ``topk_ids``, ``aux``, ...).
        method: The trainer, for the message (``"DFlash"``).

    Raises:
        ValueError: another model made it, or arrays are missing.
    """
    if target is not None and cache.manifest.get("model") not in (None, model_fingerprint(target)):
        raise ValueError(f"the corpus in {cache.directory} was made by another model than this target; "
                         "build one with this target (mlxspec train corpus --model ...)")
    with np.load(cache.directory / cache.manifest["chunks"][0]["file"]) as data:
        missing = sorted(need - set(data.files))
    if missing:
        raise ValueError(
            f"{cache.directory} lacks {', '.join(missing)}: {method} training needs a corpus from "
            "'mlxspec train corpus', not a Medusa feature cache"
        )


def chunk_batches(cache: FeatureCache, plan: list, make) -> Iterator:
    """``make(arrays, chunk, spans)`` for each ``(chunk, spans)`` of ``plan`` (a trainer's batches in order),
    loading each chunk once and holding one in memory at a time."""
    loaded, arrays = None, None
    for c, spans in plan:
        if c != loaded:
            arrays = None  # drop the previous chunk before reading the next
            arrays, loaded = cache.load_chunk(c), c
        yield make(arrays, c, spans)


def chunk_spans(cache: FeatureCache, max_len: int, *, seed: int, epoch: int, shuffle: bool
                ) -> Iterator[tuple[int, list[tuple[int, int]]]]:
    """``(chunk, example_spans)`` of every chunk: in the order a generator seeded with (seed, epoch) permutes
    them with ``shuffle`` (a resumed run replays it), else in corpus order."""
    order = np.arange(cache.num_chunks)
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(cache.num_chunks)
    for c in map(int, order):
        yield c, example_spans(cache.load_arrays(c, ("tokens", "mask", "offsets")), max_len)


def example_spans(arrays: dict, max_len: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each example of a chunk (cut to ``max_len`` tokens) that has an answer token
    after its second position: the examples a draft position (or a block's anchor) can be trained on.

    Args:
        arrays: A chunk's ``offsets`` [E + 1] and ``mask`` [N] (answer tokens).
        max_len: Most tokens kept per example.
    """
    offsets, mask = arrays["offsets"], arrays["mask"]
    out = []
    for e in range(len(offsets) - 1):
        start, length = int(offsets[e]), int(min(offsets[e + 1] - offsets[e], max_len))
        if length >= 3 and mask[start + 2 : start + length].any():
            out.append((start, length))
    return out


def feature_scale(cache: FeatureCache, max_positions: int = 4096) -> np.ndarray:
    """Per-dimension RMS of the corpus's layer features (``aux`` [N, K, H]) over the first positions of chunk
    0, [K H] float32 (the order in which batches concatenate them), floored at 1e-2.

    Qwen-style targets carry a few massive residual dimensions (Qwen2.5-Coder-0.5B: one has RMS 175
    against a median of 0.6; five hold 92-98% of the middle and top layers' energy), so a drafter's
    ``fc`` over the raw features starts nearly constant across positions, and AdamW, whose steps are
    the same size for every weight, keeps those dimensions dominant. DFlash, DSpark and EAGLE-3
    training divide ``fc``'s input by this scale and fold it into ``fc`` when saving
    (``fold_feature_scale``), so saved drafters read raw features as their published layouts do."""
    with np.load(cache.directory / cache.manifest["chunks"][0]["file"]) as data:
        aux = data["aux"][:max_positions].astype(np.float32)  # [N, K, H]
    return np.maximum(np.sqrt((aux**2).mean(axis=0)).reshape(-1), 1e-2)


def fold_feature_scale(net: nn.Module, scale: np.ndarray, *, unfold: bool = False) -> nn.Module:
    """``net`` (in place; anything with an ``fc`` Linear over the features) with ``fc`` reading raw features:
    ``W / scale`` column-wise, so ``fc(f)`` equals the training network's ``fc(f / scale)``; ``unfold``: the
    inverse, ``W * scale`` (a saved drafter back to the training parametrisation)."""
    s = mx.array(scale.astype(np.float32))
    net.fc.weight = net.fc.weight * s if unfold else net.fc.weight / s
    return net


def folded_copy(net: nn.Module, make, scale: np.ndarray, dtype: str | None) -> nn.Module:
    """What a task saves for ``net`` trained on features divided by ``scale``: a float32 copy (``make()``: an
    empty module of its shape) with the scale folded into ``fc`` (``fold_feature_scale``), cast to ``dtype``
    (``None``: float32)."""
    return cast_copy(fold_feature_scale(cast_copy(net, make, "float32"), scale), make, dtype)
