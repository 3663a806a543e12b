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
from pathlib import Path

import mlx.core as mx
import numpy as np
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
    tokens, merges = vocab_and_merges(tokenizer)
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
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in CONTROL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
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
    mx.eval(triples)
    scratch.unlink()
    return {**triples, **plain}
