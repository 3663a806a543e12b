"""This machine's costs (the target's verify curve, a drafter's cost), measured once, cached and corrected by
the rounds they price, and the speed-up they predict:
τ(γ) · T_verify(1) / (T_draft(γ) + T_verify(nodes(γ) + 1)) (Leviathan et al. 2023, arXiv 2211.17192,
section 3): 8 tokens verify for 1.8x one step here, 7x there."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from ..core.cache import prefill, speculative_cache, trim
from ..runtime.distributed import check_measured
from ..runtime.files import written_whole
from ..loading.models import default_cache_dir
from ..runtime.progress import progress_bar
from ..runtime.machine import blas_in_use, cpu_name
from ..core.sampling import SamplingParams

#: Largest verify width measured (γ + 1 ≤ this, so γ auto drafts at most 15).
MAX_VERIFY_TOKENS = 16
#: Context the costs are measured at (attention cost grows with it).
DEFAULT_CONTEXT_TOKENS = 256
#: Widths measured; the others in 1..16 are interpolated.
VERIFY_GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
#: γ of the timed draft round of a drafter that does not size its own rounds.
DRAFT_GAMMA = 4
#: Batch sizes R and widths k at which a forward over R rows × k tokens is measured (R = 1 is ``verify_s``).
ROWS_GRID, ROWS_WIDTHS = (2, 4, 8), (1, 2, 4, 8, 16)


def expected_tau(alpha: float, gamma: int) -> float:
    """τ = (1 − α^(γ+1)) / (1 − α): expected tokens per round at acceptance α
    (Leviathan et al. 2023, eq. 1)."""
    if gamma <= 0:
        return 1.0
    return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclasses.dataclass
class Costs:
    """Measured costs of one target (+ one drafter) on one machine: ``verify_s[k - 1]`` = seconds of a forward
    over k = 1..16 tokens and the host read that ends a round (``[0]``: a plain step); ``draft_s`` per drafted
    token, ``draft_round_s`` per round that drafts (a block drafter's one forward); at ``context_tokens``;
    ``rows_s[i][j]`` = a forward over ``ROWS_GRID[i]`` rows × ``ROWS_WIDTHS[j]`` tokens (``None``: not
    measured)."""

    verify_s: list[float]
    draft_s: float = 0.0
    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    draft_round_s: float = 0.0
    rows_s: list[list[float]] | None = None

    def verify(self, num_tokens: int) -> float:
        """T_verify(k) in seconds; beyond the measured range, extrapolated linearly."""
        n = len(self.verify_s)
        if num_tokens <= n:
            return self.verify_s[max(num_tokens, 1) - 1]
        return self.verify_s[-1] + (self.verify_s[-1] - self.verify_s[0]) / max(n - 1, 1) * (num_tokens - n)

    def verify_rows(self, rows: int, width: int) -> float:
        """Seconds of one forward over ``rows`` rows × ``width`` tokens each: ``rows_s`` interpolated linearly
        in width and in rows (extrapolated past 8 rows); unmeasured, one row over rows × width tokens."""
        if rows <= 1 or self.rows_s is None:
            return self.verify(rows * width)
        at = [float(np.interp(width, ROWS_WIDTHS, curve)) for curve in self.rows_s]  # per grid R
        grid, at = [1, *ROWS_GRID], [self.verify(width), *at]
        if rows <= grid[-1]:
            return float(np.interp(rows, grid, at))
        return at[-1] + (at[-1] - at[-2]) / (grid[-1] - grid[-2]) * (rows - grid[-1])

    def draft(self, gamma: int) -> float:
        """Seconds of drafting a round of depth γ."""
        return (self.draft_round_s if gamma > 0 else 0.0) + gamma * self.draft_s

    def speedup(self, gamma: int, reach: float | list[float], nodes: tuple[int, ...] | None = None) -> float:
        """Predicted speed-up over plain decoding of a round of depth γ (γ = 0: exactly 1).
        ``reach[i]`` = P(the draft at depth i + 1 is kept), at least γ long, or one α (geometric);
        ``nodes[d - 1]`` = draft nodes a depth-d round verifies (``DraftProfile.nodes``; None: d)."""
        reach = [reach ** (i + 1) for i in range(gamma)] if isinstance(reach, (int, float)) else reach
        width = (nodes[min(gamma, len(nodes)) - 1] if nodes and gamma else gamma) + 1
        return (1.0 + sum(reach[:gamma])) * self.verify(1) / (self.draft(gamma) + self.verify(width))

    def observe(self, stats) -> None:
        """Told each round's ``RoundStats``; measured costs as given learn nothing (``LearnedCosts`` do)."""

    def best_gamma(self, reach: float | list[float], max_gamma: int, margin: float = 0.0,
                   nodes: tuple[int, ...] | None = None) -> int:
        """The γ in 1..max_gamma with the best predicted speed-up, or 0 when none beats
        plain by ``margin``."""
        best = max(range(1, max_gamma + 1), key=lambda g: self.speedup(g, reach, nodes), default=0)
        return best if best and self.speedup(best, reach, nodes) > 1.0 + margin else 0


class LearnedCosts(Costs):
    """``Costs`` kept honest by the rounds they price (a curve measured under load corrects itself).

    A round's seconds are P + ρ · E, E = T_draft(depth) + T(nodes + 1) − T(1) the extra the cache predicts
    over a plain step: P (a plain step now) is the running mean of rounds that drafted nothing (weight 1/2;
    the cache's T(1) before one), ρ the least-squares fit of seconds − P = ρ · E over drafting rounds,
    forgetting by 1/8 a round (1 before one). ``verify(k)`` = P + ρ (T(k) − T(1)), ``draft(γ)`` = ρ
    T_draft(γ): one drafting round timed after a plain one fixes ρ whatever factor the cache was off. An
    answer's first round (warm-ups) teaches nothing."""

    def __init__(self, costs: Costs):
        super().__init__(
            list(costs.verify_s), costs.draft_s, costs.context_tokens, costs.draft_round_s, costs.rows_s
        )
        self.plain_s, self.fit = None, [0.0, 0.0]  # P, and the decayed Σ (seconds − P) · E and Σ E²

    def __eq__(self, other) -> bool:  # as the measured costs it corrects
        return isinstance(other, Costs) and dataclasses.astuple(self) == dataclasses.astuple(other)

    @property
    def extra(self) -> float:
        """ρ: the seconds a drafting round took beyond a plain step per second of it the cache predicted."""
        return max(self.fit[0] / self.fit[1], 0.0) if self.fit[1] > 0 else 1.0

    def verify(self, num_tokens: int) -> float:
        plain_s = self.plain_s or self.verify_s[0]
        return plain_s + self.extra * (super().verify(num_tokens) - self.verify_s[0])

    def draft(self, gamma: int) -> float:
        return self.extra * super().draft(gamma)

    def observe(self, stats) -> None:
        """Fold in one ``RoundStats``: ``verify_s`` of a round that drafted nothing, else
        ``draft_s + verify_s``."""
        if stats.round == 0 or stats.verify_s <= 0 or stats.rows > 1:
            return  # a round verified beside other rows timed the batch's forward, not this row's
        one, self.fit = self.verify_s[0], [self.fit[0] * 7 / 8, self.fit[1] * 7 / 8]
        if not stats.num_drafted:
            self.plain_s = stats.verify_s if self.plain_s is None else (self.plain_s + stats.verify_s) / 2
            return
        extra = max(super().draft(stats.depth) + super().verify(stats.num_drafted + 1) - one, 0.01 * one)
        seconds = stats.draft_s + stats.verify_s - (self.plain_s or one)
        self.fit = [self.fit[0] + seconds * extra, self.fit[1] + extra**2]


# ---------------------------------------------------------------- measuring


def calibrate_verify(model: nn.Module, *, context_tokens: int = DEFAULT_CONTEXT_TOKENS, budget_s: float = 6.0,
                     seed: int = 0) -> list[float]:
    """``[k - 1]`` = seconds of one target forward over k = 1..16 tokens after ``context_tokens``,
    ending with the host read a round makes: ``VERIFY_GRID`` timed (up to 5 times within ``budget_s``;
    medians), interpolated."""
    rng = np.random.default_rng(seed)
    cache = speculative_cache(model)  # the cache the loop verifies on (sliding windows made rewindable)
    prefill(model, cache, rng.integers(0, _vocab_size(model), size=context_tokens).tolist())
    block = rng.integers(0, _vocab_size(model), size=MAX_VERIFY_TOKENS).tolist()
    for k in (1, MAX_VERIFY_TOKENS):  # warm-up
        _time_forward(model, cache, block[:k])
    samples: dict[int, list[float]] = {k: [] for k in VERIFY_GRID}
    start = time.perf_counter()
    with progress_bar(5 * len(VERIFY_GRID), "mlxspec: measuring the verify cost", "forward") as bar:
        for rep in range(5):
            for k in VERIFY_GRID:
                samples[k].append(_time_forward(model, cache, block[:k]))
                bar.update()
            if (time.perf_counter() - start) * (rep + 2) / (rep + 1) > budget_s:
                break
    curve = np.interp(np.arange(1, MAX_VERIFY_TOKENS + 1), VERIFY_GRID,
                      [statistics.median(samples[k]) for k in VERIFY_GRID])
    return np.maximum.accumulate(curve).tolist()  # noise must not make k + 1 tokens cheaper than k


def calibrate_rows(model: nn.Module, *, context_tokens: int = DEFAULT_CONTEXT_TOKENS, budget_s: float = 12.0,
                   seed: int = 0) -> list[list[float]]:
    """``[i][j]`` = seconds of one target forward over ``ROWS_GRID[i]`` rows × ``ROWS_WIDTHS[j]`` tokens each,
    every row after ``context_tokens`` of its own in mlx-lm's ``BatchKVCache`` (as a batch verifies), ending
    with the host read: each timed up to 3 times within ``budget_s`` (medians)."""
    rng = np.random.default_rng(seed)
    rows, vocab = max(ROWS_GRID), _vocab_size(model)
    cache = [BatchKVCache([0] * rows) for _ in make_prompt_cache(model)]
    model(mx.array(rng.integers(0, vocab, size=(rows, context_tokens)), dtype=mx.int32), cache=cache)
    block = mx.array(rng.integers(0, vocab, size=(rows, max(ROWS_WIDTHS))), dtype=mx.int32)
    curves = []
    with progress_bar(3 * len(ROWS_GRID) * len(ROWS_WIDTHS), "mlxspec: measuring the batched verify cost",
                      "forward") as bar:
        for r in sorted(ROWS_GRID, reverse=True):  # the batch shrinks by filtering its rows
            for layer in cache:
                layer.filter(mx.arange(r))
            _time_forward(model, cache, block[:r, :1])  # warm-up
            samples, start = {k: [] for k in ROWS_WIDTHS}, time.perf_counter()
            for rep in range(3):
                for k in ROWS_WIDTHS:
                    samples[k].append(_time_forward(model, cache, block[:r, :k]))
                    bar.update()
                if (time.perf_counter() - start) * (rep + 2) / (rep + 1) > budget_s / len(ROWS_GRID):
                    break
            curves.append(
                np.maximum.accumulate([statistics.median(samples[k]) for k in ROWS_WIDTHS]).tolist()
            )
    return curves[::-1]


def calibrate_draft(drafter, history: list[int], *, num_draft_tokens: int = DRAFT_GAMMA, reps: int = 3,
                    hidden_size: int | None = None) -> float:
    """Seconds per drafted token: ``drafter.propose`` of γ tokens, timed to the sync (a feature reader gets
    zeros ``hidden_size`` wide per feature layer); each timed round keeps nothing, so every round drafts."""
    width = (hidden_size or 0) * max(1, len(drafter.feature_layers))  # EAGLE-3 reads 3 layers
    zeros = (lambda n: [mx.zeros((n, width))]) if drafter.needs_hidden else (lambda n: [])
    history = list(history)
    drafter.prefill(history, *zeros(len(history) - 1))
    times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        draft = drafter.propose(history, num_draft_tokens, SamplingParams())
        mx.eval(draft.tokens)
        if rep:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
        history.append(history[-1])
        drafter.commit(len(history), [], *zeros(draft.size + 1))
    return statistics.median(times) / num_draft_tokens


def load_or_calibrate(model: nn.Module, drafter=None, *, cache_dir: Path | None = None,
                      context_tokens: int = DEFAULT_CONTEXT_TOKENS, refresh: bool = False,
                      on_measure: Callable[[str], None] | None = None, rows: bool = False) -> Costs:
    """``Costs`` for ``model`` and ``drafter`` on this machine, measured once and then cached.

    Keyed by the target and the machine (``machine_fingerprint``), the draft cost also by the drafter
    (``drafter_fingerprint``; timed at its ``DraftProfile.max_depth``, per round when ``per_round``). Measured
    again when damaged, never for the machine's load (``LearnedCosts`` correct that). A cache folder that
    cannot be written is said once on stderr; the costs then live in the process.

    Args: ``model``, ``drafter`` (or ``None``: draft cost 0), ``cache_dir`` (default
    ``$MLXSPEC_CACHE/costs``), ``context_tokens`` (256, the measurements' prefix), ``refresh`` (measure
    again), ``on_measure`` (told before each measurement that was not cached), ``rows`` (also the batched
    verify cost, ``Costs.rows_s``).
    Raises ``ValueError`` for a sharded target (``distributed.check_measured``: each rank would measure
    its own).
    """
    check_measured(model)
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir() / "costs"
    machine = machine_fingerprint()
    target_key = {"what": "verify", "model": model_fingerprint(model), "machine": machine,
                  "context": context_tokens, "grid": VERIFY_GRID}

    def valid(curve) -> bool:  # a damaged file is measured again
        return (isinstance(curve, list) and len(curve) == MAX_VERIFY_TOKENS
                and all(isinstance(v, (int, float)) for v in curve))

    verify_s = _cached(cache_dir, target_key, refresh, on_measure,
                       "the target's verify cost for 1..16 tokens",
                       lambda: calibrate_verify(model, context_tokens=context_tokens), valid)
    rows_key = {**target_key, "what": "rows", "grid": [ROWS_GRID, ROWS_WIDTHS]}
    rows_s = None
    if rows:
        rows_s = _cached(cache_dir, rows_key, refresh, on_measure, "the target's cost of verifying 2-8 rows",
                         lambda: calibrate_rows(model, context_tokens=context_tokens))
    if drafter is None or drafter.profile.plain:
        return Costs(verify_s, 0.0, context_tokens, rows_s=rows_s)
    profile = drafter.profile
    gamma, per = profile.max_depth or DRAFT_GAMMA, "round" if profile.per_round else "token"
    key = {"what": "draft", "drafter": drafter_fingerprint(drafter, model), "machine": machine,
           "context": context_tokens, "num_draft_tokens": gamma, "per": per}
    history = np.random.default_rng(1).integers(0, _vocab_size(model), size=context_tokens).tolist()
    hidden_size = getattr(getattr(model, "args", None), "hidden_size", None)
    draft_s = _cached(cache_dir, key, refresh, on_measure, f"the {drafter.name} drafter's cost per {per}",
                      lambda: calibrate_draft(drafter, history, num_draft_tokens=gamma,
                                              hidden_size=hidden_size)
                      * (gamma if profile.per_round else 1))
    if profile.per_round:
        return Costs(verify_s, 0.0, context_tokens, draft_s, rows_s)
    return Costs(verify_s, draft_s, context_tokens, rows_s=rows_s)


#: Cache folders said unwritable, and the values measured there (kept for this process).
_UNWRITABLE, _UNWRITTEN = set(), {}


def _time_forward(model, cache, tokens: list[int] | mx.array) -> float:
    """Seconds of a forward over ``tokens`` (a row's ids, or int32 [R, k]) and the host read; then trimmed."""
    batch = tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.int32)[None]
    t0 = time.perf_counter()
    mx.eval(model(batch, cache=cache).argmax(axis=-1))
    elapsed = time.perf_counter() - t0
    trim(cache, batch.shape[1])
    return elapsed


