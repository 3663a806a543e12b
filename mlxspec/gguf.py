"""Load a llama-architecture GGUF file as an mlx-lm model and tokenizer.

Weights come from ``mx.load``, which returns Q4_0, Q4_1 and Q8_0 tensors as MLX affine
quantized (weight, scales, biases) triples with group size 32, and F32/F16 tensors as plain
arrays. Those are the only tensor types accepted: ``mx.load`` silently converts some others
(BF16, K-quants) to float16, so types are checked first from the file header.

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` so that RoPE can rotate
interleaved pairs; the rows are permuted back here (quantization groups run along the input
dimension, so scales and biases rows follow the weight rows), and the standard
``mlx_lm.models.llama`` model runs unchanged.

The tokenizer is rebuilt from the metadata (``tokenizer.ggml.*``, byte-level BPE) with the
``tokenizers`` library; tokens of type CONTROL (3) become special tokens, so a chat template's
``<|im_start|>`` stays one token.

GGUF format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import re
import struct
import warnings
from collections import Counter
from dataclasses import dataclass
from math import prod
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
from mlx_lm.utils import infer_quant_config
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)
from transformers import PreTrainedTokenizerFast

from mlxspec.loading import _one_line, check_dtype, finish

SUPPORTED_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q8_0,
)
"""Tensor types ``load_gguf`` accepts."""

SUPPORTED_ARCHITECTURES = ("llama",)
"""Values of ``general.architecture`` ``load_gguf`` accepts."""

_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TENSOR_NAME = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|scales|biases)$")

# Scalar GGUF value types and their little-endian struct formats
# (GGUF spec: "gguf_metadata_value_type").
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}

# Pre-tokenizer split rules by ``tokenizer.ggml.pre`` (llama.cpp's names; regexes as in the models'
# tokenizer.json files). ``None`` means GPT-2's rule, which the ByteLevel pre-tokenizer applies.
_GPT2 = None
_DIGITS_THEN_GPT2 = "digits"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
_CONTROL, _USER_DEFINED = (
    3,
    4,
)  # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of a GGUF header's tensor table.

    Attributes:
        type (GGMLQuantizationType): Storage type, e.g. ``Q4_1``.
        shape (tuple[int, ...]): Shape in row-major order (rows first), as ``mx.load`` returns it.
    """

    type: GGMLQuantizationType
    shape: tuple[int, ...]


@dataclass(frozen=True)
class GGUFHeader:
    """What ``read_header`` reads: scalar metadata and the tensor table (no array values).

    Attributes:
        scalars (dict[str, int | float | bool | str]): Metadata that are not arrays.
        tensors (dict[str, GGUFTensorInfo]): Tensor table, by GGUF tensor name.
    """

    scalars: dict
    tensors: dict


