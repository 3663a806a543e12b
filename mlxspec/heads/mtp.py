"""Multi-token-prediction (MTP) modules: the extra layers DeepSeek-V3, GLM and Qwen3.5 ship, and ours.

DeepSeek-AI 2024, DeepSeek-V3 technical report (arXiv 2412.19437), section 2.2: MTP module k takes
the representation h_t of position t and the embedding of token t + 1, each RMS-normed, projects
their concatenation, x = M [RMSNorm(h_t); RMSNorm(Emb(t_{t+1}))] (embedding first), runs one
transformer block and the shared output head: a distribution over token t + 2 (docs/heads.md 7.1).

Published checkpoints carry these weights beside the main model, where mlx-lm's model classes drop
them at load time; ``load_mtp`` reads them straight from the safetensors (docs/heads.md 7.2):

- DeepSeek-V3 / GLM-4.5 / GLM-4.7-Flash: ``num_nextn_predict_layers`` extra decoder layers
  ``model.layers.{N + i}.`` (N = ``num_hidden_layers``) holding ``enorm``, ``hnorm``, ``eh_proj``,
  ``shared_head.norm``, optionally ``shared_head.head`` and ``embed_tokens``, and the block itself.
- Qwen3.5 / Qwen3-Next: one module ``mtp.`` with ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``,
  ``fc``, ``mtp_num_hidden_layers`` blocks ``mtp.layers.{i}.`` and ``norm``.

The block is a fresh instance of the target's own decoder-layer class (mlx-lm's), and its weights go
through the target's own ``sanitize`` (MoE experts stacked, FP8 dequantised), so there is no
per-model code. mlxspec saves modules it trains in the DeepSeek layout (``save_mtp``).
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.base import create_attention_mask

from ..core.taps import _Recorder, logits_width, model_body
from ..loading.weights import one_line
from .checkpoints import load_safetensors, read_config

TRAIN_COMMAND = "mlxspec train mtp --model TARGET --corpus CORPUS -o DIR"
#: How an error about a file that holds no usable MTP layers ends: what to pass instead.
PASS_MTP = (
    "pass --mtp-weights with the folder of a model that ships MTP layers or of one 'mlxspec train mtp' wrote"
)
#: ``config.json`` fields that must be whole numbers when given.
_COUNTS = ("num_hidden_layers", "num_nextn_predict_layers", "mtp_num_hidden_layers", "draft_depth")


@dataclass(frozen=True)
class MTPConfig:
    """What an MTP checkpoint holds (docs/heads.md 7.2).

    Attributes:
        layout: ``"deepseek"`` (``model.layers.{N + i}.``) or ``"qwen"`` (``mtp.``).
        num_modules: Chained modules (DeepSeek ``num_nextn_predict_layers``; Qwen: 1).
        num_blocks: Decoder blocks inside each module (Qwen ``mtp_num_hidden_layers``; DeepSeek: 1).
        hidden_size: H.
        own_head: The checkpoint has its own output head (``shared_head.head``); else the target's.
        source: Where it was read from.
        draft_depth: The chain depth to draft by default (``config.json`` ``draft_depth``, set by
            whoever measured the module), or ``None``.
    """

    layout: str
    num_modules: int
    num_blocks: int
    hidden_size: int
    own_head: bool = False
    source: str = ""
    draft_depth: int | None = None


class MTPModule(nn.Module):
    """One MTP module: RMSNorm both inputs, project 2H → H, decoder block(s), final norm.

    Args:
        blocks: Decoder layers of the target's class (each called ``block(x, mask, cache)``).
        hidden_size: H.
        eps: RMSNorm epsilon.
        vocab_size: V, to give the module its own output head; ``None`` = the target's.
        published: A published module in the DeepSeek-V3 layout (DeepSeek, GLM; not one ``mlxspec train
            mtp`` wrote): run it as vLLM's and SGLang's ``deepseek_mtp`` do, the token embedding at position 0
            zeroed and a chain fed the block's output before the final norm. Qwen3.5/Qwen3-Next modules
            (vLLM's ``qwen3_next_mtp``: neither) and mlxspec's own (trained so) run with neither.
    """

    def __init__(self, blocks: list[nn.Module], hidden_size: int, eps: float, vocab_size: int | None = None,
                 published: bool = False):
        super().__init__()
        self.published = published
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.blocks = blocks
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        if vocab_size is not None:
            self.head = nn.Linear(hidden_size, vocab_size, bias=False)

    def __call__(
        self, hidden: mx.array, tokens: mx.array, embed, cache=None, mask=None, raw: bool = False
    ) -> mx.array:
        """Normed output [B, T, H] (``raw``: before the final norm) for features ``hidden`` [B, T, H] and the
        next tokens [B, T] int32.

        A published DeepSeek-layout module zeroes the token embedding at absolute position 0, as vLLM's
        and SGLang's DeepSeek/GLM MTP forwards do ("not needed by MTP"); every later position attends to it.

        ``cache``: one mlx-lm cache per block, or ``None``; ``mask``: the attention mask (``None`` =
        mlx-lm's causal mask for the cache, as an array).
        """
        e = embed(tokens)  # [B, T, H]
        if self.published and (cache[0].offset if cache is not None else 0) == 0:  # as vLLM, SGLang
            e = mx.concatenate([mx.zeros_like(e[:, :1]), e[:, 1:]], axis=1)
        x = self.eh_proj(mx.concatenate([self.enorm(e), self.hnorm(hidden)], axis=-1))  # [B, T, H]
        for i, block in enumerate(self.blocks):
            c = cache[i] if cache is not None else None
            # an array mask: some attentions (DeepSeek's MLA) take no "causal" string
            m = mask if mask is not None else create_attention_mask(x, c, return_array=True)
            x = block(x, m, c)
        return x if raw else self.norm(x)

    def chain_feature(self, raw: mx.array, normed: mx.array) -> mx.array:
        """What the next chain step reads as h: the block output before the final norm (a published module,
        DeepSeek-V3 section 2.2 and vLLM), or the normed output (mlxspec's modules, trained so)."""
        return raw if self.published else normed

    def logits(self, out: mx.array, lm_head) -> mx.array:
        """Draft logits [..., V] from the module's output [..., H]: its own head, else the target's."""
        return self.head(out) if "head" in self else lm_head(out)


class MTPStack(nn.Module):
    """The MTP modules of one target (``modules[0]`` drafts every depth, docs/heads.md 7.3).

    Exposes what the EAGLE training code reads (``__call__(features, tokens, embed)`` and
    ``attention_owner``), so training reuses its unrolled forward and held-out scores.
    """

    def __init__(self, modules: list[MTPModule], config: MTPConfig, draft_ids: np.ndarray | None = None):
        super().__init__()
        self.chain = modules
        self.config = config
        #: The draft vocabulary (sorted target ids [N] int32, ``draft_vocab.safetensors``) the drafter samples
        #: from, or ``None`` for the whole vocabulary (docs/heads.md 7.4). A numpy array: not a parameter.
        self.draft_ids = draft_ids

    @property
    def first(self) -> MTPModule:
        return self.chain[0]

    @property
    def attention_owner(self) -> nn.Module:
        """The block whose ``self_attn`` the training-time test replaces."""
        return self.first.blocks[0]

    def __call__(self, hidden, tokens, embed, cache=None, mask=None):
        return self.first(hidden, tokens, embed, cache=cache, mask=mask)

    def logits(self, out: mx.array, lm_head) -> mx.array:
        return self.first.logits(out, lm_head)


def new_block(target: nn.Module) -> nn.Module:
    """A fresh decoder layer of the target's last layer's class (mlx-lm), float32, at index N (in a hybrid
    linear-attention model, at the index of its last full-attention layer: MTP blocks are full attention).

    Raises:
        ValueError: the target is not an mlx-lm decoder model with ``args``.
    """
    body = model_body(target)
    layers = [layer.inner if isinstance(layer, _Recorder) else layer for layer in body.layers]
    cls, args = type(layers[-1]), getattr(target, "args", None)
    if args is None:
        raise ValueError(
            f"{type(target).__name__} has no mlx-lm args; MTP drafting needs an mlx-lm decoder model"
        )
    index = len(layers)
    if not all(hasattr(layer, "self_attn") for layer in layers):  # hybrid (Qwen3-Next/3.5): the MTP block is
        index = max(i for i, layer in enumerate(layers) if hasattr(layer, "self_attn"))  # full attention
    takes_index = len(inspect.signature(cls.__init__).parameters) > 2
    return cls(args, index) if takes_index else cls(args)


def _module(target: nn.Module, num_blocks: int, own_head: bool, published: bool = False) -> MTPModule:
    args = target.args
    eps = getattr(args, "rms_norm_eps", 1e-6)
    vocab = logits_width(target) if own_head else None
    return MTPModule([new_block(target) for _ in range(num_blocks)], args.hidden_size, eps, vocab, published)


# --- reading published checkpoints ---------------------------------------------------------------


def _config(folder: Path) -> dict:
    """``folder/config.json`` with a multimodal model's ``text_config`` merged in.

    Raises:
        ValueError: not a JSON object, or a count that is not a whole number.
    """
    path = folder / "config.json"
    config = read_config(path)
    text = config.get("text_config") or {}
    if not isinstance(text, dict):
        raise ValueError(f"{path} gives text_config = {text!r}, not a JSON object")
    config = {**config, **text}
    for key in _COUNTS:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{path} gives {key} = {value!r}, not a whole number")
    return config


def _safetensors_keys(path: Path) -> list[str]:
    """The tensor names in a safetensors file's header (the data is not read)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size)) if 0 < size < 1 << 28 else {}
    return [k for k in header if k != "__metadata__"]


def _is_mtp_key(config: dict):
    """Which tensor names are MTP tensors under ``config``: ``mtp.*`` and layers at or past N."""
    N = config.get("num_hidden_layers")

    def wanted(key: str) -> bool:
        if key.startswith("mtp."):
            return True
        m = re.match(r"model\.layers\.(\d+)\.", key)
        return N is not None and m is not None and int(m.group(1)) >= N

    return wanted


def has_mtp(folder: str | Path) -> bool:
    """Whether a model folder's safetensors hold MTP tensors (reads headers only; never raises)."""
    folder = Path(folder)
    try:
        wanted = _is_mtp_key(_config(folder))
        return any(wanted(k) for path in _files(folder, wanted) for k in _safetensors_keys(path))
    except (OSError, ValueError):
        return False


def _files(folder: Path, wanted) -> list[Path]:
    """The safetensors files that hold keys ``wanted(key)`` accepts: through the index when there is one, else
    ``model*.safetensors`` (so an optimizer state beside a module is never read as one)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_config(index).get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map object; is the download complete?")
        return sorted({folder / str(f) for k, f in weight_map.items() if wanted(k)})
    return sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))


def _read(folder: Path, wanted) -> dict[str, mx.array]:
    out = {}
    for path in _files(folder, wanted):
        weights = load_safetensors(path)
        out.update({k: v for k, v in weights.items() if wanted(k)})
    return out


def _deepseek_prefixes(config: dict, keys, folder: Path) -> list[str]:
    """``model.layers.{N + i}.`` for each MTP layer present (``num_nextn_predict_layers`` of them when
    set)."""
    N, count = config.get("num_hidden_layers"), int(config.get("num_nextn_predict_layers") or 0)
    found = []
    while N is not None and f"model.layers.{N + len(found)}.eh_proj.weight" in keys:
        found.append(f"model.layers.{N + len(found)}.")
    if 0 < len(found) < count:
        raise ValueError(
            f"{folder}/config.json says num_nextn_predict_layers = {count} but the safetensors hold "
            f"{len(found)} MTP layer(s); is the download complete?"
        )
    return found[:count] if count else found


def _canonical(raw: dict[str, mx.array], layout: str, prefix: str, num_blocks: int) -> dict[str, mx.array]:
    """One module's tensors under ``MTPModule``'s names, blocks as ``blocks.{i}.``."""
    out = {}
    for key, value in raw.items():
        rest = key[len(prefix):]
        if layout == "qwen":
            rest = {"fc.weight": "eh_proj.weight", "pre_fc_norm_embedding.weight": "enorm.weight",
                    "pre_fc_norm_hidden.weight": "hnorm.weight"}.get(rest, rest)
            rest = re.sub(r"^layers\.(\d+)\.", r"blocks.\1.", rest)
        else:
            rest = {"shared_head.norm.weight": "norm.weight", "shared_head.head.weight": "head.weight"}.get(
                rest, rest
            )
            if not re.match(r"(enorm|hnorm|eh_proj|norm|head|embed_tokens)\.", rest):
                rest = "blocks.0." + rest
        out[rest] = value
    return out


def _sanitize_blocks(target: nn.Module, weights: dict[str, mx.array], num_blocks: int) -> dict[str, mx.array]:
    """Each block's tensors through the target's own ``sanitize``, as if they were its layer 0."""
    if not hasattr(target, "sanitize"):
        return weights
    out = {k: v for k, v in weights.items() if not k.startswith("blocks.")}
    for i in range(num_blocks):
        head = f"blocks.{i}."
        block = {"model.layers.0." + k[len(head):]: v for k, v in weights.items() if k.startswith(head)}
        for k, v in target.sanitize(block).items():
            if k.startswith("model.layers.0."):
                out[head + k[len("model.layers.0."):]] = v
    # the module's own norms as the target's final norm: a family whose checkpoints store zero-centred norms
    # (Qwen3-Next: w - 1) has its sanitize add the 1 back, to these as to the block's (found by
    # test_parity_mtp)
    first = {
        "model.layers.0." + k[len("blocks.0.") :]: v for k, v in weights.items() if k.startswith("blocks.0.")
    }
    for name in ("enorm.weight", "hnorm.weight", "norm.weight"):
        if name in out:
            out[name] = target.sanitize({**first, "model.norm.weight": out[name]})["model.norm.weight"]
    return out


def _missing_error(source: str) -> ValueError:
    return ValueError(
        f"{source} holds no MTP layers (no model.layers.{{num_hidden_layers}}.eh_proj or mtp.* "
        f"tensors); pass --mtp-weights with a checkpoint that has them, or train a module: {TRAIN_COMMAND}"
    )


def load_mtp(path: str | Path, target: nn.Module, dtype=None) -> MTPStack:
    """Read the MTP module(s) of a checkpoint folder for ``target`` (docs/heads.md 7.2).

    Args:
        path: A folder with ``config.json`` and safetensors: a published model that ships MTP layers
            (its own folder, MTP tensors beside the main model's), or one ``save_mtp`` wrote.
        target: The target (its decoder-layer class, sizes, embedding and ``sanitize``).
        dtype: Cast floating weights to this dtype; ``None`` keeps the target's embedding dtype.

    Returns:
        MTPStack: evaluated, in eval mode.

    Raises:
        FileNotFoundError: no such folder or no ``config.json``.
        ValueError: no MTP tensors (naming how to get a module), a missing part, or sizes that do
            not fit the target (both named).
    """
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder} has no config.json; pass the folder of a model with MTP layers or one "
            f"'mlxspec train mtp' wrote"
        )
    try:
        config = _config(folder)
        raw = _read(folder, _is_mtp_key(config))
    except ValueError as e:  # damaged, or no checkpoint at all
        raise ValueError(f"{one_line(e)}; {PASS_MTP}") from None
    if any(k.startswith("mtp.") for k in raw):
        layout, prefixes = "qwen", ["mtp."]
        blocks = {int(m.group(1)) for k in raw if (m := re.match(r"mtp\.layers\.(\d+)\.", k))}
        num_blocks = int(config.get("mtp_num_hidden_layers") or len(blocks) or 0)
    else:
        layout, prefixes, num_blocks = "deepseek", _deepseek_prefixes(config, raw, folder), 1
    if not prefixes or num_blocks < 1:
        raise _missing_error(str(folder))
    own_head = all(f"{p}shared_head.head.weight" in raw for p in prefixes) and layout == "deepseek"
    stack_config = MTPConfig(
        layout,
        len(prefixes),
        num_blocks,
        target.args.hidden_size,
        own_head,
        str(folder),
        config.get("draft_depth"),
    )
    modules = []
    for prefix in prefixes:
        weights = _canonical(
            {k: v for k, v in raw.items() if k.startswith(prefix)}, layout, prefix, num_blocks
        )
        weights.pop("embed_tokens.weight", None)  # DeepSeek/GLM duplicate the target's embedding
        weights = _sanitize_blocks(target, weights, num_blocks)
        published = layout == "deepseek" and not config.get("mlxspec_mtp", False)  # save_mtp marks ours
        modules.append(_fill(_module(target, num_blocks, own_head, published), weights, prefix, folder))
    stack = MTPStack(modules, stack_config, read_draft_vocab(folder, logits_width(target)))
    cast = dtype or model_body(target).embed_tokens.weight.dtype
    if cast in (mx.float16, mx.bfloat16, mx.float32):
        stack.set_dtype(cast)
    mx.eval(stack.parameters())
    stack.eval()
    return stack


def _fill(module: MTPModule, weights: dict[str, mx.array], prefix: str, folder: Path) -> MTPModule:
    """Load ``weights`` into ``module`` (quantized first where the checkpoint is), naming what does not
    fit."""
    if any(k.endswith("_scale_inv") for k in weights):
        raise ValueError(
            f"the MTP layer {prefix}* in {folder} is FP8 and this target's mlx-lm class does not "
            "dequantize it; convert the checkpoint to bfloat16 first"
        )
    quantized = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    if quantized:
        bits_groups = _quantization(folder)
        nn.quantize(module, **bits_groups, class_predicate=lambda p, m: p in quantized)
    have = dict(tree_flatten(module.parameters()))
    missing = sorted(set(have) - set(weights))
    if missing:
        raise ValueError(f"the MTP layer {prefix}* in {folder} lacks {', '.join(missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''}; is the checkpoint complete?")
    for name, value in have.items():
        if weights[name].shape != value.shape:
            raise ValueError(
                f"MTP tensor {prefix}{name} in {folder} has shape {tuple(weights[name].shape)} but this "
                f"target needs {tuple(value.shape)}; use MTP layers made for this target"
            )
    module.update(tree_unflatten([(k, weights[k]) for k in have]))
    return module


def _quantization(folder: Path) -> dict:
    config = read_config(folder / "config.json")
    q = config.get("quantization") or config.get("quantization_config") or {}
    return {"group_size": int(q.get("group_size", 64)), "bits": int(q.get("bits", 4))}


# --- modules trained here ------------------------------------------------------------------------


def init_mtp(target: nn.Module) -> MTPStack:
    """A fresh module for a target that has none, its block initialised from the target's last layer.

    The norms start at one, the projection at [I | I] (embedding plus feature), the final norm as the
    target's, and the output head is the target's (docs/heads.md 7.5).

    Args:
        target: The target (float32 for training).
    """
    module = _module(target, 1, own_head=False)
    body = model_body(target)
    last = body.layers[-1]
    last = last.inner if isinstance(last, _Recorder) else last
    module.blocks[0].update(last.parameters())
    H = target.args.hidden_size
    module.eh_proj.weight = mx.concatenate([mx.eye(H), mx.eye(H)], axis=1)
    norm = body.norm.inner if isinstance(body.norm, _Recorder) else body.norm
    module.norm.weight = mx.array(norm.weight)
    stack = MTPStack([module], MTPConfig("deepseek", 1, 1, H, False, "init"))
    stack.set_dtype(mx.float32)
    mx.eval(stack.parameters())
    return stack


#: The optional file beside a module that holds its draft vocabulary (tensor ``ids``, sorted target ids).
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def read_draft_vocab(folder: Path, vocab_size: int) -> np.ndarray | None:
    """The draft vocabulary in ``folder/draft_vocab.safetensors``: sorted distinct ids [N] int32, or ``None``
    when the file is absent (the whole vocabulary, as published MTP layers draft).

    Raises:
        ValueError: a damaged file, or ids that are not distinct, sorted and below ``vocab_size``.
    """
    path = folder / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    ids = load_safetensors(path).get("ids")
    ids = np.array(ids).astype(np.int64) if ids is not None else None
    if ids is None or ids.ndim != 1 or len(ids) == 0 or ids[0] < 0 or ids[-1] >= vocab_size \
            or np.any(np.diff(ids) <= 0):
        raise ValueError(
            f"{path} must hold 'ids', distinct sorted token ids below this target's vocabulary of "
            f"{vocab_size}; delete it to draft from the whole vocabulary"
        )
    return ids.astype(np.int32)


def save_mtp(stack: MTPStack, folder: str | Path, target: nn.Module, extra: dict | None = None,
             draft_ids: np.ndarray | None = None) -> None:
    """Write ``stack`` in the DeepSeek layout ``load_mtp`` reads: ``config.json`` + ``model.safetensors``.

    Tensors are ``model.layers.{N + i}.{enorm,hnorm,eh_proj}``, ``.shared_head.norm``, the block's own
    names; ``config.json`` holds ``num_hidden_layers`` N and ``num_nextn_predict_layers``.

    Args:
        stack: The modules (one block each).
        folder: Output folder (created).
        target: The target they were trained for (N, and its config fields for the record).
        extra: More ``config.json`` fields (e.g. ``draft_depth``).
        draft_ids: A draft vocabulary to write as ``draft_vocab.safetensors`` (sorted target ids), or
            ``None`` (the stack's own, if any).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    N = len(model_body(target).layers)
    weights = {}
    for i, module in enumerate(stack.chain):
        prefix = f"model.layers.{N + i}."
        for name, value in tree_flatten(module.parameters()):
            name = {"norm.weight": "shared_head.norm.weight", "head.weight": "shared_head.head.weight"}.get(
                name, name
            )
            name = re.sub(r"^blocks\.0\.", "", name)
            weights[prefix + name] = value
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    args = (
        {k: v for k, v in asdict(target.args).items() if isinstance(v, (int, float, str, bool, type(None)))}
        if hasattr(target.args, "__dataclass_fields__")
        else {}
    )
    config = {**args, "num_hidden_layers": N, "num_nextn_predict_layers": len(stack.chain),
              "mlxspec_mtp": True, **(extra or {})}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    draft_ids = draft_ids if draft_ids is not None else stack.draft_ids
    if draft_ids is not None:
        mx.save_safetensors(
            str(folder / DRAFT_VOCAB_FILE), {"ids": mx.array(np.asarray(draft_ids), dtype=mx.int32)}
        )
