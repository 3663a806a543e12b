"""Tiny llama checkpoints written two ways: as a GGUF file and as an mlx-lm folder.

The same random weights (Hugging Face row order, float32) go into both. The GGUF stores q/k rows
permuted as llama.cpp's converter does and a mix of F32, F16, Q8_0, Q4_0 and Q4_1 tensors
(quantized with the ``gguf`` package); the mlx-lm folder holds the same quantized values as MLX
(weight, scales, biases) triples with a per-layer ``quantization`` config, or their float32
dequantization. The tokenizer is a byte-level BPE trained on a few sentences, with control
tokens and a chat template, so its GGUF rebuild can be checked against the original.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
ROPE_THETA, RMS_EPS, CONTEXT = 10000.0, 1e-5, 2048
CONTROL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<repo_name>",
    "<file_sep>",
]
"""Type 3 (CONTROL) tokens, ids 0-4; two are not bos/eos/unk/pad, as most of SmolLM2's."""
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "In 2024 there were 365 days, and 12 months; the year before had 365 too.",
    "Speculative decoding drafts tokens and verifies them with the target model.",
    "héllo wörld, naïve café — ünïcödé text with accents.",
]

# Storage type per mlx-lm layer; norms are always F32.
LAYER_TYPES = {
    "model.embed_tokens": T.Q8_0,
    "lm_head": T.F16,
    "model.layers.0.self_attn.q_proj": T.Q4_0,
    "model.layers.0.self_attn.k_proj": T.Q4_1,
    "model.layers.0.self_attn.v_proj": T.Q8_0,
    "model.layers.0.self_attn.o_proj": T.F16,
    "model.layers.0.mlp.gate_proj": T.Q4_1,
    "model.layers.0.mlp.up_proj": T.Q4_0,
    "model.layers.0.mlp.down_proj": T.F32,
    "model.layers.1.self_attn.q_proj": T.Q4_1,
    "model.layers.1.self_attn.k_proj": T.Q4_0,
    "model.layers.1.self_attn.v_proj": T.F32,
    "model.layers.1.self_attn.o_proj": T.Q8_0,
    "model.layers.1.mlp.gate_proj": T.F16,
    "model.layers.1.mlp.up_proj": T.Q4_1,
    "model.layers.1.mlp.down_proj": T.Q4_0,
}
QUANTIZED = (T.Q4_0, T.Q4_1, T.Q8_0)
_GGUF_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE (digits split one by one, like SmolLM2) with ~60 merges.

    Ids 0-4 are ``CONTROL_TOKENS``.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=CONTROL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def vocab_and_merges(tok: Tokenizer) -> tuple[list[str], list[str]]:
    """Tokens in id order and merges as ``"a b"`` strings, as GGUF stores them."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = json.loads(tok.to_str())["model"]["merges"]
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in merges]


def random_weights(
    vocab_size: int, *, tied: bool, seed: int = 0
) -> dict[str, np.ndarray]:
    """Float32 weights by mlx-lm name, Hugging Face row order."""
    rng = np.random.default_rng(seed)

    def w(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(vocab_size, HIDDEN)}
    weights["model.norm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(
        np.float32
    )
    if not tied:
        weights["lm_head.weight"] = w(vocab_size, HIDDEN)
    shapes = {
        "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN),
        "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
        "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
        "mlp.up_proj": (INTERMEDIATE, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTERMEDIATE),
    }
    for i in range(LAYERS):
        for part, shape in shapes.items():
            weights[f"model.layers.{i}.{part}.weight"] = w(*shape)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{norm}.weight"] = (
                1 + 0.1 * rng.standard_normal(HIDDEN)
            ).astype(np.float32)
    return weights


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): HF q/k rows to GGUF order."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def storage_type(name: str) -> T:
    return LAYER_TYPES.get(name.removesuffix(".weight"), T.F32)


def encode(w: np.ndarray, kind: T) -> np.ndarray:
    """The tensor as GGUF stores it: float32/float16 values or quantized bytes, rows kept."""
    if kind == T.F32:
        return w
    if kind == T.F16:
        return w.astype(np.float16)
    return quantize(w, kind)


def decoded(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float32 values each tensor holds once stored (``gguf``'s own dequantization)."""
    out = {}
    for name, w in weights.items():
        kind = storage_type(name)
        out[name] = (
            dequantize(encode(w, kind), kind).astype(np.float32) if kind != T.F32 else w
        )
    return out


def gguf_name(name: str) -> str:
    base = name.removesuffix(".weight")
    top = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        "lm_head": "output",
    }
    if base in top:
        return f"{top[base]}.weight"
    _, _, layer, part = base.split(".", 3)
    return f"blk.{layer}.{_GGUF_PARTS[part]}.weight"


