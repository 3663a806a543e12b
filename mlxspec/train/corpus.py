"""A self-distillation corpus: the target's own greedy answers, with its features, in one pass.

Draft heads and draft models are judged by how often they guess what the *target* says next,
so the best training text is the target's own output (Medusa arXiv 2401.10774 section 2.3.2;
EAGLE arXiv 2401.15077 section 4 notes the same for fixed data). ``build_corpus`` answers
prompts with the frozen target, greedily and in batches (left-padded through mlx-lm's
``BatchKVCache``), and records during that same decoding everything the trainers read, so no
second pass over the text is needed:

- ``tokens`` [N] int32 and ``mask`` [N] bool (true on answer tokens, their end token included);
- ``hidden`` [N, H] float16: the final normalised hidden state at each position (it predicts
  token t + 1; Medusa and EAGLE-1/2 features);
- ``aux`` [N, 3, H] float16: the residual stream entering the decoder layers listed in the
  manifest's ``aux_layers`` (EAGLE-3's low/mid/high features, docs/heads.md 5.1 convention);
- ``greedy`` [N] int32: the target's argmax at t (-1 where token t + 1 is not an answer token);
- ``topk_ids`` [N, K] int32, ``topk_logprobs`` [N, K] float16: the target's K most likely next
  tokens and their log-probabilities (temperature 1, normalised over the full vocabulary) at t;
  ids 0 and log-prob -inf where token t + 1 is not an answer token.

With ``answers`` given (``mlxspec train corpus --answers data``), the answers are the dataset's own
and the target only *reads* each example, in one forward over prompt + answer: the features and
the top-k labels are still the target's, at every answer position, but nothing is decoded. On a
CPU that is several times faster than decoding (one unpadded forward per example instead of one
step per token), which is what makes a corpus affordable for a 1.5B target on two cores;
``greedy`` is then the target's argmax, which need not be the next token of the text. EAGLE
trains on fixed data this way (arXiv 2401.15077 section 4: "low sensitivity to training data").

Examples are concatenated per chunk and delimited by ``offsets`` [E + 1]; the folder is read by
``features.FeatureCache`` like extracted features. One batch of prompts is one chunk, written
atomically and listed in ``manifest.json`` when complete, so an interrupted build resumes at the
next batch, and a time budget stops it cleanly between batches.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from ..core.taps import HiddenTap, output_head
from .store import MANIFEST, StoreProgress, model_fingerprint, open_manifest, write_chunk, write_json

CORPUS_VERSION = 1
DEFAULT_TOPK = 32


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's feature layers: the inputs of decoder layers 2, N // 2 and N - 3 (docs/heads.md 5.1)."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


def build_corpus(model: nn.Module, tokenizer, prompts: list[list[int]], directory: str | Path, *,
                 answers: list[list[int]] | None = None,
                 max_new_tokens: int = 256, batch_size: int = 32, topk: int = DEFAULT_TOPK,
                 aux_layers: tuple[int, ...] | None = None,
                 time_budget_s: float | None = None) -> Iterator[StoreProgress]:
    """Answer ``prompts`` greedily with the target and store its features (see the module doc).

    Args:
        model: The target (float32 for faithful features), an mlx-lm model.
        tokenizer: Its tokenizer (``eos_token_ids`` end an answer).
        prompts: Prompt token ids (chat template applied, generation prompt added), in the order
            they are batched; sort them by length to waste less work on padding.
        directory: The corpus folder; an existing corpus of the same model and settings resumes.
        answers: The dataset's answers to ``prompts`` (token ids, end token included), one list per
            prompt: the target reads them instead of answering (see the module doc); each is cut to
            ``max_new_tokens``. Default: ``None``, the target answers greedily.
        max_new_tokens: Longest answer, tokens. Default: ``256``.
        batch_size: Prompts decoded together (one chunk each). Default: ``32``.
        topk: Soft labels kept per position. Default: ``32``.
        aux_layers: Decoder layers whose inputs are recorded. Default: ``default_aux_layers``.
        time_budget_s: Start no new batch once this many seconds have passed (at least one
            batch is always answered). Default: no limit.

    Yields:
        ``StoreProgress`` in prompts after each batch (``computed``: answer tokens generated in this call).

    Raises:
        ValueError: if ``directory`` holds a corpus of another model, other prompts or settings,
            or a parameter is out of range (or ``answers`` does not match ``prompts``).
    """
    if max_new_tokens < 1 or batch_size < 1 or topk < 1:
        raise ValueError("max_new_tokens, batch_size and topk must be >= 1")
    if answers is not None:
        if len(answers) != len(prompts) or not all(answers):
            raise ValueError("answers must hold one non-empty answer per prompt")
        answers = [list(a[:max_new_tokens]) for a in answers]
    layers = model.model.layers
    aux_layers = tuple(aux_layers) if aux_layers is not None else default_aux_layers(len(layers))
    directory = Path(directory)
    settings = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "topk": topk,
                "aux_layers": list(aux_layers), "answers": "target" if answers is None else "data"}
    manifest = _open_manifest(directory, model, prompts if answers is None else
                              [p + [-1] + a for p, a in zip(prompts, answers)], settings)
    tap = HiddenTap(model, layers=aux_layers)
    lm_head = output_head(model)
    eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    start, generated = time.perf_counter(), 0
    num_chunks = -(-len(prompts) // batch_size)
    for b, lo in enumerate(range(0, len(prompts), batch_size)):
        hi = min(lo + batch_size, len(prompts))
        if b < len(manifest["chunks"]):
            yield StoreProgress(b, num_chunks, hi, len(prompts), generated, time.perf_counter() - start, True)
            continue
        if answers is None:
            arrays = _answer_batch(model, tap, lm_head, prompts[lo:hi], eos, max_new_tokens, topk, aux_layers)
        else:
            arrays = _read_batch(model, tap, lm_head, prompts[lo:hi], answers[lo:hi], topk, aux_layers)
        generated += int(arrays["mask"].sum())
        name = f"chunk-{b:05d}.npz"
        write_chunk(directory / name, arrays)
        manifest["chunks"].append({"file": name, "examples": [lo, hi], "tokens": int(len(arrays["tokens"])),
                                   "complete": True})
        manifest["tokens"] += int(len(arrays["tokens"]))
        manifest["masked_tokens"] += int(arrays["mask"].sum())
        manifest["examples"] = hi
        write_json(directory / MANIFEST, manifest)
        mx.clear_cache()
        yield StoreProgress(b, num_chunks, hi, len(prompts), generated, time.perf_counter() - start, False)
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            return


def _answer_batch(
    model,
    tap: HiddenTap,
    lm_head,
    prompts: list[list[int]],
    eos: list[int],
    max_new_tokens: int,
    topk: int,
    aux_layers: tuple[int, ...],
) -> dict[str, np.ndarray]:
    """Greedy answers for one batch; returns the chunk's arrays."""
    B, longest = len(prompts), max(len(p) for p in prompts)
    padding = [longest - len(p) for p in prompts]
    cache = [BatchKVCache(padding) for _ in model.model.layers]
    x = mx.array([[0] * pad + p for pad, p in zip(padding, prompts)], dtype=mx.int32)
    model.model(x, cache=cache)
    hidden = [tap.final.astype(mx.float16)]  # per step [B, T, H]
    aux = [mx.stack([tap.layer_input(i) for i in aux_layers], axis=2).astype(mx.float16)]  # [B, T, 3, H]
    eos_ids = mx.array(eos, dtype=mx.int32) if eos else None
    steps, ids, logps, active = [], [], [], mx.ones((B,), dtype=mx.bool_)
    last = tap.final[:, -1]
    for step in range(max_new_tokens):
        top_ids, top_logp = _topk(lm_head(last), topk)  # [B, K] each
        ids.append(top_ids)
        logps.append(top_logp)
        token = ids[-1][:, 0].astype(mx.int32)
        steps.append(token)
        if eos_ids is not None:
            active = active & ~mx.any(token[:, None] == eos_ids[None], axis=-1)
        model.model(token[:, None], cache=cache)  # every answer token gets its hidden state
        hidden.append(tap.final.astype(mx.float16))
        aux.append(mx.stack([tap.layer_input(i) for i in aux_layers], axis=2).astype(mx.float16))
        last = tap.final[:, -1]
        mx.eval(hidden[-1], aux[-1], ids[-1], logps[-1], active)
        if step % 8 == 7 and not active.any().item():
            break
    return _pack(prompts, padding, eos, mx.stack(steps, axis=1), mx.concatenate(hidden, axis=1),
                 mx.concatenate(aux, axis=1), mx.stack(ids, axis=1), mx.stack(logps, axis=1))


