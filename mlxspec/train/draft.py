"""Distil a small independent draft model from a target's soft labels.

Knowledge distillation (Hinton et al. 2015) for speculative decoding, as in DistillSpec (Zhou et al.
2024, arXiv 2310.08461, section 3: forward KL on the target's own generations works well): the draft is
a small decoder of the target's architecture family (same mlx-lm ``model_type``, tokenizer and
vocabulary, tied embeddings) trained to minimise KL(p || q) between the target's next-token
distribution p and its own q on the answer positions of a self-distillation corpus
(``mlxspec train corpus``, read chunk by chunk through ``features.FeatureCache``).

**Soft labels are top-K truncated.** The corpus keeps the target's K most likely next tokens and their
log-probabilities (K = 32). The loss renormalises them: p̃_k = p_k / Σ_j p_j over the K kept tokens,
and KL(p̃ || q) = Σ_k p̃_k (log p̃_k − log q_k), with q normalised over the *full* vocabulary (one
log-sum-exp over V per position; the LM head and the softmax run only on answer positions). On a
CPU that softmax and the V × H LM head are most of a step (0.7 s per 512 rows for the softmax alone
here), so ``train_vocab`` optionally normalises over the most frequent soft-label tokens plus sampled
negatives instead (sampled softmax, see ``DraftTrainConfig``).

The draft's embeddings (tied to its LM head) start from the target's: copied when the hidden sizes
agree, otherwise projected onto the top-H principal directions (uncentred SVD: the best rank-H
approximation of the embedding matrix) — the draft's logits then start as a low-rank approximation of
the target's for a hidden state in the same subspace.

``DraftTask`` is this method on the shared loop (``loop.fit``); ``train_draft`` runs it and yields the
loop's records, with a ``DraftEvalRecord`` before training and after every epoch. The held-out estimate of α
(Leviathan et al. 2023, section 3.1: α = E[Σ_x min(p(x), q(x))] for sampling at temperature 1) uses the
soft labels, so it sums over the target's top K only: a lower bound of the true value. Top-1
agreement (the draft's argmax equals the target's) is α for greedy decoding. The output folder is an
ordinary mlx-lm model folder (``config.json``, ``model.safetensors``, tokenizer files): ``mlx_lm.load``,
``mlxspec generate --draft-model`` and ``mlx_lm.generate --draft-model`` open it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..core.taps import model_body, output_head
from .features import FeatureCache
from .draft_data import (
    RESUME_KEYS,
    DraftEvalRecord,
    DraftTrainConfig,
    epoch_batches,
    example_ranges,
    load_corpus_chunk,
    make_batch,
    pack_examples,
    split_heldout,
    steps_per_epoch,
    training_vocab,
)
from .loop import EvalRecord, StepRecord, cast_copy, fit

# --- the draft model ---------------------------------------------------------------------------------


def draft_model_config(target: nn.Module, config: DraftTrainConfig) -> dict:
    """An mlx-lm config for a draft of the target's family with the sizes in ``config``.

    Everything not about size (``model_type``, vocabulary, RoPE, norms) is the target's; embeddings
    are tied. Per-layer lists of the target's config (e.g. ``layer_types``) are cut to the draft's
    depth.

    Args:
        target: The target, an mlx-lm model (its ``args`` dataclass is read).
        config: The draft's sizes (``layers``, ``hidden``, ``heads``, ``kv_heads``, ``intermediate_size``).

    Returns:
        dict: The ``config.json`` contents.

    Raises:
        ValueError: the target has no mlx-lm ``args``, or the head counts do not fit H.
    """
    args = getattr(target, "args", None)
    if args is None or not dataclasses.is_dataclass(args):
        raise ValueError("the target is not an mlx-lm model (no ModelArgs); load it with mlxspec.load")
    base = {k: v for k, v in asdict(args).items() if v is not None}
    num_layers = int(base["num_hidden_layers"])
    t_hidden, t_heads = int(base["hidden_size"]), int(base["num_attention_heads"])
    head_dim = int(base.get("head_dim") or t_hidden // t_heads)
    heads = config.heads or max(1, config.hidden // head_dim)
    if config.kv_heads is not None:
        kv_heads = config.kv_heads
    else:
        ratio = max(1, t_heads // int(base.get("num_key_value_heads") or t_heads))
        kv_heads = next(d for d in range(max(1, heads // ratio), 0, -1) if heads % d == 0)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv-heads ({kv_heads})")
    if config.heads is not None and "head_dim" not in base and config.hidden % heads:
        raise ValueError(
            f"hidden ({config.hidden}) must be a multiple of heads ({heads}) for {base['model_type']}"
        )
    inter = config.intermediate_size
    if inter is None:
        inter = max(64, int(round(config.hidden * int(base["intermediate_size"]) / t_hidden / 64)) * 64)
    out = {
        k: (v[: config.layers] if isinstance(v, list) and len(v) == num_layers else v)
        for k, v in base.items()
    }
    out.update(hidden_size=config.hidden, num_hidden_layers=config.layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, intermediate_size=inter, tie_word_embeddings=True)
    if "head_dim" in base:
        out["head_dim"] = head_dim
    return out


def build_draft(model_config: dict) -> nn.Module:
    """An mlx-lm model for ``model_config`` (random weights, float32).

    Raises:
        ValueError: an unknown ``model_type``.
    """
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(model_config)
    return model_class(args_class.from_dict(model_config))


def project_embeddings(embeddings: np.ndarray, hidden: int) -> np.ndarray:
    """The target's embedding matrix projected onto its top ``hidden`` right singular vectors.

    E [V, D] ↦ E P, P [D, H] the eigenvectors of EᵀE with the largest eigenvalues (uncentred PCA,
    i.e. a truncated SVD: E P Pᵀ is the best rank-H approximation of E). With H ≥ D the matrix is
    returned as is, zero-padded to H columns.

    Args:
        embeddings: E, shape [V, D], float.
        hidden: H.

    Returns:
        np.ndarray: shape [V, H], float32.
    """
    e = np.asarray(embeddings, dtype=np.float32)
    v, d = e.shape
    if hidden >= d:
        return np.pad(e, ((0, 0), (0, hidden - d)))
    gram = e.T.astype(np.float64) @ e.astype(np.float64)  # [D, D]
    values, vectors = np.linalg.eigh(gram)
    top = vectors[:, np.argsort(values)[::-1][:hidden]].astype(np.float32)  # [D, H]
    return e @ top


def target_embeddings(target: nn.Module) -> np.ndarray:
    """The target's input embedding matrix [V, D] in float32 (dequantized if needed)."""
    embed = model_body(target).embed_tokens
    vocab = int(target.args.vocab_size)
    rows = [
        np.array(embed(mx.arange(i, min(i + 8192, vocab))).astype(mx.float32)) for i in range(0, vocab, 8192)
    ]
    return np.concatenate(rows)