def write_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    tokenizer: Tokenizer,
    *,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    replace: dict[str, tuple[np.ndarray, T]] | None = None,
) -> Path:
    """Write ``weights`` as llama.cpp would: GGUF names, q/k rows permuted, ``LAYER_TYPES``.

    ``replace`` maps GGUF tensor names to (raw data, type) written instead of (or besides) the
    computed tensors, for unsupported-type and unknown-tensor cases.
    """
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    add_tokenizer(writer, tokenizer, tokenizer_model=tokenizer_model)
    tensors = {}
    for name, w in weights.items():
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, HEADS)
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, KV_HEADS)
        kind = storage_type(name)
        tensors[gguf_name(name)] = (encode(w, kind), kind)
    tensors.update(replace or {})
    for name, (data, kind) in tensors.items():
        writer.add_tensor(
            name, data, raw_dtype=kind if kind not in (T.F32, T.F16) else None
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tokenizer(writer: GGUFWriter, tokenizer: Tokenizer, *, tokenizer_model: str = "gpt2",
                  pre: str = "smollm") -> None:
    """The tokenizer's metadata as llama.cpp writes it: vocabulary, types, merges, ids, template."""
    tokens, merges = vocab_and_merges(tokenizer)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in CONTROL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_mlx_folder(
    folder: Path,
    weights: dict[str, np.ndarray],
    tokenizer: Tokenizer,
    *,
    tied: bool,
    quantized: bool,
) -> Path:
    """The same checkpoint as an mlx-lm folder.

    ``quantized=True`` keeps each quantized tensor as the MLX triple of its GGUF blocks (in HF row
    order) with a per-layer ``quantization`` config; ``False`` writes every tensor as the float32
    values it decodes to.
    """
    folder.mkdir(parents=True, exist_ok=True)
    if quantized:
        arrays = _mlx_triples(folder, weights)
        layers = {
            name: {"group_size": 32, "bits": 8 if kind == T.Q8_0 else 4}
            for name, kind in LAYER_TYPES.items()
            if kind in QUANTIZED
        }
        quantization = {"group_size": 32, "bits": 4, **layers}
    else:
        arrays = {name: mx.array(w) for name, w in decoded(weights).items()}
        quantization = None
    config = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": RMS_EPS,
        "vocab_size": tokenizer.get_vocab_size(),
        "max_position_embeddings": CONTEXT,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": tied,
        "eos_token_id": EOS_ID,
    }
    if quantization:
        config["quantization"] = quantization
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(
        str(folder / "model.safetensors"), arrays, metadata={"format": "mlx"}
    )
    fast_tokenizer(tokenizer).save_pretrained(folder)
    return folder


