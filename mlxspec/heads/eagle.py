"""EAGLE draft heads: one decoder layer that extrapolates the target's features.

EAGLE-1 (Li et al. 2024, arXiv 2401.15077, section 4): the draft reads the target's final
normalised hidden state f_j together with the embedding of the next token t_{j+1},
x = fc(concat(embed(t_{j+1}), f_j)), runs one Llama decoder layer without its input norm and
predicts f_{j+1}; the target's own LM head turns that into draft logits. EAGLE-2 (arXiv
2406.16858) keeps the weights and grows a dynamic draft tree. EAGLE-3 (arXiv 2503.01840,
section 3) feeds the residual stream entering three target layers (low, mid, high) through
fc 3H → H, a "midlayer" that attends over concat(input_layernorm(embed), hidden_norm(h))
(2H wide), its own final norm and a reduced-vocabulary LM head whose ids map to the target's
with the offset table ``d2t``: target id = draft id + d2t[draft id] (docs/heads.md 5.2-5.4).

Parameter names equal the published checkpoint layouts (``fc.*``, ``layers.0.*`` for EAGLE-1/2;
``fc.*``, ``midlayer.*``, ``norm.*``, ``lm_head.*``, ``d2t``, ``t2d`` for EAGLE-3), so loading
and saving are a rename at most. The building blocks are mlx-lm's llama ``Attention``, ``MLP``
and ``TransformerBlock``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from ..loading.pickle_reader import load_torch_weights
from ..core.taps import logits_width
from ..loading.weights import one_line
from .checkpoints import check_tensors, embedding_dtype, load_safetensors, local_or_hub, write_checkpoint

#: How every error about a file that holds no usable EAGLE head ends: what to pass instead.
PASS_HEAD = ("pass an EAGLE head instead: a folder with config.json and model.safetensors (as 'mlxspec train "
             "eagle' writes), that file, or a Hugging Face repo id")

#: EAGLE-1/2 and EAGLE-3 draft RoPE base when the head's config has none (docs/heads.md 5.2).
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class EagleConfig:
    """Shape of an EAGLE head (``config.json`` beside the weights; published field names).

    Attributes:
        hidden_size: H, the draft layer's width (the target's hidden size for EAGLE-1/2).
        intermediate_size: I, the MLP width.
        num_attention_heads, num_key_value_heads: nh and nkv (nkv = nh when absent).
        vocab_size: V, the target's vocabulary.
        version: 1 (EAGLE-1/2 layout) or 3 (EAGLE-3).
        head_dim: hd; ``H // nh`` when absent.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: The draft's own RoPE base; 10000 when the config has none (never the target's).
        draft_vocab_size: EAGLE-3 reduced vocabulary (= V when not reduced).
        target_hidden_size: H_t, width of each target feature (EAGLE-3 fc input is 3 H_t).
        bias: fc has a bias (EAGLE-1/2 default true, ``"bias": false`` turns it off; EAGLE-3 none).
        qkv_bias: q/k/v projections have biases (Qwen2 drafts: ``qkv_bias``; ``attention_bias`` sets both).
        o_proj_bias: The attention output projection has a bias (HF ``attention_bias``).
        norm_before_residual: EAGLE-3 variant whose residual is hidden_norm(h) instead of h.
        aux_layers: EAGLE-3 target layers whose INPUT residual stream is the feature (docs/heads.md 5.1
            convention "input to decoder layer idx"); ``None`` = (2, N // 2, N - 3) for N target layers.
        draft_tree: The tree this head drafts by default, ``{"depth", "top_k", "total_tokens", "tree",
            "ngram"}`` (any subset; measured by whoever ships the head); flags override it. ``None`` =
            EAGLE-2's.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    version: int = 1
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    bias: bool = True
    qkv_bias: bool = False
    o_proj_bias: bool = False
    norm_before_residual: bool = False
    aux_layers: tuple[int, ...] | None = None
    draft_tree: dict | None = None

    def __post_init__(self):
        if self.version not in (1, 3):
            raise ValueError(f"EAGLE version must be 1 or 3, got {self.version}")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        if self.draft_vocab_size is None:
            set_("draft_vocab_size", self.vocab_size)
        if self.target_hidden_size is None:
            set_("target_hidden_size", self.hidden_size)
        if self.version == 3:
            set_("bias", False)
        if self.aux_layers is not None:
            set_("aux_layers", tuple(int(i) for i in self.aux_layers))

    @property
    def reduced_vocab(self) -> bool:
        return self.version == 3 and self.draft_vocab_size != self.vocab_size

    @classmethod
    def from_dict(cls, config: dict, version: int | None = None) -> EagleConfig:
        """Read a published EAGLE / EAGLE-3 / speculators ``config.json``.

        Honours a nested ``transformer_layer_config`` (speculators), ``rope_theta`` or
        ``rope_parameters.rope_theta`` (10000 when absent; a scaled RoPE type is refused), ``bias``
        (EAGLE-1/2 fc bias, default true), ``qkv_bias``/``attention_bias``, ``norm_before_residual``,
        ``target_hidden_size`` and the aux layer ids: our ``aux_layers`` (inputs of layers) or
        ``eagle_aux_hidden_state_layer_ids`` (speculators: top level; SGLang/vLLM: in ``eagle_config``;
        outputs of layers, so +1 here, docs/heads.md 5.1).

        Raises:
            ValueError: a required field is missing.
        """
        flat = {**config, **config.get("transformer_layer_config", {})}
        if version is None:
            version = int(flat.get("eagle_version", 3 if "draft_vocab_size" in flat else 1))
        aux = flat.get("aux_layers")
        ids = flat.get("eagle_aux_hidden_state_layer_ids") or (flat.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")  # speculators: top level; SGLang/vLLM configs: eagle_config
        if aux is None and ids is not None:
            aux = [i + 1 for i in ids]
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in flat.items() if k in known and v is not None}
        kwargs.update(version=version, aux_layers=aux)
        kwargs["qkv_bias"] = bool(flat.get("qkv_bias", flat.get("attention_bias", False)))
        kwargs["o_proj_bias"] = bool(flat.get("o_proj_bias", flat.get("attention_bias", False)))
        eagle = flat.get("eagle_config") or {}
        unsupported = [k for k in ("fc_norm", "norm_before_fc") if flat.get(k) or eagle.get(k)]
        if unsupported:
            raise ValueError(f"EAGLE head variant with {', '.join(unsupported)} is not supported; "
                             "use a head in the EAGLE-1/2, EAGLE-3 or plain speculators layout")
        rope = flat.get("rope_parameters") or {}  # transformers 5 (speculators) keeps the base here
        if "rope_theta" not in kwargs and isinstance(rope, dict) and rope.get("rope_theta") is not None:
            kwargs["rope_theta"] = rope["rope_theta"]
        scaling = rope.get("rope_type") if isinstance(rope, dict) else None
        if scaling not in (None, "default"):
            raise ValueError(
                f"EAGLE head with {scaling!r} RoPE scaling is not supported (mlxspec runs the draft "
                "layer with plain RoPE); use a head whose config has no rope scaling"
            )
        kwargs.setdefault("rope_theta", DEFAULT_ROPE_THETA)
        missing = [
            k
            for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
            if k not in kwargs
        ]
        if missing:
            raise ValueError(f"EAGLE config lacks {', '.join(missing)}; is this an EAGLE head's config.json?")
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """``config.json`` contents: our fields plus the published markers other tools read."""
        out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if v is not None}
        arch = "LlamaForCausalLMEagle3" if self.version == 3 else "LlamaForCausalLM"
        return {"architectures": [arch], "model_type": "llama", "num_hidden_layers": 1,
                "eagle_version": self.version, **out}

    def llama_args(self) -> llama.ModelArgs:
        """mlx-lm llama arguments for the one draft decoder layer (no RoPE scaling: docs/heads.md 4.3)."""
        return llama.ModelArgs(
            model_type="llama", hidden_size=self.hidden_size, num_hidden_layers=1,
            intermediate_size=self.intermediate_size, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, vocab_size=self.vocab_size, rope_theta=self.rope_theta,
            attention_bias=False, tie_word_embeddings=False,
        )

    def resolved_aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """EAGLE-3 tapped layers (inputs of these decoder layers), for a target of N layers."""
        N = num_target_layers
        return self.aux_layers if self.aux_layers is not None else (2, N // 2, N - 3)


def _attention(config: EagleConfig, input_width: int) -> nn.Module:
    """mlx-lm's llama attention with the head's own projection widths and biases."""
    attn = llama.Attention(config.llama_args())
    nh, nkv, hd, b = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.qkv_bias
    attn.q_proj = nn.Linear(input_width, nh * hd, bias=b)
    attn.k_proj = nn.Linear(input_width, nkv * hd, bias=b)
    attn.v_proj = nn.Linear(input_width, nkv * hd, bias=b)
    attn.o_proj = nn.Linear(nh * hd, config.hidden_size, bias=config.o_proj_bias)
    return attn


class Eagle3Layer(nn.Module):
    """EAGLE-3 ``midlayer``: attention over concat(input_layernorm(e), hidden_norm(h)) (2H wide),
    residual h (un-normed unless ``norm_before_residual``), then the usual MLP block."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        args, H = config.llama_args(), config.hidden_size
        self.self_attn = _attention(config, 2 * H)
        self.mlp = llama.MLP(args)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.input_layernorm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self._norm_before_residual = config.norm_before_residual

    def __call__(self, embeds: mx.array, h: mx.array, mask=None, cache=None) -> mx.array:
        normed = self.hidden_norm(h)
        z = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)  # [B, T, 2H]
        x = (normed if self._norm_before_residual else h) + self.self_attn(z, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """An EAGLE-1/2 or EAGLE-3 draft head (one decoder layer); parameters in the published layout.

    Args:
        config: The head's shape and version.
    """

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        if config.version == 1:
            self.fc = nn.Linear(2 * H, H, bias=config.bias)
            block = llama.TransformerBlock(config.llama_args())
            block.input_layernorm = nn.Identity()  # EAGLE-1/2: layer 0 has no input norm
            block.self_attn = _attention(config, H)
            self.layers = [block]
        else:
            self.fc = nn.Linear(3 * config.target_hidden_size, H, bias=False)
            self.midlayer = Eagle3Layer(config)
            self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
            if config.reduced_vocab:
                self.d2t = mx.zeros((config.draft_vocab_size,), dtype=mx.int32)
                self.t2d = mx.zeros((config.vocab_size,), dtype=mx.bool_)
                self.freeze(keys=["d2t", "t2d"], recurse=False)

    @property
    def attention(self) -> nn.Module:
        """The draft layer's attention module (its ``rope`` is what tree drafting wraps)."""
        return (self.layers[0] if self.config.version == 1 else self.midlayer).self_attn

    def __call__(self, features: mx.array, tokens: mx.array, embed, cache=None, mask=None) -> mx.array:
        """One draft-layer forward: predicted next features.

        Draft position j pairs the feature of target position j with the token at j + 1
        (docs/heads.md 4.1).

        Args:
            features (mx.array): [B, T, F]. EAGLE-1/2: the target's final normalised hidden
                states (F = H). EAGLE-3: the concatenated low/mid/high layer inputs (F = 3 H_t,
                passed through fc) or the draft's own previous output (F = H, fc skipped).
            tokens (mx.array): The next tokens, [B, T] int32 (target ids).
            embed: The target's token embedding (``model.model.embed_tokens``), ids -> [B, T, H].
            cache: An mlx-lm ``KVCache`` for the draft layer, or ``None``.
            mask: Attention mask for mlx-lm's attention (bool [T, S] / additive / ``"causal"``);
                ``None`` = causal when T > 1.

        Returns:
            mx.array: Draft hidden states [B, T, H] (pre-norm for EAGLE-3; the next step's feature).
        """
        if mask is None and tokens.shape[1] > 1:
            mask = "causal"
        embeds = embed(tokens).astype(self.fc.weight.dtype)  # [B, T, H]
        if self.config.version == 1:
            x = self.fc(mx.concatenate([embeds, features], axis=-1))  # [B, T, H]; embedding first
            return self.layers[0](x, mask, cache)
        h = self.fc(features) if features.shape[-1] != self.config.hidden_size else features
        return self.midlayer(embeds, h, mask, cache)

    def logits(self, hidden: mx.array, lm_head=None) -> mx.array:
        """Draft logits from draft hidden states.

        Args:
            hidden (mx.array): [..., H] from ``__call__``.
            lm_head: The target's LM head (``taps.output_head``); required for EAGLE-1/2.

        Returns:
            mx.array: [..., V] (EAGLE-1/2, target ids) or [..., V_draft] (EAGLE-3, draft ids;
            map them with ``target_ids``).
        """
        if self.config.version == 1:
            return lm_head(hidden)
        return self.lm_head(self.norm(hidden))

    def target_ids(self, draft_ids: mx.array) -> mx.array:
        """Draft-vocabulary ids -> target ids: ``id + d2t[id]`` (d2t is an OFFSET, docs/heads.md 5.4)."""
        if not self.config.reduced_vocab:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]