def init_draft(target: nn.Module, config: DraftTrainConfig) -> tuple[nn.Module, dict]:
    """A fresh draft for ``target``: random decoder layers (seeded), embeddings from the target's.

    Returns:
        tuple[nn.Module, dict]: The model (float32, evaluated) and its mlx-lm config.

    Raises:
        ValueError: as ``draft_model_config``.
    """
    model_config = draft_model_config(target, config)
    mx.random.seed(config.seed)
    model = build_draft(model_config)
    model.set_dtype(mx.float32)
    model_body(model).embed_tokens.weight = mx.array(
        project_embeddings(target_embeddings(target), config.hidden)
    )
    mx.eval(model.parameters())
    return model, model_config


def save_draft(
    folder: str | Path, model: nn.Module, model_config: dict, tokenizer, dtype: str | None = None
) -> Path:
    """Write an mlx-lm model folder: ``model.safetensors``, ``config.json`` and the tokenizer files.

    The tokenizer is the target's (``save_pretrained`` of the Hugging Face tokenizer, also for one
    rebuilt from a GGUF); its end-of-sequence ids go into ``config.json`` (``eos_token_id``) so
    ``mlx_lm.load`` stops where the target does.

    Args:
        folder: Where to write (created).
        model: The draft.
        model_config: Its config (``draft_model_config``).
        tokenizer: The target's ``TokenizerWrapper``.
        dtype: Cast the saved weights to this (``"float16"``...); ``None`` keeps them.

    Returns:
        Path: ``folder``.
    """
    from mlx_lm.utils import save_config, save_model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_model(folder, cast_copy(model, lambda: build_draft(model_config), dtype))
    config = dict(model_config)
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or ())
    if eos:
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    save_config(config, folder / "config.json")
    tokenizer._tokenizer.save_pretrained(str(folder))
    return folder