def _vocab_size(model) -> int:
    return int(getattr(getattr(model, "args", None), "vocab_size", None) or 256)


def _cached(cache_dir: Path, key: dict, refresh: bool, on_measure, what: str, measure,
            valid: Callable | None = None):
    """The cached value for ``key``, else ``measure()``, stored when the folder takes it."""
    blob = json.dumps(key, sort_keys=True, default=str)
    path = cache_dir / f"{key['what']}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json"
    if not refresh and str(path) in _UNWRITTEN:
        return _UNWRITTEN[str(path)]
    if not refresh and path.is_file():
        try:
            value = json.loads(path.read_text())["value"]
        except (ValueError, KeyError, OSError):
            value = None  # a damaged cache file is measured again
        if value is not None and (valid is None or valid(value)):
            return value
    if on_measure is not None:
        on_measure(what)
    value = measure()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with written_whole(path) as partial:
            partial.write_text(
                json.dumps({"key": json.loads(blob), "value": value, "measured_at": time.time()})
            )
    except OSError as error:
        _UNWRITTEN[str(path)] = value
        if str(cache_dir) not in _UNWRITABLE:
            _UNWRITABLE.add(str(cache_dir))
            print(f"mlxspec: measured costs are not cached: cannot write {cache_dir} "
                  f"({error.strerror or error}); set MLXSPEC_CACHE to a writable folder to keep them",
                  file=sys.stderr)
    return value


