"""Shared steps of the parity tests: committed fixtures made by the authors' code (tests/reference/).

The targets are Hugging Face checkpoint folders (``model.safetensors`` + ``config.json`` + tokenizer),
loaded with ``mlxspec.loading.models.load`` exactly as a user passes ``--model FOLDER`` (mlx-lm reads the
Hugging Face safetensors directly; no conversion step). Heads go through mlxspec's ordinary loaders.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxspec.core.cache import trim
from mlxspec.loading.models import load
from mlxspec.core.sampling import SamplingParams
from mlxspec.core.taps import HiddenTap

FIXTURES = Path(__file__).parent / "fixtures" / "parity"
#: Float32 parity: |mlxspec − reference| <= RTOL · max(1, max |reference|), per array.
RTOL = 1e-4
GREEDY = SamplingParams(temp=0.0)


def reference(name: str) -> dict[str, np.ndarray]:
    """The reference's recorded outputs of fixture ``name`` (``FIXTURES/name/reference.npz`` or
    ``name.npz``)."""
    path = FIXTURES / name / "reference.npz"
    with np.load(path if path.is_file() else FIXTURES / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


def target(name: str = "llama"):
    """The tiny Hugging Face target ``name`` (a folder as a user passes it), loaded through mlxspec."""
    model, _ = load(str(FIXTURES / name))
    return model


def assert_close(actual, expected, what: str) -> None:
    """Float32 parity within ``RTOL`` relative to the reference's scale."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != reference {expected.shape}"
    scale = max(1.0, float(np.max(np.abs(expected))))
    err = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
    assert err <= RTOL * scale, f"{what}: max |mlxspec - reference| = {err:.3g} > {RTOL} x {scale:.3g}"


def features(model, tokens: list[int], layers: tuple[int, ...] = ()) -> mx.array:
    """The target's features of ``tokens`` as a drafter gets them at prefill: [L, F] (final normed
    hidden states, or the inputs of ``layers`` concatenated)."""
    tap = HiddenTap(model, layers)
    model(mx.array([tokens], dtype=mx.int32))
    out = tap.features()[0]
    mx.eval(out)
    return out


def ancestor_mask(parents) -> np.ndarray:
    """Root-first ancestor-or-self mask [N + 1, N + 1] of draft parents (-1 = the root)."""
    n = len(parents) + 1
    mask = np.eye(n, dtype=bool)
    mask[:, 0] = True
    for i, p in enumerate(parents, start=1):
        mask[i] |= mask[p + 1]
    return mask


def match_rows(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Every reference row has one mlxspec row within tolerance (frontier order may differ)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != reference {expected.shape}"
    scale = max(1.0, float(np.max(np.abs(expected))))
    free = list(range(actual.shape[0]))
    for r, row in enumerate(expected):
        errs = [float(np.max(np.abs(actual[i] - row))) for i in free]
        best = int(np.argmin(errs))
        assert errs[best] <= RTOL * scale, (
            f"{what}: reference row {r} has no mlxspec row within {RTOL} ({errs[best]:.3g})"
        )
        free.pop(best)


def greedy_round(model, cache, drafter, tap: HiddenTap, history: list[int], drafts: list[int]) -> list[int]:
    """One greedy round as the block drafters' reference loops run it: the target scores ``[last, *drafts]``,
    the longest prefix equal to its argmax is kept plus the target's next token, the cache is trimmed to it
    and the drafter told. Returns the new history."""
    out = model(mx.array([[history[-1]] + drafts]), cache=cache)[0]
    posterior = np.argmax(np.array(out), axis=-1).tolist()
    accepted = next((i for i, (d, p) in enumerate(zip(drafts, posterior)) if d != p), len(drafts))
    history = history + drafts[:accepted] + [posterior[accepted]]
    trim(cache, len(drafts) - accepted)
    drafter.commit(len(history), list(range(accepted)), tap.features()[0])
    return history