def load_gguf(
    path: str | Path, *, dtype: str | None = None
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a llama GGUF file as an ``mlx_lm.models.llama.Model`` and its tokenizer.

    Args:
        path (str | Path): The ``.gguf`` file.
        dtype (str | None): ``None`` keeps quantized tensors quantized (per-layer bits: e.g. a
            Q8_0 embedding and Q4_1 linears) and F16/F32 tensors as they are; ``"float32"``,
            ``"float16"`` or ``"bfloat16"`` dequantizes everything and casts to it.
            Default: ``None``.

    Returns:
        tuple[nn.Module, TokenizerWrapper]: The model in eval mode with evaluated weights, and
        a tokenizer with the file's chat template and a BPE streaming detokenizer.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: bad ``dtype``; not a GGUF file, or a corrupt or truncated one; a tensor type
            other than F32, F16, Q4_0, Q4_1, Q8_0; an architecture other than llama; missing
            metadata or tensors; a tokenizer other than byte-level BPE (``gpt2``).
    """
    check_dtype(dtype)
    path = Path(path)
    header = read_header(path)
    _check_architecture(header, path)
    _check_tensor_types(header, path)
    weights, metadata = _read_weights(path)
    args = model_args(metadata, weights, path)
    model = llama.Model(args)
    weights = llama_weights(weights, args, path)
    _quantize_like(model, weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(
            f"{path.name}: tensors do not fit a llama model: {_one_line(e)}"
        ) from e
    tokenizer = gguf_tokenizer(metadata, path)
    return finish(model, dtype), tokenizer


def read_header(path: str | Path) -> GGUFHeader:
    """Read a GGUF header: scalar metadata and the tensor table, skipping array values.

    ``gguf.GGUFReader`` builds an object per token string and takes seconds on a 49k-token
    vocabulary; this pass takes tens of milliseconds. It also checks that every tensor's data
    lies inside the file.

    Args:
        path (str | Path): The ``.gguf`` file.

    Returns:
        GGUFHeader: Scalars and tensor infos.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a GGUF file (bad magic), an unsupported version, or a corrupt or
            truncated file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No such GGUF file: {path}; check the path.")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty, not a GGUF file; download it again.")
    with (
        open(path, "rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf,
    ):
        magic, version = struct.unpack_from("<II", buf.read(8).ljust(8, b"\0"))
        if magic != GGUF_MAGIC:
            raise ValueError(
                f"{path} is not a GGUF file (bad magic number); pass a .gguf file."
            )
        if version not in (2, 3):
            raise ValueError(
                f"{path}: GGUF version {version} is not supported (only 2 and 3)."
            )
        try:
            return _parse_header(buf)
        except (struct.error, ValueError, UnicodeDecodeError, OverflowError) as e:
            raise ValueError(
                f"{path} is corrupt or truncated ({_one_line(e)}); download it again."
            ) from e


def gguf_type_label(path: str | Path) -> str | None:
    """The dominant storage type of a GGUF's matrices, e.g. ``"Q4_1"``; ``None`` if unreadable."""
    try:
        header = read_header(path)
    except (OSError, ValueError):
        return None
    counts = Counter(t.type.name for t in header.tensors.values() if len(t.shape) == 2)
    return counts.most_common(1)[0][0] if counts else None


def model_args(
    metadata: dict, weights: dict[str, mx.array], path: Path
) -> llama.ModelArgs:
    """``mlx_lm.models.llama.ModelArgs`` from GGUF metadata.

    Args:
        metadata (dict): Metadata as ``mx.load(..., return_metadata=True)`` returns it.
        weights (dict[str, mx.array]): Tensors by GGUF name (for the vocabulary size and
            whether the output layer is tied to the embedding).
        path (Path): The file, for error messages.

    Returns:
        llama.ModelArgs: With ``rope_traditional=False`` (q/k rows are un-permuted on load).

    Raises:
        ValueError: required metadata or the ``token_embd`` tensor is missing, or the file
            uses a RoPE variant that is not supported.
    """
    arch = str(metadata.get("general.architecture"))

    def get(key: str, default=None):
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(
                f"{path.name} lacks metadata '{arch}.{key}'; the file is incomplete."
            )
        return value.item() if isinstance(value, mx.array) else value

    if "token_embd.weight" not in weights:
        raise ValueError(
            f"{path.name} has no token_embd.weight tensor; the file is incomplete."
        )
    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(
            f"{path.name}: partial RoPE (rope.dimension_count != head size) is not supported."
        )
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(get("block_count")),
        intermediate_size=int(get("feed_forward_length")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        vocab_size=weights["token_embd.weight"].shape[0],
        max_position_embeddings=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_traditional=False,
        rope_scaling=_rope_scaling(metadata, arch, path),
        tie_word_embeddings="output.weight" not in weights,
    )


def llama_weights(
    weights: dict[str, mx.array], args: llama.ModelArgs, path: Path
) -> dict[str, mx.array]:
    """Rename GGUF tensors to mlx-lm llama names and un-permute q/k rows.

    Args:
        weights (dict[str, mx.array]): From ``mx.load``; a quantized tensor ``X.weight`` comes
            with ``X.scales`` and ``X.biases``, all with the output dimension as rows.
        args (llama.ModelArgs): Head counts for the un-permutation.
        path (Path): The file, for error messages.

    Returns:
        dict[str, mx.array]: Tensors by mlx-lm parameter path, e.g.
        ``model.layers.0.self_attn.q_proj.scales``.

    Raises:
        ValueError: a tensor that has no place in a llama model (e.g. ``rope_freqs``).
    """
    heads = {"attn_q": args.num_attention_heads, "attn_k": args.num_key_value_heads}
    renamed = {}
    for name, value in weights.items():
        match = _TENSOR_NAME.match(name)
        block, part, suffix = match.groups() if match else (None, None, None)
        table = _BLOCK_NAMES if block is not None else _TOP_NAMES
        if part not in table:
            raise ValueError(
                f"{path.name}: tensor '{name}' has no place in a llama model (mlxspec maps "
                "token_embd, output_norm, output and blk.N.attn_*/ffn_*); this variant is "
                "not supported."
            )
        if block is not None and part in heads:
            value = unpermute_rows(value, heads[part])
        prefix = f"model.layers.{block}." if block is not None else ""
        renamed[f"{prefix}{table[part]}.{suffix}"] = value
    return renamed


def unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's row permutation of a q or k projection.

    llama.cpp (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders each head's rows
    from [first halves, second halves] to interleaved pairs; this is its inverse.

    Args:
        x (mx.array): Rows ``n_heads * head_dim`` first, any trailing shape, e.g. ``[H*D, in]``
            weights, ``[H*D, in/32]`` scales or biases.
        n_heads (int): Query heads for ``attn_q``, key/value heads for ``attn_k``.

    Returns:
        mx.array: Same shape and dtype, rows in the Hugging Face order.
    """
    rows, rest = x.shape[0], x.shape[1:]
    x = x.reshape(n_heads, rows // n_heads // 2, 2, *rest)  # [H, D/2, 2, ...]
    return x.swapaxes(1, 2).reshape(rows, *rest)  # [H, 2, D/2, ...] -> [H*D, ...]


def gguf_tokenizer(metadata: dict, path: Path) -> TokenizerWrapper:
    """Build the tokenizer a GGUF describes (byte-level BPE: ``tokenizer.ggml.model`` "gpt2").

    Args:
        metadata (dict): Metadata as ``mx.load(..., return_metadata=True)`` returns it.
        path (Path): The file, for error messages.

    Returns:
        TokenizerWrapper: CONTROL tokens are special tokens and user-defined ones added tokens;
        bos/eos/unk/pad and the chat template come from the metadata; eos ids include
        ``eot_token_id`` when present; ``BPEStreamingDetokenizer`` streams text.

    Raises:
        ValueError: another tokenizer model (e.g. sentencepiece ``llama``) or missing tokens.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{path.name}: tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2'); "
            "use an mlx-lm model folder for this model instead."
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(
            f"{path.name} has no tokenizer.ggml.tokens; the file is incomplete."
        )
    backend = _bpe_backend(tokens, metadata)
    special = {
        name: _token(metadata, tokens, key) for name, key in _SPECIAL_IDS.items()
    }
    if (
        _flag(metadata, "tokenizer.ggml.add_bos_token")
        and special["bos_token"] is not None
    ):
        bos = special["bos_token"]
        backend.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A",
                    pair=f"{bos} $A {bos} $B",
                    special_tokens=[(bos, tokens.index(bos))],
                ),
            ]
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        **{k: v for k, v in special.items() if v is not None},
    )
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, _token_types(metadata))
        if k == _CONTROL
    ]
    tokenizer.add_special_tokens({"additional_special_tokens": control})
    eos_ids = [
        _int(metadata, k)
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    ]
    return TokenizerWrapper(
        tokenizer,
        BPEStreamingDetokenizer,
        eos_token_ids=[i for i in eos_ids if i is not None],
    )


