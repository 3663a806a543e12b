"""Load a GGUF file (llama.cpp's format) as an mlx-lm model and tokenizer.

Tensors are read from the memory-mapped file, one at a time, by ``mlxspec.loading.ggml_quants``:

- F32, F16 and BF16 stay as they are;
- affine formats on 32-element groups (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K) become MLX
  quantized layers with group size 32 and 4, 5 or 8 bits, exactly (``mx.dequantize`` gives the
  GGML values bit for bit);
- formats on 16-element sub-blocks (Q2_K, Q3_K, Q6_K) are dequantized to float32 (exact), or
  with ``requantize=True`` re-quantized to 8-bit groups of 32 (lossy, see ``requantize``);
- with a float ``dtype`` every tensor is dequantized and cast.

Any other tensor type is refused at load time, naming the tensor.

Architectures (``general.architecture``) map onto mlx-lm model classes (``ARCHITECTURES``):
``llama`` (and ``mistral``, the same graph) and ``qwen2``/``qwen3``. llama.cpp's converter permutes
the rows of ``attn_q``/``attn_k`` of llama models only (``LlamaModel.permute`` in
``convert_hf_to_gguf.py``; the other families use NEOX-style RoPE and keep Hugging Face order);
those rows are permuted back here (quantization groups run along the input dimension, so scales
and biases rows follow the weight rows), and mlx-lm's models run unchanged.

The tokenizer is rebuilt from the metadata (``tokenizer.ggml.*``, byte-level BPE) with the
``tokenizers`` library; tokens of type CONTROL (3) become special tokens, so a chat template's
``<|im_start|>`` stays one token.

GGUF format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import importlib
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
import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
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

from mlxspec.loading.ggml_quants import (
    AFFINE_BITS,
    FLOAT_TYPES,
    GROUP_SIZE,
    SUB_BLOCK_TYPES,
    affine_triple,
    dequantize_affine,
    dequantize_sub_blocks,
)
from mlxspec.runtime.progress import progress_bar
from mlxspec.loading.weights import check_dtype, finish, one_line

SUPPORTED_TYPES = (*FLOAT_TYPES, *AFFINE_BITS, *SUB_BLOCK_TYPES)
"""Tensor types ``load_gguf`` accepts."""


@dataclass(frozen=True)
class Architecture:
    """How one ``general.architecture`` maps onto mlx-lm.

    Attributes:
        model_type (str): The mlx-lm module in ``mlx_lm.models`` (and ``config.json``'s model_type).
        permuted_qk (bool): llama.cpp stored the q/k rows permuted for interleaved RoPE.
        head_dim_arg (bool): The mlx-lm class takes ``head_dim`` (else it is hidden / heads).
    """

    model_type: str
    permuted_qk: bool
    head_dim_arg: bool = True


ARCHITECTURES = {
    "llama": Architecture("llama", permuted_qk=True),
    "mistral": Architecture("llama", permuted_qk=True),
    "qwen2": Architecture("qwen2", permuted_qk=False, head_dim_arg=False),
    "qwen3": Architecture("qwen3", permuted_qk=False),
}
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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TENSOR_NAME = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|scales|biases|bias)$")

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
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
# Control tokens that end generation wherever they appear (llama.cpp's end-of-generation list in
# llama-vocab.cpp), besides the metadata's eos/eot/eom ids: ChatML's <|im_end|> and <|endoftext|>.
_END_OF_GENERATION = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of a GGUF header's tensor table.

    Attributes:
        type (GGMLQuantizationType | int): Storage type, e.g. ``Q4_K``; a plain int when the type
            is unknown to the ``gguf`` package.
        shape (tuple[int, ...]): Shape in row-major order (rows first), e.g. [out, in].
        offset (int): Absolute byte offset of the tensor's data in the file.
    """

    type: GGMLQuantizationType | int
    shape: tuple[int, ...]
    offset: int = 0


@dataclass(frozen=True)
class GGUFHeader:
    """What ``read_header`` reads: metadata and the tensor table (no tensor data).

    Attributes:
        scalars (dict[str, int | float | bool | str]): Metadata that are not arrays.
        tensors (dict[str, GGUFTensorInfo]): Tensor table, by GGUF tensor name.
        arrays (dict[str, list]): Array metadata (tokens, merges, token types) when read with
            ``arrays=True``, else empty.
    """

    scalars: dict
    tensors: dict
    arrays: dict = None

    @property
    def metadata(self) -> dict:
        """Scalars and arrays in one dict."""
        return {**self.scalars, **(self.arrays or {})}


def load_gguf(
    path: str | Path, *, dtype: str | None = None, requantize: bool = False, lazy: bool = False
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a GGUF file as an mlx-lm model (llama, qwen2 or qwen3 class) and its tokenizer.

    Args:
        path (str | Path): The ``.gguf`` file.
        dtype (str | None): ``None`` keeps 32-group formats quantized (per-layer bits: e.g. a
            Q8_0 embedding and Q4_K linears), F16/BF16/F32 tensors as they are, and Q2_K/Q3_K/Q6_K
            tensors dequantized to float32; ``"float32"``, ``"float16"`` or ``"bfloat16"``
            dequantizes everything and casts to it. Default: ``None``.
        requantize (bool): With ``dtype=None``, re-quantize Q2_K/Q3_K/Q6_K tensors to MLX 8-bit
            groups of 32 instead of float32 (4x less memory; lossy: each value moves by at most one
            step of its group's 8-bit grid, (max - min) / 255 of the 32 values, which is about 0.5%
            RMS relative error on weight-like data). Default: ``False``.
        lazy (bool): Copy only the file's (quantized) bytes into memory and leave every weight's
            decoding unevaluated, so a caller that keeps part of a tensor (``sharded.shard``)
            decodes the whole tensor only for a moment and keeps its part. Default: ``False``.

    Returns:
        tuple[nn.Module, TokenizerWrapper]: The model in eval mode with evaluated weights (lazy ones
        with ``lazy``), and a tokenizer with the file's chat template and a BPE streaming detokenizer.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: bad ``dtype``; not a GGUF file, or a corrupt or truncated one; a tensor type
            outside ``SUPPORTED_TYPES``; an architecture outside ``ARCHITECTURES``; missing
            metadata or tensors; a tokenizer other than byte-level BPE (``gpt2``).
    """
    check_dtype(dtype)
    path = Path(path)
    header = read_header(path, arrays=True)
    arch = _architecture(header, path)
    _check_tensor_types(header, path)
    config = model_config(header, path)
    weights = read_tensors(path, header, dequantize=dtype is not None, requantize=requantize, lazy=lazy)
    weights = mlx_lm_weights(weights, config, arch, path)
    model = build_model(config, weights, path)
    tokenizer = gguf_tokenizer(header.metadata, path)
    return finish(model, dtype, lazy=lazy), tokenizer


def read_header(path: str | Path, *, arrays: bool = False) -> GGUFHeader:
    """Read a GGUF header: metadata and the tensor table.

    ``gguf.GGUFReader`` builds an object per token string and takes seconds on a large
    vocabulary; with ``arrays=False`` this pass skips array values and takes milliseconds. It also
    checks that every tensor's data lies inside the file, so a file cut short fails here.

    Args:
        path (str | Path): The ``.gguf`` file.
        arrays (bool): Also read array values (tokens, merges, token types). Default: ``False``.

    Returns:
        GGUFHeader: Scalars, tensor infos and (if asked) arrays.

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
            raise ValueError(f"{path} is not a GGUF file (bad magic number); pass a .gguf file.")
        if len(buf) < 24:  # magic, version and the two counts
            raise ValueError(f"{path} is cut off: {len(buf)} bytes, shorter than a GGUF header (24); "
                             "download it again.")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (only 2 and 3).")
        try:
            return _parse_header(buf, arrays)
        except (struct.error, ValueError, UnicodeDecodeError, OverflowError) as e:
            raise ValueError(f"{path} is corrupt or truncated ({one_line(e)}); download it again.") from e


def gguf_type_label(path: str | Path) -> str | None:
    """The dominant storage type of a GGUF's quantized matrices (of all matrices if none is
    quantized), e.g. ``"Q4_K"``; ``None`` if unreadable."""
    try:
        header = read_header(path)
    except (OSError, ValueError):
        return None
    kinds = [t.type for t in header.tensors.values() if len(t.shape) == 2]
    quantized = [k for k in kinds if k not in FLOAT_TYPES]  # name the quantization when there is one
    counts = Counter(_type_name(k) for k in (quantized or kinds))
    return counts.most_common(1)[0][0] if counts else None


def read_tensors(
    path: str | Path,
    header: GGUFHeader,
    *,
    dequantize: bool = False,
    requantize: bool = False,
    lazy: bool = False,
) -> dict[str, mx.array]:
    """Read every tensor from the memory-mapped file, one at a time (each evaluated before the next,
    unless ``lazy``).

    Args:
        path (str | Path): The ``.gguf`` file.
        header (GGUFHeader): Its header (``read_header``), with types already checked.
        dequantize (bool): Return every tensor as floats (quantized ones as float32).
            Default: ``False``.
        requantize (bool): Without ``dequantize``, Q2_K/Q3_K/Q6_K become MLX 8-bit triples instead
            of float32. Default: ``False``.
        lazy (bool): Copy each tensor's stored bytes and leave its decoding unevaluated (a tensor
            decodes when evaluated, whole, even if only a slice of it is kept). Default: ``False``.

    Returns:
        dict[str, mx.array]: By GGUF name; a quantized ``X.weight`` also gives ``X.scales`` and
        ``X.biases`` (MLX affine, group size 32), all with rows first, e.g. weight [out, in * bits / 32].

    Raises:
        ValueError: a quantized tensor that is not 2-D-compatible (rows not a whole number of blocks)
            or not named ``*.weight``.
    """
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    what = "reading" if lazy else "dequantizing" if dequantize else "loading"
    with progress_bar(len(header.tensors), f"mlxspec: {what} {Path(path).name}", "tensor") as bar:
        for name, info in header.tensors.items():
            arrays = _decode(data, info, name, dequantize=dequantize, requantize=requantize, lazy=lazy)
            if not lazy:
                mx.eval(*arrays.values())
            stem = name.removesuffix(".weight")
            if len(arrays) > 1 and stem == name:
                raise ValueError(f"quantized tensor '{name}' is not a weight; this file is not supported.")
            out.update({(f"{stem}.{k}" if k != "weight" else name): v for k, v in arrays.items()})
            bar.update()
    del data
    return out


_CHUNK_VALUES = 1 << 23
"""Values decoded at a time: bounds the transient arrays of a large tensor (tens of bytes a value)."""


def _decode(data: np.memmap, info: GGUFTensorInfo, name: str, *, dequantize: bool, requantize: bool,
            lazy: bool = False) -> dict:
    """One tensor as {"weight"} (floats) or {"weight", "scales", "biases"} (MLX quantized); with ``lazy``
    only the stored bytes are copied (``mx.array`` of the mapped file) and the decoding waits."""
    kind, shape = info.type, info.shape
    block, nbytes = GGML_QUANT_SIZES[kind]
    cols, rows = shape[-1], prod(shape[:-1])
    if cols % block:
        raise ValueError(
            f"tensor '{name}' has rows of {cols} values, not whole {kind.name} blocks of {block}."
        )
    raw = data[info.offset : info.offset + rows * (cols // block) * nbytes]
    if kind in FLOAT_TYPES:
        view = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
        values = mx.array(raw.view(view.get(kind, np.uint16)))
        if kind == GGMLQuantizationType.BF16:
            values = mx.view(values, mx.bfloat16)
        return {"weight": values.reshape(shape)}
    raw = raw.reshape(rows, -1)  # [R, bytes per row], still the mapped file
    step = max(1, _CHUNK_VALUES // cols)
    parts = []
    for start in range(0, rows, step):  # row chunks: only one chunk's bytes and transients in memory
        part = _decode_rows(mx.array(raw[start : start + step]), kind, cols, dequantize, requantize)
        if name == "token_embd.weight" and "scales" in part:
            # an embedding dequantizes in its scales' dtype, and only float32 holds the values exactly
            part["scales"], part["biases"] = (
                part["scales"].astype(mx.float32),
                part["biases"].astype(mx.float32),
            )
        if not lazy:
            mx.eval(*part.values())
        parts.append(part)
    out = {k: mx.concatenate([p[k] for p in parts]) if len(parts) > 1 else parts[0][k] for k in parts[0]}
    if "scales" not in out:
        out["weight"] = out["weight"].reshape(shape)
    return out


def _decode_rows(
    raw: mx.array, kind: GGMLQuantizationType, cols: int, dequantize: bool, requantize: bool
) -> dict:
    """Rows [r, bytes] of a quantized tensor: float32 values [r, C] or an MLX triple."""
    if kind in SUB_BLOCK_TYPES:
        values = dequantize_sub_blocks(raw, kind, cols)  # [r, C] float32
        if requantize and not dequantize:
            weight, scales, biases = mx.quantize(values, group_size=GROUP_SIZE, bits=8)
            return {"weight": weight, "scales": scales, "biases": biases}
        return {"weight": values}
    if dequantize:
        return {"weight": dequantize_affine(raw, kind, cols)}
    weight, scales, biases = affine_triple(raw, kind, cols)
    return {"weight": weight, "scales": scales, "biases": biases}


def model_config(header: GGUFHeader, path: Path) -> dict:
    """The mlx-lm ``config.json`` a GGUF's metadata describes.

    Args:
        header (GGUFHeader): The file's header.
        path (Path): The file, for error messages.

    Returns:
        dict: ``model_type``, sizes, RoPE, norm epsilon, ``tie_word_embeddings`` (no ``output``
        tensor) and ``rope_traditional=False`` (q/k rows are un-permuted on load).

    Raises:
        ValueError: required metadata or the ``token_embd`` tensor is missing, the architecture
            is unsupported, or the file uses a RoPE variant or head size the class cannot run.
    """
    metadata, arch_name = header.scalars, str(header.scalars.get("general.architecture"))
    arch = _architecture(header, path)

    def get(key: str, default=None):
        value = metadata.get(f"{arch_name}.{key}", default)
        if value is None:
            raise ValueError(f"{path.name} lacks metadata '{arch_name}.{key}'; the file is incomplete.")
        return value

    embedding = header.tensors.get("token_embd.weight")
    if embedding is None:
        raise ValueError(f"{path.name} has no token_embd.weight tensor; the file is incomplete.")
    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{path.name}: partial RoPE (rope.dimension_count != head size) is not supported.")
    if not arch.head_dim_arg and head_dim != hidden // n_heads:
        raise ValueError(
            f"{path.name}: head size {head_dim} is not hidden size / heads, which mlx-lm's "
            f"{arch.model_type} class assumes; this file is not supported."
        )
    config = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": embedding.shape[0],
        "max_position_embeddings": int(get("context_length")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "rope_scaling": _rope_scaling(metadata, arch_name, path),
        "tie_word_embeddings": "output.weight" not in header.tensors,
    }
    if arch.head_dim_arg:
        config["head_dim"] = head_dim
    return config


def mlx_lm_weights(
    weights: dict[str, mx.array], config: dict, arch: Architecture, path: Path
) -> dict[str, mx.array]:
    """Rename GGUF tensors to mlx-lm names and, for llama, un-permute q/k rows.

    Args:
        weights (dict[str, mx.array]): From ``read_tensors``, by GGUF name.
        config (dict): From ``model_config`` (head counts for the un-permutation).
        arch (Architecture): Whether q/k rows are permuted.
        path (Path): The file, for error messages.

    Returns:
        dict[str, mx.array]: Tensors by mlx-lm parameter path, e.g.
        ``model.layers.0.self_attn.q_proj.scales``.

    Raises:
        ValueError: a tensor that has no place in these models (e.g. ``rope_freqs``).
    """
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    renamed = {}
    for name, value in weights.items():
        match = _TENSOR_NAME.match(name)
        block, part, suffix = match.groups() if match else (None, None, None)
        table = _BLOCK_NAMES if block is not None else _TOP_NAMES
        if part not in table:
            raise ValueError(
                f"{path.name}: tensor '{name}' has no place in a {config['model_type']} model (mlxspec maps "
                "token_embd, output_norm, output and blk.N.attn_*/ffn_*); this variant is not supported."
            )
        if block is not None and part in heads and arch.permuted_qk:
            value = unpermute_rows(value, heads[part])
        prefix = f"model.layers.{block}." if block is not None else ""
        renamed[f"{prefix}{table[part]}.{suffix}"] = value
    return renamed


def build_model(config: dict, weights: dict[str, mx.array], path: Path) -> nn.Module:
    """The mlx-lm model of ``config["model_type"]`` holding ``weights`` (quantized layers where
    ``weights`` has ``scales``, with the bits their shapes imply).

    Raises:
        ValueError: the tensors do not fit the model (missing, extra or mis-shaped).
    """
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    _quantize_like(model, weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(
            f"{path.name}: tensors do not fit a {config['model_type']} model: {one_line(e)}"
        ) from e
    return model


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
        metadata (dict): GGUF metadata with arrays (``GGUFHeader.metadata``).
        path (Path): The file, for error messages.

    Returns:
        TokenizerWrapper: CONTROL tokens are special tokens and user-defined ones added tokens;
        bos/eos/unk/pad and the chat template come from the metadata; eos ids are
        ``end_of_generation_ids``; ``BPEStreamingDetokenizer`` streams text.

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
    return TokenizerWrapper(tokenizer, BPEStreamingDetokenizer, eos_token_ids=end_of_generation_ids(metadata))


def end_of_generation_ids(metadata: dict) -> list[int]:
    """Token ids that end generation, as llama.cpp decides them (``llama-vocab.cpp``).

    Args:
        metadata (dict): GGUF metadata with arrays.

    Returns:
        list[int]: The eos, eot and eom ids the metadata names, plus every CONTROL token whose text
        is a known end-of-turn marker (``<|im_end|>``, ``<|endoftext|>``, ``<|eot_id|>``, ...), in
        id order.
    """
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = {i for i in (_int(metadata, k) for k in keys) if i is not None}
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    ids.update(
        i
        for i, (t, k) in enumerate(zip(tokens, _token_types(metadata)))
        if k == _CONTROL and t in _END_OF_GENERATION
    )
    return sorted(ids)


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


def _architecture(header: GGUFHeader, path: Path) -> Architecture:
    arch = header.scalars.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path.name}: GGUF architecture {arch!r} is not supported (supported: "
            f"{', '.join(ARCHITECTURES)}); use an mlx-lm model folder for this model."
        )
    return ARCHITECTURES[arch]


def _type_name(kind: GGMLQuantizationType | int) -> str:
    return kind.name if isinstance(kind, GGMLQuantizationType) else f"{kind} (unknown)"


def _check_tensor_types(header: GGUFHeader, path: Path) -> None:
    bad = [(n, _type_name(t.type)) for n, t in header.tensors.items() if t.type not in SUPPORTED_TYPES]
    if bad:
        (name, kind), more = bad[0], f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
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
        return {"type": "linear", "factor": float(factor)}
    raise ValueError(f"{path.name}: RoPE scaling {kind!r} is not supported (only linear).")


def _parse_header(buf, arrays: bool) -> GGUFHeader:
    """GGUF v2/v3 little-endian after magic and version: counts, key/values, tensor infos, data."""
    cur = _Cursor(buf)
    cur.pos = 8
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    scalars, array_values = {}, {}
    for _ in range(n_kv):
        key, vtype = cur.string(), GGUFValueType(cur.take("<I"))
        if vtype == GGUFValueType.ARRAY:
            if arrays:
                array_values[key] = cur.array()
            else:
                cur.skip_array()
        else:
            scalars[key] = cur.string() if vtype == GGUFValueType.STRING else cur.take(_SCALAR_FORMATS[vtype])
    tensors = {}
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.take("<I")
        dims = [cur.take("<Q") for _ in range(n_dims)]
        kind = cur.take("<I")
        kind = GGMLQuantizationType(kind) if kind in GGMLQuantizationType._value2member_map_ else kind
        tensors[name] = (kind, tuple(reversed(dims)), cur.take("<Q"))
    alignment = int(scalars.get("general.alignment", 32))
    start = -(-cur.pos // alignment) * alignment
    _check_data_fits(tensors, start, len(buf))
    infos = {n: GGUFTensorInfo(t, s, start + o) for n, (t, s, o) in tensors.items()}
    return GGUFHeader(scalars, infos, array_values)


def _check_data_fits(tensors: dict, data_start: int, size: int) -> None:
    for name, (kind, shape, offset) in tensors.items():
        if kind not in GGML_QUANT_SIZES:
            continue  # unknown type: refused by name before any data is read
        block, nbytes = GGML_QUANT_SIZES[kind]
        if data_start + offset + prod(shape) // block * nbytes > size:
            raise ValueError(f"tensor '{name}' extends past the end of the file")


_NUMPY_FORMATS = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


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

    def array(self) -> list:
        """An array value: a list of str, of lists, or of Python numbers."""
        vtype, n = GGUFValueType(self.take("<I")), self.take("<Q")
        if vtype == GGUFValueType.STRING:
            return [self.string() for _ in range(n)]
        if vtype == GGUFValueType.ARRAY:
            return [self.array() for _ in range(n)]
        dtype = np.dtype(_NUMPY_FORMATS[vtype])
        if self.pos + n * dtype.itemsize > len(self.buf):
            raise ValueError("an array runs past the end of the file")
        values = np.frombuffer(self.buf, dtype, count=n, offset=self.pos).tolist()
        self.pos += n * dtype.itemsize
        return values

    def skip_array(self) -> None:
        vtype, n = GGUFValueType(self.take("<I")), self.take("<Q")
        if vtype == GGUFValueType.STRING:
            unpack, buf, pos = struct.Struct("<Q").unpack_from, self.buf, self.pos
            for _ in range(n):  # the hot loop of the pass: 100k strings for a 49k vocabulary
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
    return list(metadata.get("tokenizer.ggml.token_type") or [])


def _token(metadata: dict, tokens: list[str], key: str) -> str | None:
    index = _int(metadata, key)
    return tokens[index] if index is not None and 0 <= index < len(tokens) else None


def _int(metadata: dict, key: str) -> int | None:
    value = metadata.get(key)
    return None if value is None else int(value)


def _flag(metadata: dict, key: str) -> bool:
    return bool(metadata.get(key))