# ---------------------------------------------------------------- fingerprints


def machine_fingerprint() -> dict:
    """What costs depend on besides the model: CPU, cores, OS, BLAS, MLX version and device."""
    return {"system": platform.system(), "arch": platform.machine(), "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "blas": blas_in_use()["name"], "mlx": mx.__version__, "device": str(mx.default_device())}


def model_fingerprint(model: nn.Module) -> dict:
    """What a model's speed depends on: class, config, parameters, dtypes, quantization."""
    args = getattr(model, "args", None)
    params = tree_flatten(model.parameters())
    bits = sorted({m.bits for _, m in model.named_modules()
                   if hasattr(m, "bits") and hasattr(m, "group_size")})
    return {"class": f"{type(model).__module__}.{type(model).__name__}",
            "config": dataclasses.asdict(args) if dataclasses.is_dataclass(args) else {},
            "parameters": int(sum(p.size for _, p in params)),
            "dtypes": sorted({str(p.dtype) for _, p in params}), "quantized_bits": bits}


def drafter_fingerprint(drafter, target: nn.Module) -> dict:
    """What a drafter's cost depends on besides the machine: its kind and settings (``describe()``, its
    profile), the target, and each model it holds (``weights_fingerprint``)."""
    modules = {name: value for name, value in vars(drafter).items() if isinstance(value, nn.Module)}
    return {"drafter": drafter.name, "class": f"{type(drafter).__module__}.{type(drafter).__name__}",
            "settings": {"describe": drafter.describe(), "profile": repr(drafter.profile)},
            "target": model_fingerprint(target),
            "weights": {name: weights_fingerprint(module) for name, module in sorted(modules.items())}}


def weights_fingerprint(module: nn.Module, sample: int = 64) -> dict:
    """``model_fingerprint`` plus a digest of every parameter's name, shape, dtype and a
    few strided values."""
    digest = hashlib.sha256()
    for name, p in tree_flatten(module.parameters()):
        flat = p.reshape(-1)
        picked = mx.concatenate([flat[:sample], flat[:: max(1, flat.size // sample)][:sample]])
        digest.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        digest.update(np.array(picked.astype(mx.float32)).tobytes())
    return {**model_fingerprint(module), "weights": digest.hexdigest()[:16]}