_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _bpe_backend(tokens: list[str], metadata: dict) -> Tokenizer:
    """A ``tokenizers`` byte-level BPE over the GGUF vocabulary and merges."""
    merges = [
        tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []
    ]
    backend = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    )
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _token_types(metadata)
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types)
            if k == _USER_DEFINED
        ]
    )
    return backend


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """How text is split before BPE, from llama.cpp's ``tokenizer.ggml.pre`` name."""
    if pre is not None and pre not in _PRE_TOKENIZERS:
        warnings.warn(
            f"Unknown GGUF pre-tokenizer {pre!r}; splitting text as GPT-2 does.",
            stacklevel=3,
        )
    rule = _PRE_TOKENIZERS.get(pre or "default")
    if rule is _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if rule == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(rule), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _quantize_like(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Turn each layer that has ``scales`` in ``weights`` into a quantized layer of its bits."""

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(model, class_predicate=predicate)


def _read_weights(path: Path) -> tuple[dict[str, mx.array], dict]:
    try:
        return mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise ValueError(
            f"Cannot read {path} ({_one_line(e)}); download it again."
        ) from e


def _check_architecture(header: GGUFHeader, path: Path) -> None:
    arch = header.scalars.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path.name}: GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}); use an mlx-lm model folder for this model."
        )


def _check_tensor_types(header: GGUFHeader, path: Path) -> None:
    bad = [
        (n, t.type.name)
        for n, t in header.tensors.items()
        if t.type not in SUPPORTED_TYPES
    ]
    if bad:
        (name, kind), more = (
            bad[0],
            f" (and {len(bad) - 1} more)" if len(bad) > 1 else "",
        )
        allowed = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(
            f"{path.name}: tensor '{name}' has type {kind}{more}; mlxspec loads only {allowed} "
            "tensors. Use a GGUF quantized to one of those, or an mlx-lm model folder."
        )


def _rope_scaling(metadata: dict, arch: str, path: Path) -> dict | None:
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor is not None:
        return {
            "type": "linear",
            "factor": float(factor.item() if isinstance(factor, mx.array) else factor),
        }
    raise ValueError(
        f"{path.name}: RoPE scaling {kind!r} is not supported (only linear)."
    )


def _parse_header(buf) -> GGUFHeader:
    """GGUF v2/v3 little-endian after magic and version: counts, key/values, tensor infos, data."""
    cur = _Cursor(buf)
    cur.pos = 8
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    scalars = {}
    for _ in range(n_kv):
        key, vtype = cur.string(), GGUFValueType(cur.take("<I"))
        if vtype == GGUFValueType.ARRAY:
            cur.skip_array()
        else:
            scalars[key] = (
                cur.string()
                if vtype == GGUFValueType.STRING
                else cur.take(_SCALAR_FORMATS[vtype])
            )
    tensors = {}
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.take("<I")
        dims = [cur.take("<Q") for _ in range(n_dims)]
        tensors[name] = (
            GGMLQuantizationType(cur.take("<I")),
            tuple(reversed(dims)),
            cur.take("<Q"),
        )
    alignment = int(scalars.get("general.alignment", 32))
    _check_data_fits(tensors, -(-cur.pos // alignment) * alignment, len(buf))
    return GGUFHeader(
        scalars, {n: GGUFTensorInfo(t, s) for n, (t, s, _) in tensors.items()}
    )


def _check_data_fits(tensors: dict, data_start: int, size: int) -> None:
    for name, (kind, shape, offset) in tensors.items():
        block, nbytes = GGML_QUANT_SIZES[kind]
        if data_start + offset + prod(shape) // block * nbytes > size:
            raise ValueError(f"tensor '{name}' extends past the end of the file")


class _Cursor:
    """Reads little-endian GGUF values from a buffer; ``struct.error`` past its end."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8")

    def skip_array(self) -> None:
        vtype, n = GGUFValueType(self.take("<I")), self.take("<Q")
        if vtype == GGUFValueType.STRING:
            unpack, buf, pos = struct.Struct("<Q").unpack_from, self.buf, self.pos
            for _ in range(
                n
            ):  # the hot loop of the pass: 100k strings for a 49k vocabulary
                pos += 8 + unpack(buf, pos)[0]
            self.pos = pos
        elif vtype == GGUFValueType.ARRAY:
            for _ in range(n):
                self.skip_array()
        else:
            self.pos += n * struct.calcsize(_SCALAR_FORMATS[vtype])
        if self.pos > len(self.buf):
            raise ValueError("an array runs past the end of the file")


def _token_types(metadata: dict) -> list[int]:
    types = metadata.get("tokenizer.ggml.token_type")
    return types.tolist() if isinstance(types, mx.array) else list(types or [])


def _token(metadata: dict, tokens: list[str], key: str) -> str | None:
    index = _int(metadata, key)
    return tokens[index] if index is not None and 0 <= index < len(tokens) else None


def _int(metadata: dict, key: str) -> int | None:
    value = metadata.get(key)
    return (
        None
        if value is None
        else int(value.item() if isinstance(value, mx.array) else value)
    )


def _flag(metadata: dict, key: str) -> bool:
    value = metadata.get(key)
    return bool(value.item() if isinstance(value, mx.array) else value)