# --- checkpoints ---------------------------------------------------------------------------

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def _read_weights(path: Path) -> tuple[dict, Path]:
    if path.is_dir():
        for name in _WEIGHT_FILES:
            if (path / name).is_file():
                return _read_weights(path / name)
        shards = sorted(path.glob("*.safetensors"))
        if shards:
            return {k: v for s in shards for k, v in load_safetensors(s).items()}, path
        raise FileNotFoundError(
            f"no EAGLE weights in {path}: expected model.safetensors or pytorch_model.bin"
        )
    if not path.is_file():
        raise FileNotFoundError(f"no such EAGLE checkpoint: {path}")
    if path.suffix == ".safetensors":
        return load_safetensors(path), path.parent
    return load_torch_weights(path), path.parent


def _canonical(weights: dict) -> tuple[dict, int]:
    """Published names -> our parameter names, and the version the tensors say.

    EAGLE-1/2: ``fc.*``, ``layers.0.*`` (``embed_tokens`` dropped: the target's is shared).
    EAGLE-3: ``fc.weight``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``.
    speculators / vLLM EAGLE-3: ``layers.0.*`` for the midlayer and ``draft_id_to_target_id``
    (still an offset, docs/heads.md 5.7). A ``model.`` prefix (vLLM) is dropped.
    """
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    weights = {k: v for k, v in weights.items() if not k.startswith("embed_tokens.")}
    if "draft_id_to_target_id" in weights:
        weights["d2t"] = weights.pop("draft_id_to_target_id")
    v3 = any(k.startswith("midlayer.") for k in weights) or "d2t" in weights or "lm_head.weight" in weights \
        or "layers.0.hidden_norm.weight" in weights
    if v3:
        weights = {re.sub(r"^layers\.0\.", "midlayer.", k): v for k, v in weights.items()}
    return weights, 3 if v3 else 1


