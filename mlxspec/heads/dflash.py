"""DFlash block drafters: a few decoder layers that fill a whole block of masked tokens at once.

DFlash: Block Diffusion for Flash Speculative Decoding (z-lab, arXiv 2602.06036; docs/heads.md 8.1).
The drafter has the target's width. The residual streams leaving K target layers are
concatenated and fused, c = hidden_norm(fc(f)) (K H → H), and every drafter layer's attention
takes c through its own k/v projections as extra keys and values in front of the block's own.
One forward over ``[anchor, MASK, …, MASK]`` (block size B, the anchor being the last committed
token) attends bidirectionally inside the block and gives, through the target's LM head, a
distribution for every block position j ≥ 1: the token at position anchor + j itself (the masks
are filled in place, not shifted).

The layers are Qwen3's (q/k RMS norms per head, SwiGLU MLP) and the parameter names equal the
published z-lab layout (``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.self_attn.{q,k,v,o}_proj``,
``…q_norm``, ``…k_norm``, ``layers.{i}.mlp.*``, ``layers.{i}.{input,post_attention}_layernorm``), so
loading and saving are a rename at most. Only the context keys/values enter the drafter's KV cache;
the block's are recomputed every round, so the cache holds committed positions only.

``DFlashNet.block`` is the backbone API other block drafters (DSpark) build on: from the block's
token ids and the target's features it returns the block's hidden states and per-position logits.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ..core.taps import logits_width, model_body
from ..loading.weights import one_line
from .checkpoints import (
    check_tensors,
    embedding_dtype,
    load_safetensors,
    local_or_hub,
    read_config,
    write_checkpoint,
)

DEFAULT_BLOCK_SIZE = 16
#: How an error about a file that holds no usable DFlash drafter ends: what to pass instead.
PASS_DFLASH = (
    "pass a DFlash drafter instead: a folder with config.json and model.safetensors (as 'mlxspec train "
    "dflash' writes) or a Hugging Face repo id"
)
#: Sizes a config must give as whole numbers of at least 1 (when it gives them).
_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
          "num_target_layers", "block_size", "num_key_value_heads", "head_dim", "max_position_embeddings")


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default target layers (their outputs are the features): evenly from 1 to N − 3, one
    per drafter layer; the middle layer for a one-layer drafter. Clamped to the target's layers."""
    N, L = num_target_layers, num_draft_layers
    if L <= 1:
        return (N // 2,)
    start, end = 1, max(N - 3, 1)
    return tuple(min(int(round(start + i * (end - start) / (L - 1))), N - 1) for i in range(L))


@dataclass(frozen=True)
class DFlashConfig:
    """Shape of a DFlash drafter (``config.json``; published z-lab field names).

    Attributes:
        hidden_size: H, the target's hidden size (the drafter's width).
        intermediate_size: I, the MLP width.
        num_hidden_layers: L, drafter decoder layers.
        num_attention_heads, num_key_value_heads, head_dim: nh, nkv, hd.
        vocab_size: V, the target's vocabulary (logits come from the target's LM head).
        num_target_layers: N, decoder layers of the target it was trained for.
        target_layer_ids: Target layers whose OUTPUT residual streams are the features (z-lab's
            ``hidden_states[i + 1]``); ``None`` = ``default_target_layers(N, L)``.
        block_size: B, positions per block, the anchor included (at most B − 1 drafts a round).
        mask_token_id: The id whose (target) embedding fills the masked positions.
        rms_norm_eps, rope_theta, rope_scaling, max_position_embeddings: as in Qwen3.
        attention_bias: q/k/v/o projections have biases.
        context_window: How many of the latest committed positions (those just before the anchor) a
            block sees as context; 0 = all of them, as z-lab's drafters. An mlxspec extension, stored
            in ``dflash_config``: a short window trains from scratch where the full context plateaus
            on the unigram (docs/archive/dflash.md 4.1).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_target_layers: int
    mask_token_id: int
    block_size: int = DEFAULT_BLOCK_SIZE
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    context_window: int = 0

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        ids = self.target_layer_ids
        set_("target_layer_ids", tuple(int(i) for i in ids) if ids is not None else
             default_target_layers(self.num_target_layers, self.num_hidden_layers))
        if self.block_size < 2:
            raise ValueError(f"a DFlash block needs at least 2 positions (anchor + 1), got block_size "
                             f"{self.block_size}")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The tap indices (``taps.HiddenTap``: inputs of layers) of the target layer outputs read."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @classmethod
    def from_dict(cls, config: dict) -> DFlashConfig:
        """Read a z-lab DFlash ``config.json``: the first layout (``block_size``, ``rope_theta`` at the
        top) and the later one (``block_size`` in ``dflash_config``, ``rope_parameters.rope_theta``);
        ``mask_token_id`` and ``target_layer_ids`` from ``dflash_config``.

        Raises:
            ValueError: a required field is missing, or a variant this drafter cannot run exactly as
                trained (sliding-window or causal drafter layers, another projector).
        """
        extra = config.get("dflash_config") or {}
        rope = config.get("rope_parameters") or {}
        if not isinstance(extra, dict) or not isinstance(rope, dict):
            raise ValueError("DFlash config's dflash_config and rope_parameters must be JSON objects; "
                             "is this a DFlash drafter's config.json?")
        flat = {**config, **extra}
        if "rope_theta" not in config and "rope_theta" in rope:
            flat["rope_theta"] = rope["rope_theta"]
        if any(t != "full_attention" for t in config.get("layer_types") or ()) or extra.get("causal"):
            raise ValueError(
                "this DFlash drafter has sliding-window or causal layers, which mlxspec does not run; "
                "use a drafter with full bidirectional attention (z-lab's first layout)"
            )
        if extra.get("projector_type", "dflash") != "dflash" or extra.get("selector_rank"):
            raise ValueError(f"DFlash variant {extra.get('projector_type') or 'DFlash2'!r} is not supported; "
                             "use a plain DFlashDraftModel checkpoint")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in flat.items() if k in known and v is not None}
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size", "num_target_layers", "mask_token_id") if k not in kwargs]
        if missing:
            raise ValueError(
                f"DFlash config lacks {', '.join(missing)}; is this a DFlash drafter's config.json?"
            )
        _check_numbers(kwargs)
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """``config.json`` in z-lab's first layout (what their loaders and ours read)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        extra = {
            "mask_token_id": out.pop("mask_token_id"),
            "target_layer_ids": list(out.pop("target_layer_ids")),
        }
        window = out.pop("context_window")
        extra.update({"context_window": window} if window else {})
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **out, "dflash_config": extra}