def draft_step_ms(model: nn.Module, *, context: int = 64, steps: int = 32) -> float:
    """Median wall time of one decode step (one token, KV cache of ``context`` tokens), milliseconds."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, context), dtype=mx.int32), cache=cache))
    token, times = mx.array([[1]]), []
    for _ in range(steps):
        t0 = time.perf_counter()
        token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
        mx.eval(token)
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


# --- loss and scores ---------------------------------------------------------------------------------


def _position_logprobs(model: nn.Module, tokens: mx.array, rows: mx.array, topk_ids: mx.array,
                       candidates: mx.array | None = None, log_weights: mx.array | None = None):
    """log q of the K soft-label tokens at the loss positions, and the draft's logits there.

    tokens [B, T] int32; rows [P] int32 flat indices into B × T; topk_ids [P, K] → ([P, K], [P, V]).
    With ``candidates`` [C] int32, q is normalised over those tokens only (tied embeddings), each
    logit counted exp(``log_weights`` [C]) times in the normaliser, and ``topk_ids`` index into them.
    """
    body = model_body(model)
    hidden = body(tokens)  # [B, T, H], final-normed
    hidden = hidden.reshape(-1, hidden.shape[-1])[rows]  # [P, H]: the LM head only where there is a label
    if candidates is None:
        logits = output_head(model)(hidden).astype(mx.float32)  # [P, V]
    else:
        logits = (hidden @ body.embed_tokens.weight[candidates].T).astype(mx.float32)  # [P, C]
    lse = mx.logsumexp(logits if log_weights is None else logits + log_weights, axis=-1, keepdims=True)
    return mx.take_along_axis(logits, topk_ids, axis=-1) - lse, logits


def distill_loss(
    model: nn.Module,
    tokens: mx.array,
    rows: mx.array,
    topk_ids: mx.array,
    target_probs: mx.array,
    weights: mx.array,
    candidates: mx.array | None = None,
    log_weights: mx.array | None = None,
) -> mx.array:
    """Mean KL(p̃ || q) over the loss positions, nats (Hinton et al. 2015; DistillSpec section 3).

    Args:
        model: The draft.
        tokens: Input ids, shape [B, T], int32 (right-padded).
        rows: Loss positions as flat indices into B × T, shape [P], int32.
        topk_ids: The target's top-K next-token ids there, shape [P, K], int32.
        target_probs: p̃, the renormalised top-K probabilities, shape [P, K], float32 (rows sum to 1).
        weights: 1 for real positions, 0 for padding rows, shape [P], float32.
        candidates: Normalise q over only these token ids, shape [C], int32 (``topk_ids`` then index
            into them; see ``DraftTrainConfig.train_vocab``); ``None``: the full vocabulary.
        log_weights: log of how many tokens each candidate stands for in the normaliser, shape [C],
            float32 (0 for the training vocabulary, log((V − C') / S) for S sampled negatives).

    Returns:
        mx.array: The scalar loss (Σ_k p̃ log p̃ is a constant of the data, kept so the value is a KL).
    """
    q_logprobs, _ = _position_logprobs(model, tokens, rows, topk_ids, candidates, log_weights)
    p_log = mx.log(mx.maximum(target_probs, 1e-30))
    kl = (target_probs * (p_log - q_logprobs)).sum(axis=-1)  # [P]
    return (kl * weights).sum() / mx.maximum(weights.sum(), 1.0)


def score_batch(model: nn.Module, batch: dict) -> mx.array:
    """Sums over a batch's positions: [KL(p̃ || q), Σ_topK min(p, q), top-1 agreement, positions] (lazy)."""
    q_logprobs, logits = _position_logprobs(model, batch["tokens"], batch["rows"], batch["topk_ids"])
    p, p_tilde, w = batch["target_raw_probs"], batch["target_probs"], batch["weights"]
    kl = (p_tilde * (mx.log(mx.maximum(p_tilde, 1e-30)) - q_logprobs)).sum(axis=-1)
    overlap = mx.minimum(p, mx.exp(q_logprobs)).sum(axis=-1)
    target_top1 = mx.take_along_axis(batch["topk_ids"], mx.argmax(p, axis=-1, keepdims=True), axis=-1)[:, 0]
    agree = (mx.argmax(logits, axis=-1) == target_top1).astype(mx.float32)
    return mx.stack([(kl * w).sum(), (overlap * w).sum(), (agree * w).sum(), w.sum()])


def evaluate(
    model: nn.Module,
    cache: FeatureCache,
    *,
    examples: dict[int, list[tuple[int, int]]] | None = None,
    batch_tokens: int = 2048,
    max_seq_length: int = 512,
    max_positions: int = 4096,
) -> EvalRecord:
    """Held-out KL, top-K α estimate and top-1 agreement on the first ``max_positions`` answer positions.

    Args:
        model: The draft.
        cache: A corpus (``topk_ids``/``topk_logprobs`` soft labels).
        examples: Per chunk, the ``(start, end)`` token ranges to score; ``None``: every example.
        batch_tokens, max_seq_length: As in ``DraftTrainConfig``.
        max_positions: Stop after this many positions (whole batches).

    Returns:
        DraftEvalRecord: with ``epoch`` 0 (the caller sets it).
    """
    totals = mx.zeros((4,))
    for c in sorted(examples) if examples is not None else range(cache.num_chunks):
        arrays = load_corpus_chunk(cache, c)
        ranges = examples[c] if examples is not None else example_ranges(arrays, max_seq_length)
        for group in pack_examples(ranges, batch_tokens):
            totals = totals + score_batch(model, make_batch(arrays, group))
            mx.eval(totals)
            if totals[3].item() >= max_positions:
                break
        if totals[3].item() >= max_positions:
            break
    kl, alpha, top1, n = totals.tolist()
    n_safe = max(n, 1.0)
    return DraftEvalRecord(kl / n_safe, alpha / n_safe, top1 / n_safe, int(n))


# --- the task on the shared loop --------------------------------------------------------------------


class DraftTask:
    """Draft distillation on ``loop.fit``: a small decoder trained on the soft labels of a corpus.

    Args:
        target: The target (its config and embeddings shape the draft; it is never run).
        tokenizer: The target's tokenizer, saved with every checkpoint.
        train: A corpus with soft labels (``mlxspec train corpus``, its ``train`` part).
        heldout: A held-out corpus for the per-epoch scores, or ``None``: the last
            ``config.heldout_examples`` examples of ``train`` are held out instead.
        config: Settings.

    Raises:
        ValueError: the corpus has no soft labels.
    """

    resume_keys = RESUME_KEYS
    compile = False  # batches are whole examples of varying length

    def __init__(self, target: nn.Module, tokenizer, train: FeatureCache, heldout: FeatureCache | None,
                 config: DraftTrainConfig):
        self.target, self.tokenizer, self.train, self.heldout, self.config = (
            target,
            tokenizer,
            train,
            heldout,
            config,
        )
        self.data = str(train.directory.resolve())
        self.held = {} if heldout is not None or not config.heldout_examples else split_heldout(
            train, config.heldout_examples, config.max_seq_length)
        self.remap = self.keep = self.rest = None
        if config.train_vocab:
            vocab_size = int(target.args.vocab_size)
            self.keep = training_vocab(train, config.train_vocab, vocab_size)
            self.remap = np.full(vocab_size, -1, dtype=np.int32)
            self.remap[self.keep] = np.arange(len(self.keep), dtype=np.int32)
            self.rest = np.flatnonzero(self.remap < 0).astype(np.int32)
        self.model_config: dict = {}

    def init(self) -> nn.Module:
        model, self.model_config = init_draft(self.target, self.config)
        return model

    def load(self, folder: Path) -> nn.Module:
        self.model_config = json.loads((folder / "config.json").read_text())
        self.model_config.pop("eos_token_id", None)
        model = build_draft(self.model_config)
        model.load_weights(str(folder / "model.safetensors"))
        mx.eval(model.parameters())
        return model

    def save(self, model: nn.Module, folder: Path, dtype: str | None) -> None:
        save_draft(folder, model, self.model_config, self.tokenizer, dtype)

    def steps_in_epoch(self, epoch: int) -> int:
        return steps_per_epoch(self.train, self.config, self.held, epoch)

    def batches(self, model, epoch: int, start: int) -> Iterator[dict[str, mx.array]]:
        for i, (arrays, group) in enumerate(epoch_batches(self.train, self.config, self.held, epoch)):
            if i >= start:
                yield make_batch(arrays, group, self.remap)

    def loss(self, model: nn.Module):
        return lambda *inputs: (distill_loss(model, *inputs), mx.zeros((0,)))

    def inputs(self, batch: dict[str, mx.array], global_step: int) -> tuple:
        candidates, log_weights = _candidates(self.keep, self.rest, self.config, global_step)
        return (batch["tokens"], batch["rows"], batch["topk_ids"], batch["target_probs"], batch["weights"],
                candidates, log_weights)

    def counts(self, batch: dict[str, mx.array]) -> tuple[int, int]:
        return int(batch["rows"].size), int(batch["tokens"].size)

    def evaluate(self, model: nn.Module) -> DraftEvalRecord | None:
        c = self.config
        sizes = {"batch_tokens": c.batch_tokens, "max_seq_length": c.max_seq_length,
                 "max_positions": c.max_eval_positions}
        if self.heldout is not None:
            return evaluate(model, self.heldout, **sizes)
        return evaluate(model, self.train, examples=self.held, **sizes) if self.held else None


def train_draft(
    target: nn.Module,
    tokenizer,
    train: FeatureCache,
    heldout: FeatureCache | None,
    output: str | Path,
    config: DraftTrainConfig,
    *,
    resume: bool = True,
) -> Iterator[StepRecord | EvalRecord]:
    """Distil a draft model from the soft labels of ``train`` (``loop.fit`` on a ``DraftTask``).

    Args:
        target, tokenizer, train, heldout, config: As ``DraftTask``.
        output: Checkpoint folder, itself an mlx-lm model folder (latest weights, float32) plus
            ``optimizer.safetensors`` and ``trainer_state.json``; ``epoch-<n>/`` per epoch (``save_dtype``).
        resume: Continue from the checkpoint in ``output`` if there is one. Default: ``True``.

    Yields:
        ``DraftEvalRecord`` before training (with held-out data) and after each epoch (a bare
        ``EvalRecord`` with nothing held out); ``StepRecord`` per step.

    Raises:
        ValueError: as ``DraftTask`` and ``loop.fit``.
    """
    return fit(DraftTask(target, tokenizer, train, heldout, config), output, config, resume=resume)


def _candidates(keep, rest, config: DraftTrainConfig, step: int):
    """(candidate ids [C + S], log-weights [C + S]) for one step: the training vocabulary and S negatives
    drawn (seeded by step) from the rest; ``(None, None)`` without a training vocabulary."""
    if keep is None:
        return None, None
    n = min(config.negatives, len(rest))
    if n == 0:
        return mx.array(keep), None
    sample = np.random.default_rng([config.seed, step, 7]).choice(rest, size=n, replace=False)
    log_weights = np.concatenate([np.zeros(len(keep)), np.full(n, np.log(len(rest) / n))]).astype(np.float32)
    return mx.array(np.concatenate([keep, sample]).astype(np.int32)), mx.array(log_weights)