def _topk(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ``k`` most likely ids and their log-softmax (full vocabulary, temperature 1), best first.

    Args:
        logits: [..., V] (any float dtype).

    Returns:
        ids [..., k] (uint32) and log-probabilities [..., k] (float32), sorted by decreasing log-probability.
    """
    logits = logits.astype(mx.float32)
    # log_softmax = logits - logsumexp; selecting on the logits is ~8x faster on a CPU than on log_softmax's
    # output
    best = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
    best_logp = mx.take_along_axis(logits, best, axis=-1) - mx.logsumexp(logits, axis=-1, keepdims=True)
    order = mx.argsort(-best_logp, axis=-1)
    return mx.take_along_axis(best, order, axis=-1), mx.take_along_axis(best_logp, order, axis=-1)


def _read_batch(model, tap: HiddenTap, lm_head, prompts: list[list[int]], answers: list[list[int]], topk: int,
                aux_layers: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The target reads each prompt + given answer in one unpadded forward; returns the chunk's arrays."""
    examples = []
    for prompt, answer in zip(prompts, answers):
        L, n = len(prompt), len(prompt) + len(answer)
        model.model(mx.array(prompt + answer, dtype=mx.int32)[None])
        hidden = tap.final[0]  # [n, H]
        aux = mx.stack([tap.layer_input(i)[0] for i in aux_layers], axis=1)  # [n, 3, H]
        ids, logps = _topk(lm_head(hidden[L - 1 : n - 1]), topk)  # position L-1+s predicts answer[s]
        hidden, aux, logps = hidden.astype(mx.float16), aux.astype(mx.float16), logps.astype(mx.float16)
        mx.eval(hidden, aux, ids, logps)
        examples.append(
            _example(prompt, answer, np.array(hidden), np.array(aux), np.array(ids), np.array(logps))
        )
    return _concatenate(examples)


def _example(prompt: list[int], answer: list[int], hidden: np.ndarray, aux: np.ndarray, ids: np.ndarray,
             logps: np.ndarray) -> dict[str, np.ndarray]:
    """One example's arrays from its features [n, ...] and the top-k [A, K] at positions L-1 .. n-2."""
    L, A = len(prompt), len(answer)
    n, topk = L + A, ids.shape[-1]
    k_ids = np.zeros((n, topk), dtype=np.int32)
    k_logp = np.full((n, topk), -np.inf, dtype=np.float16)
    k_ids[L - 1 : n - 1], k_logp[L - 1 : n - 1] = ids[:A], logps[:A]
    greedy = np.full(n, -1, dtype=np.int32)
    greedy[L - 1 : n - 1] = ids[:A, 0]
    mask = np.zeros(n, dtype=bool)
    mask[L:] = True
    return {"tokens": np.array(prompt + answer, dtype=np.int32), "mask": mask, "hidden": hidden, "aux": aux,
            "greedy": greedy, "topk_ids": k_ids, "topk_logprobs": k_logp}


def _concatenate(examples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """A chunk: the examples' arrays end to end, delimited by ``offsets`` [E + 1]."""
    arrays = {k: np.concatenate([e[k] for e in examples]) for k in examples[0]}
    arrays["offsets"] = np.cumsum([0] + [len(e["tokens"]) for e in examples]).astype(np.int64)
    return arrays


def _pack(prompts, padding, eos, steps, hidden, aux, ids, logps) -> dict[str, np.ndarray]:
    """Cut each row to its prompt + answer (ending at its first end token) and concatenate."""
    steps, hidden, aux = np.array(steps), np.array(hidden), np.array(aux)
    ids, logps = np.array(ids), np.array(logps.astype(mx.float16))
    eos, examples = set(eos), []
    for i, (prompt, pad) in enumerate(zip(prompts, padding)):
        answer = []
        for token in steps[i]:
            answer.append(int(token))
            if int(token) in eos:
                break
        n = len(prompt) + len(answer)
        examples.append(
            _example(prompt, answer, hidden[i, pad : pad + n], aux[i, pad : pad + n], ids[i], logps[i])
        )
    return _concatenate(examples)


def _open_manifest(directory: Path, model, prompts: list[list[int]], settings: dict) -> dict:
    """The corpus's manifest; ``prompts`` are the example token lists the data fingerprint covers."""
    sha = hashlib.sha256(f"corpus-v{CORPUS_VERSION}:{json.dumps(settings, sort_keys=True)};".encode())
    for p in prompts:
        sha.update(np.array(p, dtype=np.int32).tobytes() + b"|")
    args = getattr(model, "args", None)
    manifest = {
        "version": 1, "source": "self-distill" if settings["answers"] == "target" else "data",
        "corpus_version": CORPUS_VERSION,
        "model": model_fingerprint(model), "data": sha.hexdigest()[:16],
        "hidden_size": getattr(args, "hidden_size", None), "vocab_size": getattr(args, "vocab_size", None),
        "prompts": len(prompts), "examples": 0, "tokens": 0, "masked_tokens": 0,
        "topk": settings["topk"], "aux_layers": settings["aux_layers"], "settings": settings, "chunks": [],
    }
    return open_manifest(directory, manifest, "a corpus of another model, other prompts or settings")