def _check_numbers(kwargs: dict) -> None:
    """Refuse sizes and ids that are not whole numbers (``"big"``, ``0``, ``2.5``) before they reach a
    layer."""
    whole = lambda v, least: isinstance(v, int) and not isinstance(v, bool) and v >= least  # noqa: E731
    for key, value in kwargs.items():
        least = 0 if key in ("mask_token_id", "context_window") else 1
        if (key in _SIZES or least == 0) and not whole(value, least):
            raise ValueError(f"DFlash config gives {key} = {value!r}, not a whole number of at least "
                             f"{least}; is this a DFlash drafter's config.json?")
    ids = kwargs.get("target_layer_ids")
    if ids is not None and not (isinstance(ids, list) and all(whole(i, 0) for i in ids)):
        raise ValueError(f"DFlash config gives target_layer_ids = {ids!r}, not a list of layer numbers; "
                         "is this a DFlash drafter's config.json?")


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are [fused context; block], queries from the block only."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        H, nh, nkv, hd, bias = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                config.head_dim, config.attention_bias)
        self.n_heads, self.n_kv_heads, self.scale = nh, nkv, hd**-0.5
        self.window = config.context_window
        self.q_proj = nn.Linear(H, nh * hd, bias=bias)
        self.k_proj = nn.Linear(H, nkv * hd, bias=bias)
        self.v_proj = nn.Linear(H, nkv * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, H, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.rope = initialize_rope(
            hd,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )

    def _heads(self, x: mx.array, proj, n: int, norm=None) -> mx.array:
        B, T, _ = x.shape
        out = proj(x).reshape(B, T, n, -1)  # [B, T, n, hd]
        return (norm(out) if norm is not None else out).transpose(0, 2, 1, 3)  # [B, n, T, hd]

    def __call__(self, x: mx.array, context: mx.array, cache=None, block_offset=0, mask=None) -> mx.array:
        """x: block [Nb, B, H]; context: fused features [1, S, H] at positions ``cache.offset`` (0
        without a cache) onwards, or ``None`` (only what the cache holds); ``block_offset``: each
        block's anchor position (int or [Nb]); ``mask``: bool [Nb, 1, B, S_total + B] or ``None``
        (everything visible). With a cache and a ``context_window`` W only its last W positions are
        keys (training windows through ``mask`` instead)."""
        Nb, B, _ = x.shape
        start = cache.offset if cache is not None else 0
        q = self.rope(self._heads(x, self.q_proj, self.n_heads, self.q_norm), offset=block_offset)
        k = self.rope(self._heads(x, self.k_proj, self.n_kv_heads, self.k_norm), offset=block_offset)
        v = self._heads(x, self.v_proj, self.n_kv_heads)
        if context is None:  # nothing new: the cached context alone (its buffers may be longer)
            k_ctx, v_ctx = cache.keys[..., :start, :], cache.values[..., :start, :]
        else:
            k_ctx = self.rope(self._heads(context, self.k_proj, self.n_kv_heads, self.k_norm), offset=start)
            v_ctx = self._heads(context, self.v_proj, self.n_kv_heads)
            if cache is not None:
                k_ctx, v_ctx = cache.update_and_fetch(k_ctx, v_ctx)  # committed context only
        if self.window and cache is not None:
            k_ctx, v_ctx = k_ctx[..., -self.window :, :], v_ctx[..., -self.window :, :]
        # [Nb, nkv, S + B, hd]
        keys = mx.concatenate([mx.broadcast_to(k_ctx, (Nb, *k_ctx.shape[1:])), k], axis=2)
        values = mx.concatenate([mx.broadcast_to(v_ctx, (Nb, *v_ctx.shape[1:])), v], axis=2)
        # [Nb, nh, B, hd]
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(Nb, B, -1))


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer around ``DFlashAttention`` (the context is not normed again)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, context, cache=None, block_offset=0, mask=None):
        h = x + self.self_attn(self.input_layernorm(x), context, cache, block_offset, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashNet(nn.Module):
    """A DFlash drafter network; parameters in the published layout.

    Args:
        config: Its shape.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = [DFlashLayer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)

    def fuse(self, features: mx.array) -> mx.array:
        """The fused context: hidden_norm(fc(f)), [..., K H] -> [..., H] (K target layers concatenated)."""
        return self.hidden_norm(self.fc(features.astype(self.fc.weight.dtype)))

    def __call__(
        self, embeds: mx.array, context: mx.array, cache=None, block_offset=0, mask=None
    ) -> mx.array:
        """The drafter layers over blocks: final-normed hidden states.

        Args:
            embeds (mx.array): The blocks' token embeddings (the target's), [Nb, B, H].
            context (mx.array | None): Fused features (``fuse``), [1, S, H], at positions ``cache.offset``
                (0 without a cache) onwards; with a cache they are appended to it. ``None``: the cache's
                alone.
            cache: One mlx-lm ``KVCache`` per drafter layer (context keys/values only), or ``None``.
            block_offset: Position of each block's anchor, an int or [Nb] int32.
            mask: Bool [Nb, 1, B, S_total + B]: which context positions and block positions each block
                position sees; ``None`` = all (inference: the context is exactly the committed prefix).

        Returns:
            mx.array: [Nb, B, H], the input of the target's LM head.
        """
        h = embeds.astype(self.fc.weight.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, context, cache[i] if cache is not None else None, block_offset, mask)
        return self.norm(h)

    def block(self, tokens: mx.array, features: mx.array, embed, lm_head, cache=None, block_offset=0,
              mask=None) -> tuple[mx.array, mx.array]:
        """The backbone API: the blocks' hidden states and per-position logits from anchors + features.

        Args:
            tokens (mx.array): Blocks ``[anchor, MASK, …]``, [Nb, B] int32 (any ids may stand in the block).
            features (mx.array | None): The target's features (``config.feature_layers`` concatenated),
                [1, S, K H], for the positions the context covers (see ``__call__``); ``None``: none new.
            embed: The target's token embedding, ids -> [..., H].
            lm_head: The target's LM head (``taps.output_head``), [..., H] -> [..., V].
            cache, block_offset, mask: as in ``__call__``.

        Returns:
            tuple[mx.array, mx.array]: hidden [Nb, B, H] and logits [Nb, B, V]; row j ≥ 1 of a block
            scores the token at position anchor + j (row 0 is unused).
        """
        context = self.fuse(features) if features is not None else None
        hidden = self(embed(tokens), context, cache, block_offset, mask)
        return hidden, lm_head(hidden)


# --- checkpoints ---------------------------------------------------------------------------


def dflash_folder(spec: str) -> Path:
    """A local folder, or a Hugging Face repo id fetched with ``huggingface_hub`` (JSON and safetensors only).

    Raises:
        FileNotFoundError: a path that does not exist and does not look like a repo id.
        ValueError: a repo that cannot be fetched.
    """
    return local_or_hub(spec, ["*.json", "*.safetensors"], "no such DFlash drafter folder")


def _read(folder: Path, name: str = "DFlash drafter") -> tuple[dict, dict]:
    if not folder.is_dir():
        raise FileNotFoundError(f"a {name} is a folder with config.json and *.safetensors; got {folder}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}; a {name} needs its config beside the weights")
    single = folder / "model.safetensors"  # else shards; a training folder's optimizer state is no weights
    shards = [single] if single.is_file() else sorted(
        p for p in folder.glob("*.safetensors") if p.name != "optimizer.safetensors")
    if not shards:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    weights = {k.removeprefix("model."): v for s in shards for k, v in load_safetensors(s).items()}
    # the target's own embedding and LM head are used; a copy in the checkpoint is not needed
    weights = {k: v for k, v in weights.items() if not k.startswith(("embed_tokens.", "lm_head."))}
    return read_config(config_path), weights


def check_fits(config: DFlashConfig, target: nn.Module, source: str = "DFlash drafter") -> None:
    """Refuse a drafter whose shapes do not fit the target.

    Raises:
        ValueError: naming both sizes (hidden size, vocabulary, decoder layers, tapped layers or mask id).
    """
    body = model_body(target)
    H, V, N = target.args.hidden_size, logits_width(target), len(body.layers)
    rows = body.embed_tokens.weight.shape[0]
    fix = "use a DFlash drafter trained for this target"
    if config.hidden_size != H:
        raise ValueError(f"{source} has hidden size {config.hidden_size} but the target's is {H}; {fix}")
    if config.vocab_size != V:
        raise ValueError(f"{source} has vocabulary {config.vocab_size} but the target's is {V}; {fix}")
    if config.num_target_layers != N:
        raise ValueError(
            f"{source} was trained for a target of {config.num_target_layers} decoder layers but this "
            f"target has {N}; {fix}"
        )
    bad = [i for i in config.target_layer_ids if not 0 <= i < N]
    if bad:
        raise ValueError(
            f"{source} reads target layers {list(config.target_layer_ids)} but the target has layers "
            f"0..{N - 1}; {fix}"
        )
    if not 0 <= config.mask_token_id < rows:
        raise ValueError(f"{source} masks with token id {config.mask_token_id} but the target embeds ids "
                         f"0..{rows - 1}; {fix}")


def load_dflash(spec: str | Path, target: nn.Module | None = None, dtype=None) -> DFlashNet:
    """Load a DFlash drafter in the published z-lab layout from a folder or a Hugging Face repo.

    Args:
        spec: A folder (``config.json`` + ``*.safetensors``) or a repo id (fetched without code).
        target: The target model; when given the drafter must fit it (``check_fits``).
        dtype: Cast float weights to this dtype. Default: the target's embedding dtype, else float32.

    Returns:
        DFlashNet: Evaluated, in eval mode.

    Raises:
        FileNotFoundError: no config or weights.
        ValueError: an unsupported variant, config and tensors that disagree, or a drafter that does
            not fit the target (both sizes named).
    """
    return load_block_drafter(
        spec,
        target,
        dtype,
        DFlashConfig.from_dict,
        DFlashNet,
        "DFlash drafter",
        lambda c: (
            f"for a {c.num_hidden_layers}-layer DFlashDraftModel; are its config.json and "
            "weights from the same checkpoint?"
        ),
        PASS_DFLASH,
    )


def load_block_drafter(spec: str | Path, target: nn.Module | None, dtype, parse_config, make_net, name: str,
                       layout, fix: str) -> DFlashNet:
    """The loading steps DFlash and the drafters on its backbone (DSpark) share: read, check, build, fill.

    Args:
        spec, target, dtype: As ``load_dflash``.
        parse_config: ``config.json`` dict -> the drafter's config (raising ``ValueError`` on a bad one).
        make_net: Config -> a fresh network (a ``DFlashNet``).
        name: The drafter's kind in errors (``"DSpark drafter"``).
        layout: Config -> what completes "lacks/has unexpected X …" (the layout the config implies).
        fix: What ends the error for a damaged file or one that is no checkpoint (what to pass instead).

    Raises:
        As ``load_dflash``.
    """
    try:
        raw_config, weights = _read(dflash_folder(str(spec)), name)
    except ValueError as e:  # damaged, or no checkpoint at all
        raise ValueError(f"{one_line(e)}; {fix}") from None
    try:
        config = parse_config(raw_config)
    except (TypeError, AttributeError, KeyError) as e:  # a field of the wrong kind that no check names
        raise ValueError(f"{name} {spec}: its config.json has a field of the wrong type ({one_line(e)}); "
                         f"{fix}") from None
    if target is not None:
        check_fits(getattr(config, "backbone", config), target, f"{name} {spec}")
    net = make_net(config)
    check_tensors(net, weights, f"{name} {spec}", lacks=layout(config), extra=layout(config))
    dtype = embedding_dtype(target) if dtype is None else dtype
    net.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
    mx.eval(net.parameters())
    net.eval()
    return net


def save_dflash(net: DFlashNet, folder: str | Path, extra_config: dict | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the published z-lab layout.

    Args:
        net: The drafter.
        folder: Created if missing.
        extra_config: More ``config.json`` entries (e.g. a training record). Default: none.
    """
    write_checkpoint(
        folder, dict(tree_flatten(net.parameters())), {**net.config.to_dict(), **(extra_config or {})}
    )
