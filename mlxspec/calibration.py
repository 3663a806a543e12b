"""Measuring this machine's costs: the target's verify curve and a drafter's cost per token, cached.

``load_or_calibrate`` is what ``--num-draft-tokens auto``, tree budgets and ``mlxspec bench`` call:
it times the target's forward over 1..16 tokens (``calibrate_verify``) and the drafter's
``propose`` (``calibrate_draft``) once per model + machine (CPU, cores, BLAS, MLX version and
device) and keeps the numbers under ``$MLXSPEC_CACHE/costs``. A cached curve is checked against
a quick timing of one token (``spot_check_verify``) each time it is read and measured again when the
two disagree (``is_stale``: the machine was busier or quieter then than now). The model they feed is
``costmodel``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .cache import prefill, speculative_cache, trim
from .costmodel import DEFAULT_CONTEXT_TOKENS, MAX_VERIFY_TOKENS, Costs
from .loading import default_cache_dir
from .machine import machine_fingerprint
from .progress import progress_bar
from .sampling import SamplingParams

#: Widths measured; the others in 1..16 are interpolated.
VERIFY_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
#: γ of the timed draft round of a drafter without a ``tree_depth``.
DRAFT_GAMMA = 4
#: Calibration repeats the grid while it stays within this many seconds (at least once, at most 5 times).
DEFAULT_BUDGET_S = 6.0
#: A cached verify curve is stale when a one-token forward now differs from its first point by more than
#: this factor, either way ...
STALE_FACTOR = 1.6
#: ... and by more than this many seconds (timer noise on tiny models is not staleness).
STALE_MIN_DIFF_S = 0.01


def calibrate_verify(model: nn.Module, *, context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                     budget_s: float = DEFAULT_BUDGET_S, seed: int = 0) -> list[float]:
    """Time one target forward over k = 1..16 tokens after a ``context_tokens`` prefix.

    Each timing ends with the host read of the argmax, as a round does. The grid
    ``VERIFY_GRID`` is measured (repeated while within ``budget_s``, median kept),
    interpolated to every k, and made non-decreasing (pool-adjacent-violators).

    Returns:
        list[float]: ``[k - 1]`` = seconds, length 16.
    """
    vocab = _vocab_size(model)
    rng = np.random.default_rng(seed)
    cache = speculative_cache(model)  # the cache the loop verifies on (sliding windows made rewindable)
    prefill(model, cache, rng.integers(0, vocab, size=context_tokens).tolist())
    block = rng.integers(0, vocab, size=MAX_VERIFY_TOKENS).tolist()
    for k in (1, MAX_VERIFY_TOKENS):  # warm-up
        _time_forward(model, cache, block[:k])
    samples: dict[int, list[float]] = {k: [] for k in VERIFY_GRID}
    start = time.perf_counter()
    with progress_bar(5 * len(VERIFY_GRID), "mlxspec: measuring the verify cost", "forward") as bar:
        for rep in range(5):
            for k in VERIFY_GRID:
                samples[k].append(_time_forward(model, cache, block[:k]))
                bar.update()
            elapsed = time.perf_counter() - start
            if elapsed * (rep + 2) / (rep + 1) > budget_s:
                break
    measured = [statistics.median(samples[k]) for k in VERIFY_GRID]
    curve = np.interp(np.arange(1, MAX_VERIFY_TOKENS + 1), VERIFY_GRID, measured)
    return _non_decreasing(curve.tolist())


def spot_check_verify(model: nn.Module, *, context_tokens: int = 16, reps: int = 3, seed: int = 0) -> float:
    """Seconds of one one-token target forward now: the median of ``reps`` after a warm-up, after a short
    ``context_tokens`` prefix (the attention over a longer one changes little of a one-token step).

    The cheap check of a cached verify curve (``is_stale``); costs about ``reps + 2`` decoding steps.
    """
    vocab = _vocab_size(model)
    tokens = np.random.default_rng(seed).integers(0, vocab, size=context_tokens + 1).tolist()
    cache = speculative_cache(model)
    prefill(model, cache, tokens[:-1])
    _time_forward(model, cache, tokens[-1:])  # warm-up
    return statistics.median(_time_forward(model, cache, tokens[-1:]) for _ in range(reps))


def is_stale(cached_s: float, now_s: float, *, factor: float = STALE_FACTOR,
             min_diff_s: float = STALE_MIN_DIFF_S) -> bool:
    """Whether a cached one-token verify time ``cached_s`` no longer describes this machine, timed
    ``now_s`` (seconds both): off by more than ``factor`` either way and by more than ``min_diff_s``.

    A curve measured while another job held the cores (seen here: 1280 ms for a step that takes 53 ms
    alone) would otherwise make ``auto`` price every round wrongly until ``--recalibrate``.
    """
    if cached_s <= 0 or now_s <= 0:
        return True
    ratio = max(now_s / cached_s, cached_s / now_s)
    return ratio > factor and abs(now_s - cached_s) > min_diff_s


def calibrate_draft(drafter, history: list[int], *, num_draft_tokens: int = 4, reps: int = 3,
                    hidden_size: int | None = None) -> float:
    """Seconds per drafted token: ``drafter.propose`` of γ tokens after ``history``, timed to the sync.

    Uses only the ``Drafter`` interface (``prefill``, ``propose``, ``commit``), so any
    drafter can be measured; one that reads the target's hidden states gets zeros of
    width ``hidden_size``. Each timed round is followed by a round that kept nothing (``history``
    grows by the target's token), so every round drafts; the drafter is left as after it.
    """
    width = (hidden_size or 0) * max(1, len(getattr(drafter, "feature_layers", ())))  # EAGLE-3 reads 3 layers
    zeros = (lambda n: [mx.zeros((n, width))]) if getattr(drafter, "needs_hidden", False) else (lambda n: [])
    history = list(history)
    drafter.prefill(history, *zeros(len(history) - 1))
    times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        draft = drafter.propose(history, num_draft_tokens, SamplingParams())
        mx.eval(draft.tokens)
        if rep:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
        history.append(history[-1])  # the round's one target token: a head drafter has a new feature to read
        drafter.commit(len(history), [], *zeros(draft.size + 1))
    return statistics.median(times) / num_draft_tokens


def load_or_calibrate(model: nn.Module, drafter=None, *, cache_dir: Path | None = None,
                      context_tokens: int = DEFAULT_CONTEXT_TOKENS, refresh: bool = False,
                      on_measure: Callable[[str], None] | None = None) -> Costs:
    """``Costs`` for ``model`` and ``drafter`` on this machine, measured once and then cached.

    The verify curve is cached per target (architecture, dtypes) + machine (CPU, cores,
    BLAS, MLX version and device); the draft cost per target + drafter (``drafter_fingerprint``:
    its kind, settings and the shape, dtype and identity of its weights) + machine, so another
    target or another head is measured anew. A cached verify curve whose first point a quick timing
    now contradicts (``spot_check_verify``, ``is_stale``) is measured again, and so is the draft cost
    with it: both were measured under other conditions (another job's load). A drafter that sizes its own rounds
    (``tree_depth``) is timed on a round of that depth, so ``draft_s · tree_depth`` is what
    such a round's drafting costs; others on a round of ``DRAFT_GAMMA`` tokens. A block drafter
    (``fixed_round_cost``: one forward whatever γ) is priced per round (``Costs.draft_round_s``). Files live in ``cache_dir`` (default ``$MLXSPEC_CACHE/costs``).

    Args:
        model: The target.
        drafter: A ``Drafter``, or ``None`` for plain decoding (draft cost 0).
        cache_dir: Where cost files live. Default: ``default_cache_dir() / "costs"``.
        context_tokens: Prefix length of the measurements. Default: ``256``.
        refresh: Measure again even if cached. Default: ``False``.
        on_measure: Called with a short description before each measurement that was not
            cached (a CLI prints it). Default: none.
    """
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir() / "costs"
    machine = machine_fingerprint()
    target_key = {"what": "verify", "model": model_fingerprint(model), "machine": machine,
                  "context": context_tokens, "grid": VERIFY_GRID}
    stale = []
    checked_key = json.dumps(target_key, sort_keys=True, default=str) + str(cache_dir)

    def still_valid(curve) -> bool:
        if not (isinstance(curve, list) and len(curve) == MAX_VERIFY_TOKENS
                and all(isinstance(v, (int, float)) for v in curve)):
            return False  # a damaged file is measured again
        if checked_key in _CHECKED:  # checked once per process (bench reads it once per drafter)
            return True
        now = spot_check_verify(model)
        if is_stale(curve[0], now):
            stale.append(f"the cached one is stale: one token takes {1e3 * now:.0f} ms now, "
                         f"{1e3 * curve[0]:.0f} ms then")
            return False
        return True

    verify_s = _cached(cache_dir, target_key, refresh, on_measure, "the target's verify cost for 1..16 tokens",
                       lambda: calibrate_verify(model, context_tokens=context_tokens), still_valid, stale)
    _CHECKED.add(checked_key)  # checked or just measured: good for the rest of this process
    draft_s = 0.0
    if drafter is not None and getattr(drafter, "name", "none") != "none":
        gamma = drafter.tree_depth or DRAFT_GAMMA  # a tree drafter's rounds all draft to its depth
        per_round = getattr(drafter, "fixed_round_cost", False)  # a block drafter: one forward whatever γ
        draft_key = {"what": "draft", "drafter": drafter_fingerprint(drafter, model), "machine": machine,
                     "context": context_tokens, "num_draft_tokens": gamma, "per": "round" if per_round else "token"}
        history = np.random.default_rng(1).integers(0, _vocab_size(model), size=context_tokens).tolist()
        hidden_size = getattr(getattr(model, "args", None), "hidden_size", None)
        draft_s = _cached(cache_dir, draft_key, refresh or bool(stale), on_measure,
                          f"the {drafter.name} drafter's cost per {'round' if per_round else 'token'}",
                          lambda: calibrate_draft(drafter, history, num_draft_tokens=gamma, hidden_size=hidden_size)
                          * (gamma if per_round else 1))
        if per_round:
            return Costs(verify_s, 0.0, context_tokens, draft_round_s=draft_s)
    return Costs(verify_s, draft_s, context_tokens)


#: Verify-curve cache entries already checked against the machine in this process.
_CHECKED: set[str] = set()


def _time_forward(model, cache, tokens: list[int]) -> float:
    t0 = time.perf_counter()
    logits = model(mx.array(tokens, dtype=mx.int32)[None], cache=cache)
    mx.eval(logits[0].argmax(axis=-1))
    elapsed = time.perf_counter() - t0
    trim(cache, len(tokens))
    return elapsed


def _non_decreasing(values: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool-adjacent-violators): noise must not make k+1 cheaper than k."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(c)]


def _vocab_size(model) -> int:
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(size) if size else 256


def _cached(cache_dir: Path, key: dict, refresh: bool, on_measure, what: str, measure,
            still_valid: Callable | None = None, why: list[str] | None = None):
    """The cached value for ``key``, else ``measure()`` stored; ``still_valid(value)`` false (it may append
    the reason to ``why``) measures again."""
    blob = json.dumps(key, sort_keys=True, default=str)
    path = cache_dir / f"{key['what']}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"
    if not refresh and path.is_file():
        try:
            value = json.loads(path.read_text())["value"]
        except (ValueError, KeyError, OSError):
            value = None  # a damaged cache file is measured again
        if value is not None and (still_valid is None or still_valid(value)):
            return value
    if on_measure is not None:
        on_measure(f"{what} ({why[-1]})" if why else what)
    value = measure()
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps({"key": json.loads(blob), "value": value, "measured_at": time.time()}))
    partial.replace(path)
    return value


# ---------------------------------------------------------------- fingerprints


def model_fingerprint(model: nn.Module) -> dict:
    """What a model's speed depends on: class, config, parameter count, dtypes, quantization."""
    args = getattr(model, "args", None)
    config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else {}
    params = tree_flatten(model.parameters())
    bits = sorted({m.bits for _, m in model.named_modules() if hasattr(m, "bits") and hasattr(m, "group_size")})
    return {"class": f"{type(model).__module__}.{type(model).__name__}", "config": config,
            "parameters": int(sum(p.size for _, p in params)),
            "dtypes": sorted({str(p.dtype) for _, p in params}), "quantized_bits": bits}


#: Drafter settings that change what a round costs (read when the drafter has them).
_DRAFTER_SETTINGS = ("tree_depth", "max_draft_tokens", "depth", "top_k", "total_tokens", "ngram", "lazy",
                     "draft_vocab")


def drafter_fingerprint(drafter, target: nn.Module) -> dict:
    """What a drafter's cost per token depends on besides the machine: its kind and settings, the
    target (whose embedding and LM head head drafters run), and each model it holds (a draft model,
    heads; ``weights_fingerprint``)."""
    modules = {name: value for name, value in vars(drafter).items() if isinstance(value, nn.Module)}
    choices = getattr(drafter, "choices", None)
    settings = {name: getattr(drafter, name) for name in _DRAFTER_SETTINGS if hasattr(drafter, name)}
    return {"drafter": drafter.name, "class": f"{type(drafter).__module__}.{type(drafter).__name__}",
            "settings": {**settings, "tree_nodes": len(choices) if choices is not None else None,
                         "priced": getattr(drafter, "budget", None) is not None},
            "target": model_fingerprint(target),
            "weights": {name: weights_fingerprint(module) for name, module in sorted(modules.items())}}


def weights_fingerprint(module: nn.Module, sample: int = 64) -> dict:
    """A module's fingerprint (``model_fingerprint``) plus its weights' identity: a digest of every
    parameter's name, shape, dtype and a few hundred strided values (cheap even for a draft model)."""
    digest = hashlib.sha256()
    for name, p in tree_flatten(module.parameters()):
        flat = p.reshape(-1)
        picked = mx.concatenate([flat[:sample], flat[:: max(1, flat.size // sample)][:sample]])
        digest.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        digest.update(np.array(picked.astype(mx.float32)).tobytes())
    return {**model_fingerprint(module), "weights": digest.hexdigest()[:16]}
