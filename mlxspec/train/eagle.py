"""EAGLE-1 and EAGLE-3 head training on a self-distillation corpus of the frozen target.

The corpus (``mlxspec.train.corpus``, read through ``FeatureCache``) holds, per token t of each
example: the token, whether it is an assistant token, the target's final-norm feature f_t, the
residual stream entering three target layers (EAGLE-3's low/middle/high features), the target's
greedy next token and its top-K log-softmax (the distribution of token t + 1). The head sees
whole examples, attends causally over them like the target, and is scored only where the token
it predicts is an assistant token. Draft position j pairs the feature of token j with token
j + 1 and predicts token j + 2 (docs/heads.md 4.1).

- **EAGLE-1** (Li et al. 2024, arXiv 2401.15077, section 4; docs/heads.md 4.7): predict f_{j+1} from
  fc(concat(emb(x_{j+1}), f_j + noise)); loss = SmoothL1(f̂_{j+1}, f_{j+1}) + 0.1 · soft CE of the
  target's LM head on f̂_{j+1} against the target's distribution. Two approximations keep the
  49152-wide LM head affordable on a CPU, both exact in the limit K → V: the target's
  distribution is its stored top-K renormalised (K = 32 holds nearly all the mass of a greedy
  self-distilled answer), and the head's softmax runs over the union of the batch's top-K ids
  instead of the whole vocabulary (a sampled softmax whose negatives are the other positions'
  likely tokens). Feature noise U(-0.5, 0.5) · 0.2 · 512 / T as in the reference trainer.
- **EAGLE-3** (Li et al. 2025, arXiv 2503.01840, section 3; docs/heads.md 5.6): training-time test.
  Step 0 reads fc(low, mid, high); step k > 0 reads the head's own step k - 1 output at the same
  position and the next token, attends to the step-0 keys of positions <= j plus its own
  keys from steps 1..k at position j (RoPE position j + k), exactly what a chain draft sees at
  inference. Loss Σ_k 0.8^k · soft CE over the reduced draft vocabulary against the target's
  top-K restricted to it and renormalised, on positions whose target argmax is drafteable.
  The draft vocabulary is the ``draft_vocab_size`` most frequent assistant tokens of the
  training examples (``draft_vocabulary``: d2t as offsets, t2d as a mask; docs/heads.md 5.4).

``EagleTask`` is this method on the shared loop (``loop.fit``); ``train_eagle`` runs it and yields
the loop's records, with an ``EagleEvalRecord`` (held-out top-1 agreement with the target's greedy
token per unrolled step and the chain acceptance it implies) before training and after every epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..heads.eagle import EagleConfig, EagleHead, load_eagle, save_eagle
from ..core.taps import logits_width, model_body, output_head
from .features import FeatureCache, feature_scale, fold_feature_scale, folded_copy
from .eagle_data import (
    RESUME_KEYS,
    EagleEvalRecord,
    EagleTrainConfig,
    SequenceBatch,
    check_corpus,
    draft_vocabulary,
    plan_epoch,
    sequence_batches,
    target_to_draft,
    token_counts,
)
from .loop import EpochPlans, EvalRecord, StepRecord, cast_copy, fit

# --- the unrolled forward (training-time test) -------------------------------------------------


class _TTTAttention(nn.Module):
    """The head's attention at unrolled step k (docs/heads.md 5.6): queries at position j (RoPE j + k)
    see the step-0 keys of positions <= j and the step-1..k keys of position j itself.

    Wraps the head's own mlx-lm ``Attention`` (its projections, RoPE and scale); ``memory``
    carries the step-0 keys/values and the diagonal ones across steps.
    """

    def __init__(self, inner: nn.Module, memory: dict, step: int):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_memory", memory)
        object.__setattr__(self, "_step", step)

    def __call__(self, z: mx.array, mask=None, cache=None) -> mx.array:
        a, m, k = self.inner, self._memory, self._step
        B, T, _ = z.shape
        q = a.q_proj(z).reshape(B, T, a.n_heads, -1).transpose(0, 2, 1, 3)  # [B, nh, T, hd]
        keys = a.k_proj(z).reshape(B, T, a.n_kv_heads, -1).transpose(0, 2, 1, 3)  # [B, nkv, T, hd]
        values = a.v_proj(z).reshape(B, T, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, keys = a.rope(q, offset=k), a.rope(keys, offset=k)
        if k == 0:
            m.update(keys=keys, values=values, diag_keys=[], diag_values=[])
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=a.scale, mask="causal")
        else:
            m["diag_keys"].append(keys)
            m["diag_values"].append(values)
            out = _unrolled_attention(q * a.scale, m)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


def _unrolled_attention(q: mx.array, m: dict) -> mx.array:
    """softmax over [causal step-0 scores | diagonal scores of steps 1..k] (q pre-scaled)."""
    B, nh, T, hd = q.shape
    nkv = m["keys"].shape[1]
    qg = q.reshape(B, nkv, nh // nkv, T, hd)  # GQA: query heads grouped by their kv head
    scores = qg @ m["keys"][:, :, None].swapaxes(-1, -2)  # [B, nkv, r, T, T]
    causal = mx.arange(T)[:, None] >= mx.arange(T)[None]
    scores = mx.where(causal, scores, mx.array(-mx.inf, scores.dtype))
    diag_k = mx.stack(m["diag_keys"], axis=-2)[:, :, None]  # [B, nkv, 1, T, k, hd]
    diag = (qg[..., None, :] * diag_k).sum(-1)  # [B, nkv, r, T, k]
    weights = mx.softmax(mx.concatenate([scores, diag], axis=-1), axis=-1, precise=True)
    diag_v = mx.stack(m["diag_values"], axis=-2)[:, :, None]  # [B, nkv, 1, T, k, hd]
    out = weights[..., :T] @ m["values"][:, :, None] + (weights[..., T:, None] * diag_v).sum(-2)
    return out.reshape(B, nh, T, hd)


def _version(head) -> int:
    """3 for an EAGLE-3 head; 1 for EAGLE-1 and for an MTP module (final-norm features, the target's LM
    head)."""
    return getattr(head.config, "version", 1)


def _attention_owner(head) -> nn.Module:
    if hasattr(head, "attention_owner"):  # an MTP module (mlxspec.heads.mtp.MTPStack)
        return head.attention_owner
    return head.layers[0] if head.config.version == 1 else head.midlayer


def unroll(head, embed, features: mx.array, tokens: mx.array, steps: int,
           noise: mx.array | None = None) -> list[mx.array]:
    """The head's outputs at ``steps`` unrolled steps over whole sequences (training-time test).

    Li et al. 2025 (EAGLE-3, arXiv 2503.01840) section 3.3; docs/heads.md 5.6. Step 0 is the head's
    ordinary causal forward over (features, tokens[:, :T]); step k > 0 reads the step k - 1
    outputs as features and tokens[:, k : k + T], and position j attends to the step-0 keys of
    positions <= j plus its own keys from steps 1..k (what a chain draft at depth k sees).

    Args:
        head: An ``EagleHead``.
        embed: The target's token embedding.
        features: Step-0 features, [B, T, F] float32.
        tokens: [B, T + steps - 1] int32; column j is the token after feature j.
        steps: Unrolled steps S >= 1.
        noise: Added to the step-0 features (EAGLE-1's input noise), [B, T, F], or ``None``.

    Returns:
        list[mx.array]: S arrays [B, T, H]: the predicted next features at each step.
    """
    T = features.shape[1]
    owner = _attention_owner(head)
    inner, memory, outs = owner.self_attn, {}, []
    h = features if noise is None else features + noise
    try:
        for k in range(steps):
            owner.self_attn = _TTTAttention(inner, memory, k)
            h = head(h, tokens[:, k : k + T], embed)
            outs.append(h)
    finally:
        owner.self_attn = inner
    return outs


# --- losses ---------------------------------------------------------------------------------


def soft_ce(logits: mx.array, ids: mx.array, probs: mx.array) -> mx.array:
    """Soft cross-entropy per row, -Σ_k p_k log softmax(logits)[ids_k] (nats): logits [n, C] over C candidate
    columns (a sampled softmax), ``ids`` [n, K] int32 columns of the soft labels, ``probs`` [n, K] -> [n]."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -(probs * mx.take_along_axis(logprobs, ids, axis=-1)).sum(-1)


def eagle3_loss(head, batch: SequenceBatch, embed, config: EagleTrainConfig) -> tuple[mx.array, mx.array]:
    """EAGLE-3 training-time-test loss Σ_k decay^k · CE_k (docs/heads.md 5.6).

    CE_k is the mean soft cross-entropy of the head's draft-vocabulary log-softmax at step k
    against the target's top-K distribution restricted to the draft vocabulary and renormalised,
    over positions whose target argmax is in the draft vocabulary.

    Args:
        head: An EAGLE-3 ``EagleHead``.
        batch: A ``SequenceBatch`` with at least ``config.ttt_steps`` steps of labels.
        embed: The target's token embedding.
        config: Steps and their decay.

    Returns:
        tuple: total loss (scalar) and the per-step cross-entropies [S] (nats).
    """
    outs = unroll(head, embed, batch.features, batch.tokens, config.train_steps)
    per_step = []
    for k, x in enumerate(outs):
        rows = x.reshape(-1, x.shape[-1])[batch.rows[k]]  # [n_k, H]
        ce = soft_ce(head.logits(rows), batch.label_ids[k], batch.label_probs[k]).sum()
        per_step.append(ce / max(int(batch.rows[k].shape[0]), 1))
    per_step = mx.stack(per_step)
    weights = mx.array([config.step_decay**k for k in range(len(outs))])
    return (weights * per_step).sum(), per_step


def eagle1_loss(head, batch: SequenceBatch, embed, lm_weight: mx.array, config: EagleTrainConfig,
                noise: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """EAGLE-1 loss: SmoothL1(f̂_{j+1}, f_{j+1}) + ``ce_weight`` · soft CE (docs/heads.md 4.7).

    The regression is averaged over the hidden size and the loss positions. The soft CE scores
    the target's LM head on f̂_{j+1} over ``batch.union_ids`` (the union of the batch's top-K
    ids: a sampled softmax) against the target's top-K probabilities renormalised.

    Args:
        head: An EAGLE-1 ``EagleHead``.
        batch: A ``SequenceBatch`` with ``next_features`` and ``union_ids``.
        embed: The target's token embedding.
        lm_weight: The target's LM head as a matrix, [V, H] float32.
        config: ``ce_weight``.
        noise: Input-feature noise, [B, T, H], or ``None``.

    Returns:
        tuple: total loss, the soft CE [1] and the regression loss (scalars, nats).
    """
    x = unroll(head, embed, batch.features, batch.tokens, 1, noise)[0]
    H, n = x.shape[-1], max(int(batch.rows[0].shape[0]), 1)
    rows = x.reshape(-1, H)[batch.rows[0]]  # [n, H]
    true = batch.next_features.reshape(-1, H)[batch.rows[0]]
    regression = nn.losses.smooth_l1_loss(rows, true, reduction="none").mean(-1).sum() / n
    logits = rows @ lm_weight[batch.union_ids].T  # [n, U]
    ce = soft_ce(logits, batch.label_ids[0], batch.label_probs[0]).sum() / n
    return regression + config.ce_weight * ce, ce[None], regression


def feature_noise(shape: tuple[int, ...], scale: float, key: mx.array) -> mx.array:
    """EAGLE-1's input noise U(-0.5, 0.5) · scale · 512 / T for features of shape [B, T, F]."""
    return (mx.random.uniform(shape=shape, key=key) - 0.5) * (scale * 512 / shape[1])


# --- held-out agreement -------------------------------------------------------------------------


def _greedy_ids(head, rows: mx.array, lm_weight: mx.array | None, block: int = 512) -> np.ndarray:
    """The head's top-1 target id for each row of draft hidden states [n, H]."""
    out = []
    for i in range(0, rows.shape[0], block):
        part = rows[i : i + block]
        logits = part @ lm_weight.T if _version(head) == 1 else head.logits(part)
        ids = head.target_ids(mx.argmax(logits, axis=-1)) if _version(head) == 3 else mx.argmax(logits, -1)
        out.append(np.array(ids.astype(mx.int32)))
    return np.concatenate(out) if out else np.zeros(0, np.int32)


def evaluate(head, embed, cache: FeatureCache, config: EagleTrainConfig, *, lm_weight: mx.array | None = None,
             to_draft: np.ndarray | None = None, scale: np.ndarray | None = None) -> EagleEvalRecord:
    """Held-out top-1 agreement with the target's greedy token per unrolled step (an acceptance estimate).

    Positions are every draft position whose predicted token is an assistant token, in corpus
    order, until about ``config.max_eval_positions`` step-1 positions are scored.

    Args:
        head: The head.
        embed: The target's token embedding.
        cache: Held-out corpus.
        config: ``eval_steps``, ``max_eval_positions``, batch shape.
        lm_weight: The target's LM head [V, H] (EAGLE-1).
        to_draft: ``target_to_draft`` of the head's vocabulary (EAGLE-3 with a reduced one).
        scale: EAGLE-3: what the step-0 features are divided by, as in training (``features.feature_scale``).

    Returns:
        EagleEvalRecord: with ``epoch`` 0 (the caller sets it).
    """
    S = config.eval_steps
    agree = [[] for _ in range(S)]
    chains = []
    seen = 0
    for batch in sequence_batches(cache, plan_epoch(cache, config, shuffle=False), config, to_draft):
        if seen >= config.max_eval_positions:
            break
        features = batch.features / mx.array(scale) if scale is not None else batch.features
        outs = unroll(head, embed, features, batch.tokens, S)
        grid = np.full((S, batch.tokens_padded), -1, np.int8)  # -1 = no target at this step
        for k, x in enumerate(outs):
            rows = batch.eval_rows[k]
            guess = _greedy_ids(head, x.reshape(-1, x.shape[-1])[mx.array(rows.astype(np.int32))], lm_weight)
            hit = guess == batch.eval_greedy[k]
            grid[k, rows] = hit
            agree[k].append(hit)
        full = (grid >= 0).all(axis=0)  # positions with a target at every step
        chains.append(np.cumprod(grid[:, full] == 1, axis=0))  # [S, n]: first k drafts all agree
        seen += len(batch.eval_rows[0])
    acceptance = [float(np.concatenate(a).mean()) if a and sum(map(len, a)) else 0.0 for a in agree]
    chain = np.concatenate(chains, axis=1) if chains else np.zeros((S, 0))
    chain_acceptance = chain.mean(axis=1).tolist() if chain.shape[1] else [0.0] * S
    return EagleEvalRecord(acceptance, chain_acceptance, 1.0 + sum(chain_acceptance), seen)


# --- the task on the shared loop -----------------------------------------------------------------------


def lm_head_matrix(target: nn.Module) -> mx.array:
    """The target's LM head as a [V, H] float32 matrix (tied, untied or quantized)."""
    H = int(target.args.hidden_size)
    return output_head(target)(mx.eye(H)).T.astype(mx.float32)


def init_head(target: nn.Module, config: EagleTrainConfig, *, aux_layers=None, d2t: np.ndarray | None = None):
    """A fresh head shaped like one layer of ``target`` (docs/heads.md 4.1 / 5.2).

    EAGLE-3 heads start with their LM head copied from the target's (the rows of the draft
    vocabulary). The residual streams they read are large in the middle and top layers (RMS ~70
    in SmolLM2 against ~3 in layer 2; single dimensions of 175 in Qwen2.5), so training feeds fc
    the features divided by their per-dimension RMS (``EagleTask``, ``features.feature_scale``) and
    fc starts as an ordinary random layer over unit-scale inputs.

    Args:
        target: The target (its hidden size, heads, MLP width, vocabulary, LM head).
        config: ``version`` and the draft vocabulary size.
        aux_layers: EAGLE-3: the target layers whose inputs are the features (the corpus's).
        d2t: EAGLE-3 reduced vocabulary offsets [V_draft] (``draft_vocabulary``), or ``None``.
    """
    args = target.args
    vocab = int(logits_width(target))
    shape = EagleConfig(
        hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=getattr(args, "num_key_value_heads", None) or args.num_attention_heads,
        head_dim=getattr(args, "head_dim", None), vocab_size=vocab, version=config.version,
        rms_norm_eps=args.rms_norm_eps, draft_vocab_size=len(d2t) if d2t is not None else None,
        aux_layers=tuple(aux_layers) if config.version == 3 and aux_layers is not None else None)
    head = EagleHead(shape)
    if config.version == 3:
        ids = np.arange(shape.draft_vocab_size) + (d2t if d2t is not None else 0)
        head.lm_head.weight = lm_head_matrix(target)[mx.array(ids)]
        if shape.reduced_vocab:
            head.d2t = mx.array(d2t.astype(np.int32))
            head.t2d = mx.array(np.isin(np.arange(vocab), ids))
    mx.eval(head.parameters())
    return head


class EagleTask(EpochPlans):
    """EAGLE-1 or EAGLE-3 on ``loop.fit``: one head over a self-distillation corpus of the frozen ``target``.

    Args:
        target: The frozen target (float32): its embedding, LM head and shape.
        train: The training corpus (``mlxspec.train.corpus``).
        heldout: A held-out corpus for the per-epoch agreement, or ``None``.
        config: Settings.

    Raises:
        ValueError: a corpus lacks what the version needs, or was made by another model.
    """

    resume_keys = RESUME_KEYS
    compile = False  # batches are whole examples of varying length
    plan_epoch = staticmethod(plan_epoch)

    def __init__(self, target: nn.Module, train: FeatureCache, heldout: FeatureCache | None,
                 config: EagleTrainConfig):
        for cache in (train, heldout) if heldout is not None else (train,):
            check_corpus(cache, config.version, target)
        self.target, self.train, self.heldout, self.config = target, train, heldout, config
        self.data = str(train.directory.resolve())
        self.embed = model_body(target).embed_tokens
        self.lm_weight = lm_head_matrix(target) if config.version == 1 else None
        self.to_draft = None
        # EAGLE-3's fc reads the step-0 features per-dimension normalised; saving folds that in
        self.scale = feature_scale(train) if config.version == 3 else None

    def init(self) -> EagleHead:
        d2t, vocab = None, int(logits_width(self.target))
        if self.config.version == 3 and 0 < self.config.draft_vocab_size < vocab:
            d2t, _ = draft_vocabulary(token_counts(self.train, vocab), self.config.draft_vocab_size)
        # the initial weights are a function of the settings, like the batches
        mx.random.seed(self.config.seed)
        return self._ready(
            init_head(self.target, self.config, aux_layers=self.train.manifest.get("aux_layers"), d2t=d2t)
        )

    def load(self, folder: Path) -> EagleHead:
        head = load_eagle(folder, target=self.target, dtype=mx.float32)
        if self.scale is not None:
            head = fold_feature_scale(head, self.scale, unfold=True)
        head.train()
        return self._ready(head)

    def _ready(self, head: EagleHead) -> EagleHead:
        if head.config.reduced_vocab:
            self.to_draft = target_to_draft(np.array(head.d2t), head.config.vocab_size)
        return head

    def save(self, head: EagleHead, folder: Path, dtype: str | None) -> None:
        make = lambda: EagleHead(head.config)  # noqa: E731
        save_eagle(
            cast_copy(head, make, dtype)
            if self.scale is None
            else folded_copy(head, make, self.scale, dtype),
            folder,
        )

    def batches(self, head, epoch: int, start: int) -> Iterator[SequenceBatch]:
        return sequence_batches(self.train, self._plan(epoch), self.config, self.to_draft, start=start)

    def loss(self, head: EagleHead):
        c = self.config
        if c.version == 3:
            return lambda batch: eagle3_loss(head, batch, self.embed, c)

        def eagle1(batch, noise):
            loss, ce, regression = eagle1_loss(head, batch, self.embed, self.lm_weight, c, noise)
            return loss, mx.concatenate([ce, regression[None]])

        return eagle1

    def inputs(self, batch: SequenceBatch, global_step: int) -> tuple:
        if self.config.version == 3:
            return (replace(batch, features=batch.features / mx.array(self.scale)),)
        key = mx.random.key(self.config.seed * 1_000_003 + global_step)
        noise = feature_noise(batch.features.shape, self.config.noise, key) if self.config.noise > 0 else None
        return batch, noise

    def counts(self, batch: SequenceBatch) -> tuple[int, int]:
        return batch.positions, batch.tokens_padded

    def evaluate(self, head: EagleHead) -> EagleEvalRecord | None:
        if self.heldout is None:
            return None
        return evaluate(head, self.embed, self.heldout, self.config, lm_weight=self.lm_weight,
                        to_draft=self.to_draft, scale=self.scale)


def train_eagle(target: nn.Module, train: FeatureCache, heldout: FeatureCache | None, output: str | Path,
                config: EagleTrainConfig, *, resume: bool = True) -> Iterator[StepRecord | EvalRecord]:
    """Train an EAGLE-1 or EAGLE-3 head on a self-distillation corpus (``loop.fit`` on an ``EagleTask``).

    Args:
        target, train, heldout, config: As ``EagleTask``.
        output: Checkpoint folder: ``config.json`` + ``model.safetensors`` (latest, float32,
            loadable by ``load_eagle``), ``optimizer.safetensors``, ``trainer_state.json``, and
            ``epoch-<n>/`` per epoch in ``save_dtype``.
        resume: Continue from the checkpoint in ``output`` if there is one. Default: ``True``.

    Yields:
        ``EagleEvalRecord`` before training (fresh runs with held-out data) and after each epoch (a bare
        ``EvalRecord`` without held-out data); ``StepRecord`` per step (``parts``: soft CE per unrolled
        step, then EAGLE-1's feature regression).

    Raises:
        ValueError: as ``EagleTask`` and ``loop.fit``.
    """
    return fit(EagleTask(target, train, heldout, config), output, config, resume=resume)