def fast_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """The trained tokenizer as a transformers tokenizer with the chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=CONTROL_TOKENS[BOS_ID],
        eos_token=CONTROL_TOKENS[EOS_ID],
        unk_token=CONTROL_TOKENS[0],
        pad_token=CONTROL_TOKENS[EOS_ID],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _mlx_triples(folder: Path, weights: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """Quantized tensors as MLX (weight, scales, biases): ``mx.load`` of an HF-order GGUF."""
    scratch = folder / "scratch-hf-order.gguf"
    writer = GGUFWriter(str(scratch), "llama")
    plain = {}
    for name, w in weights.items():
        kind = storage_type(name)
        if kind in QUANTIZED:
            writer.add_tensor(name, encode(w, kind), raw_dtype=kind)
        else:
            plain[name] = mx.array(encode(w, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    triples = mx.load(str(scratch))
    for key in ("model.embed_tokens.scales", "model.embed_tokens.biases"):  # as mlxspec keeps them
        if key in triples:
            triples[key] = triples[key].astype(mx.float32)
    mx.eval(triples)
    scratch.unlink()
    return {**triples, **plain}


# --- Checkpoints of any tensor type and architecture (llama, mistral, qwen2, qwen3) -------------
# Rows are multiples of 256 so that every K-quant fits. Tensors are random *as stored*: K-quant
# blocks are random bytes with sane float16 scales (the gguf package cannot quantize K-quants),
# the others are quantized from random floats. The reference values are ``gguf.quants.dequantize``
# of the stored bytes, with llama's q/k rows put back in Hugging Face order.


@dataclass(frozen=True)
class Dims:
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    head_dim: int = 64


# Byte offsets of each K-quant block's float16 super-scales (d, dmin) and the largest
# |scale x code| a block can hold, to size d so values stay near 1 / sqrt(cols).
_K_SCALES = {T.Q2_K: ((80, 82), 15 * 3), T.Q3_K: ((108,), 32 * 4), T.Q4_K: ((0, 2), 63 * 15),
             T.Q5_K: ((0, 2), 63 * 31), T.Q6_K: ((208,), 128 * 32)}
PERMUTED_ARCHS = ("llama", "mistral")
MLX_LM_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def random_stored(rows: int, cols: int, kind: T, rng: np.random.Generator) -> np.ndarray:
    """A [rows, cols] tensor as GGUF stores it in ``kind`` (floats, or block bytes [rows, n])."""
    if kind in _K_SCALES:
        block, nbytes = GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
        offsets, largest = _K_SCALES[kind]
        for o in offsets:
            d = rng.uniform(0.5, 1.0, (rows, cols // block)) * 3 / np.sqrt(cols) / largest
            raw[..., o : o + 2] = d.astype(np.float16)[..., None].view(np.uint8)
        return raw.reshape(rows, -1)
    w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    return encode(w, kind) if kind != T.BF16 else quantize(w, T.BF16)


def llama_cpp_unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of ``llama_cpp_permute``: GGUF q/k rows back to Hugging Face order."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def typed_shapes(arch: str, dims: Dims, vocab: int, *, tied: bool) -> dict[str, tuple[int, ...]]:
    """mlx-lm tensor names and shapes of the architecture (qwen2: q/k/v biases; qwen3: q/k norms)."""
    q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    shapes = {"model.embed_tokens.weight": (vocab, dims.hidden), "model.norm.weight": (dims.hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, dims.hidden)
    for i in range(dims.layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, dims.hidden),
                   p + "self_attn.k_proj.weight": (kv, dims.hidden),
                   p + "self_attn.v_proj.weight": (kv, dims.hidden),
                   p + "self_attn.o_proj.weight": (dims.hidden, q),
                   p + "mlp.gate_proj.weight": (dims.intermediate, dims.hidden),
                   p + "mlp.up_proj.weight": (dims.intermediate, dims.hidden),
                   p + "mlp.down_proj.weight": (dims.hidden, dims.intermediate),
                   p + "input_layernorm.weight": (dims.hidden,),
                   p + "post_attention_layernorm.weight": (dims.hidden,)}
        if arch == "qwen2":
            shapes |= {p + f"self_attn.{x}_proj.bias": (n,) for x, n in (("q", q), ("k", kv), ("v", kv))}
        if arch == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (dims.head_dim,),
                       p + "self_attn.k_norm.weight": (dims.head_dim,)}
    return shapes


def gguf_tensor_name(name: str) -> str:
    """mlx-lm name to GGUF name (weights and biases)."""
    base, suffix = name.rsplit(".", 1)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if base in top:
        return f"{top[base]}.{suffix}"
    _, _, layer, part = base.split(".", 3)
    parts = {**_GGUF_PARTS, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    return f"blk.{layer}.{parts[part]}.{suffix}"


def write_typed_gguf(
    path: Path, tokenizer: Tokenizer, types: dict[str, T], *, arch: str = "llama", dims: Dims = Dims(),
    tied: bool = False, seed: int = 0,
) -> tuple[Path, dict[str, np.ndarray]]:
    """A GGUF whose matrices have the ``types`` given by mlx-lm layer name (others F32).

    Returns:
        The path, and the reference float32 weights by mlx-lm name (Hugging Face row order).
    """
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(dims.hidden)
    writer.add_block_count(dims.layers)
    writer.add_feed_forward_length(dims.intermediate)
    writer.add_head_count(dims.heads)
    writer.add_head_count_kv(dims.kv_heads)
    writer.add_key_length(dims.head_dim)
    writer.add_value_length(dims.head_dim)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_rope_dimension_count(dims.head_dim)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    add_tokenizer(writer, tokenizer, pre="qwen2" if arch.startswith("qwen") else "smollm")
    reference = {}
    heads = {"q_proj": dims.heads, "k_proj": dims.kv_heads}
    for name, shape in typed_shapes(arch, dims, tokenizer.get_vocab_size(), tied=tied).items():
        kind = types.get(name.removesuffix(".weight"), T.F32)
        if len(shape) == 1:
            base = 1.0 if name.endswith("norm.weight") else 0.0
            stored = (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            stored = random_stored(*shape, kind, rng)
        values = dequantize(stored, kind).astype(np.float32) if kind != T.F32 else stored
        part = name.split(".")[-2]
        if arch in PERMUTED_ARCHS and part in heads:
            values = llama_cpp_unpermute(values, heads[part])
        reference[name] = values
        writer.add_tensor(gguf_tensor_name(name), stored, raw_dtype=None if kind in (T.F32, T.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, reference


def typed_config(arch: str, dims: Dims, vocab: int, *, tied: bool) -> dict:
    """The mlx-lm config of a ``write_typed_gguf`` checkpoint."""
    return {"model_type": MLX_LM_TYPES[arch], "hidden_size": dims.hidden, "num_hidden_layers": dims.layers,
            "intermediate_size": dims.intermediate, "num_attention_heads": dims.heads,
            "num_key_value_heads": dims.kv_heads, "head_dim": dims.head_dim, "rms_norm_eps": RMS_EPS,
            "vocab_size": vocab, "max_position_embeddings": CONTEXT, "rope_theta": ROPE_THETA,
            "tie_word_embeddings": tied}


def reference_model(arch: str, reference: dict[str, np.ndarray], dims: Dims, vocab: int, *, tied: bool):
    """mlx-lm's own class for ``arch`` holding the reference float32 weights."""
    import importlib

    config = typed_config(arch, dims, vocab, tied=tied)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    model.load_weights([(k, mx.array(v)) for k, v in reference.items()], strict=True)
    mx.eval(model.parameters())
    return model.eval()