def _infer_config(weights: dict, version: int, config: dict | None) -> EagleConfig:
    """Fields from config.json where present, the rest from tensor shapes."""
    layer = "midlayer" if version == 3 else "layers.0"
    H = weights["fc.weight"].shape[0]
    base = dict(config or {})
    base.setdefault("hidden_size", H)
    base.setdefault("intermediate_size", weights[f"{layer}.mlp.gate_proj.weight"].shape[0])
    if "t2d" in weights:
        base["vocab_size"] = weights["t2d"].shape[0]
    if "num_attention_heads" not in base and "num_attention_heads" not in base.get(
        "transformer_layer_config", {}
    ):
        raise ValueError("the EAGLE checkpoint has no config.json giving num_attention_heads; "
                         "put the head's config.json beside its weights")
    if version == 3:
        base["draft_vocab_size"] = weights["lm_head.weight"].shape[0]
        base.setdefault("target_hidden_size", weights["fc.weight"].shape[1] // 3)
        base.setdefault("vocab_size", base["draft_vocab_size"])
    else:
        base["bias"] = "fc.bias" in weights
    base["qkv_bias"] = f"{layer}.self_attn.q_proj.bias" in weights
    base["o_proj_bias"] = f"{layer}.self_attn.o_proj.bias" in weights
    return EagleConfig.from_dict(base, version=version)


def check_fits(
    config: EagleConfig, target_hidden: int, target_vocab: int, source: str = "EAGLE head"
) -> None:
    """Refuse a head whose hidden size or vocabulary does not fit the target.

    Raises:
        ValueError: naming both sizes and the fix.
    """
    found_h = config.target_hidden_size if config.version == 3 else config.hidden_size
    if found_h != target_hidden:
        raise ValueError(f"{source} reads features of hidden size {found_h} but the target's hidden size is "
                         f"{target_hidden}; use a head trained for this target")
    if config.vocab_size != target_vocab:
        raise ValueError(f"{source} has vocabulary {config.vocab_size} but the target's is {target_vocab}; "
                         "use a head trained for this target")


def _check_shapes(head: EagleHead, weights: dict, source: str) -> None:
    layout = f"the EAGLE-{head.config.version} layout"
    check_tensors(head, weights, source, lacks=f"of {layout}; is it an EAGLE head?",
                  extra=f"that {layout} lacks; an unsupported variant of the head?", most=4)


def load_eagle(spec: str | Path, target: nn.Module | None = None, dtype=None) -> EagleHead:
    """Load an EAGLE-1/2 or EAGLE-3 head from a folder, a weights file or a Hugging Face repo.

    Layouts: EAGLE-1/2 (``fc.*``, ``layers.0.*``, optional ``embed_tokens``), EAGLE-3
    (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) and the speculators/vLLM
    EAGLE-3 variant (``layers.0.*``, ``draft_id_to_target_id``). Safetensors are read directly,
    torch ``.bin`` only through the weights-only ``pickle_reader``; repos are fetched without code.

    Args:
        spec: A folder (``config.json`` + weights), a ``.safetensors``/``.bin`` file, or a repo id.
        target: The target model; when given the head must fit its hidden size and vocabulary.
        dtype: Cast float weights to this dtype. Default: the target's compute dtype, else float32.

    Returns:
        EagleHead: Evaluated, in eval mode.

    Raises:
        FileNotFoundError: no weights found.
        ValueError: not an EAGLE layout, config and tensors disagree, or the head does not fit the target.
    """
    try:
        raw, folder = _read_weights(eagle_folder(str(spec)))
        config_path = folder / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else None
    except json.JSONDecodeError:
        raise ValueError(f"{config_path} is not JSON; {PASS_HEAD}") from None
    except ValueError as e:  # damaged, or no checkpoint at all
        raise ValueError(f"{one_line(e)}; {PASS_HEAD}") from None
    weights, version = _canonical(raw)
    if "fc.weight" not in weights:
        raise ValueError(f"{spec} has no fc.weight: not an EAGLE head checkpoint; {PASS_HEAD}")
    cfg = _infer_config(weights, version, config)
    if target is not None:
        check_fits(cfg, target.args.hidden_size, logits_width(target), f"EAGLE head {spec}")
    if not cfg.reduced_vocab:  # draft vocabulary = target vocabulary: the mapping is the identity
        weights.pop("d2t", None), weights.pop("t2d", None)
    elif "t2d" not in weights and "d2t" in weights:  # speculators drop t2d
        weights["t2d"] = _t2d_from_d2t(weights["d2t"], cfg.vocab_size)
    head = EagleHead(cfg)
    _check_shapes(head, weights, str(spec))
    if dtype is None:
        dtype = embedding_dtype(target)
    cast = {k: (v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in weights.items()}
    if "d2t" in cast:
        cast["d2t"] = cast["d2t"].astype(mx.int32)
    if "t2d" in cast:
        cast["t2d"] = cast["t2d"].astype(mx.bool_)
    head.load_weights(list(cast.items()), strict=True)
    mx.eval(head.parameters())
    head.eval()
    return head


def _t2d_from_d2t(d2t: mx.array, vocab_size: int) -> mx.array:
    ids = np.arange(d2t.shape[0]) + np.array(d2t)
    mask = np.zeros(vocab_size, dtype=bool)
    mask[ids] = True
    return mx.array(mask)


def save_eagle(head: EagleHead, folder: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the published EAGLE layout.

    EAGLE-1/2: ``fc.*``, ``layers.0.*``; EAGLE-3: ``fc.weight``, ``midlayer.*``, ``norm.weight``,
    ``lm_head.weight`` and, with a reduced vocabulary, ``d2t`` (int64 offsets) and ``t2d`` (bool).
    """
    weights = dict(tree_flatten(head.parameters()))
    if "d2t" in weights:
        weights["d2t"] = weights["d2t"].astype(mx.int64)
    write_checkpoint(folder, weights, head.config.to_dict())


def eagle_folder(spec: str) -> Path:
    """A local folder or file, or a Hugging Face repo id fetched with ``huggingface_hub``
    (JSON, safetensors and, for the weights-only reader, ``pytorch_model.bin``).

    Raises:
        FileNotFoundError: a path that does not exist and does not look like a repo id.
        ValueError: a repo that cannot be fetched.
    """
    return local_or_hub(
        spec, ["*.json", "*.safetensors", "pytorch_model.bin"], "no such EAGLE head folder or file"
    )
