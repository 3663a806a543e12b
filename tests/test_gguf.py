"""GGUF loading: a tiny llama GGUF gives the same logits as the same weights loaded by mlx-lm."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.utils import load_model

import gguf_fixtures as gf
from mlxspec.loading.gguf import gguf_type_label, load_gguf, read_header, unpermute_rows
from mlxspec.loading.models import is_quantized, load

PROMPT = mx.array(
    [[1, 87, 85, 71, 84, 201, 74, 75, 223, 19, 20, 2, 300, 17]]
)  # [B=1, T=14]
TEXTS = [
    "The capital of France is Paris.",
    "In 2024 there were 365 days!",
    "héllo wörld — naïve café ✓ 日本",
    "<|im_start|>user\nhi<|im_end|>\n<repo_name>mlx<file_sep>",
    "  spaces   and\ttabs\n\nnewlines ",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tokenizer, weights, GGUF files (untied and tied) and matching mlx-lm folders."""
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = gf.train_tokenizer()
    vocab = tokenizer.get_vocab_size()
    out = {"root": root, "tokenizer": tokenizer}
    for tied in (False, True):
        weights = gf.random_weights(vocab, tied=tied, seed=int(tied))
        out[tied] = {
            "weights": weights,
            "gguf": gf.write_gguf(
                root / f"tiny-tied{int(tied)}.Q4_1.gguf", weights, tokenizer
            ),
            "mlx_q": gf.write_mlx_folder(
                root / f"mlx-q-{tied}", weights, tokenizer, tied=tied, quantized=True
            ),
            "mlx_f32": gf.write_mlx_folder(
                root / f"mlx-f32-{tied}", weights, tokenizer, tied=tied, quantized=False
            ),
        }
    return out


def _write_variant(tiny, name: str, **kwargs) -> Path:
    return gf.write_gguf(
        tiny["root"] / name, tiny[False]["weights"], tiny["tokenizer"], **kwargs
    )


@pytest.mark.parametrize("tied", [False, True])
def test_quantized_logits_match_mlx_lm_folder(tiny, tied):
    model, _ = load(str(tiny[tied]["gguf"]))
    reference, _ = load_model(tiny[tied]["mlx_q"])
    assert isinstance(model, llama.Model)
    assert model.args.tie_word_embeddings is tied
    assert not model.training
    layers = dict(model.named_modules())
    assert isinstance(layers["model.embed_tokens"], nn.QuantizedEmbedding)
    assert layers["model.embed_tokens"].bits == 8
    assert layers["model.layers.0.self_attn.q_proj"].bits == 4  # Q4_0
    assert layers["model.layers.1.self_attn.o_proj"].bits == 8  # Q8_0
    assert isinstance(
        layers["model.layers.0.mlp.down_proj"], nn.Linear
    )  # F32 stays float
    assert (
        layers["model.layers.0.self_attn.o_proj"].weight.dtype == mx.float16
    )  # F16 kept
    logits, expected = model(PROMPT), reference(PROMPT)  # [1, T, V]
    assert logits.shape == (1, PROMPT.shape[1], gf.train_tokenizer().get_vocab_size())
    np.testing.assert_allclose(
        np.array(logits), np.array(expected), rtol=1e-5, atol=1e-5
    )


def test_float32_dequantizes_to_the_stored_values(tiny):
    model, _ = load_gguf(tiny[False]["gguf"], dtype="float32")
    reference, _ = load_model(tiny[False]["mlx_f32"])  # gguf's own numpy dequantization
    assert not is_quantized(model)
    assert {p.dtype for _, p in tree_flatten(model.parameters())} == {mx.float32}
    logits = np.array(model(PROMPT))
    np.testing.assert_allclose(
        logits, np.array(reference(PROMPT)), rtol=1e-5, atol=1e-5
    )
    quantized, _ = load_gguf(tiny[False]["gguf"])
    assert is_quantized(quantized)
    np.testing.assert_allclose(logits, np.array(quantized(PROMPT)), atol=0.05)


def test_bfloat16_casts_every_weight(tiny):
    model, _ = load_gguf(tiny[True]["gguf"], dtype="bfloat16")
    assert not is_quantized(model)
    assert {p.dtype for _, p in tree_flatten(model.parameters())} == {mx.bfloat16}


def test_tokenizer_matches_the_original_and_round_trips(tiny):
    _, tokenizer = load_gguf(tiny[False]["gguf"])
    reference = gf.fast_tokenizer(tiny["tokenizer"])
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == text
    for i, token in enumerate(gf.CONTROL_TOKENS):
        assert tokenizer.encode(token) == [i]
        assert token in tokenizer.all_special_tokens
    assert tokenizer.eos_token_ids == {0, gf.EOS_ID}  # eos, and <|endoftext|> as llama.cpp ends on it
    assert (tokenizer.bos_token_id, tokenizer.pad_token_id) == (gf.BOS_ID, gf.EOS_ID)


def test_chat_template_uses_single_control_tokens(tiny):
    _, tokenizer = load_gguf(tiny[False]["gguf"])
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi 12"}], add_generation_prompt=True
    )
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1
    assert (
        tokenizer.decode(ids)
        == "<|im_start|>user\nhi 12<|im_end|>\n<|im_start|>assistant\n"
    )


def test_streaming_detokenizer_rebuilds_multibyte_text(tiny):
    _, tokenizer = load_gguf(tiny[False]["gguf"])
    text = TEXTS[2]
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    segments = []
    for token in tokenizer.encode(text):
        detokenizer.add_token(token)
        segments.append(detokenizer.last_segment)
    detokenizer.finalize()
    segments.append(detokenizer.last_segment)
    assert "".join(segments) == text
    assert all("\ufffd" not in s for s in segments)


def test_header_reports_what_was_written(tiny):
    header = read_header(tiny[False]["gguf"])
    assert header.scalars["general.architecture"] == "llama"
    assert header.scalars["llama.block_count"] == gf.LAYERS
    assert header.tensors["token_embd.weight"].type == T.Q8_0
    assert header.tensors["token_embd.weight"].shape == (
        tiny["tokenizer"].get_vocab_size(),
        gf.HIDDEN,
    )
    assert header.tensors["blk.0.attn_q.weight"].type == T.Q4_0
    assert header.tensors["blk.0.attn_norm.weight"].type == T.F32
    assert len(header.tensors) == 3 + 9 * gf.LAYERS
    assert gguf_type_label(tiny[False]["gguf"]) in {"Q4_0", "Q4_1"}


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(2 * 6 * 3, dtype=np.float32).reshape(
        2 * 6, 3
    )  # 2 heads, head dim 6, 3 columns
    permuted = gf.llama_cpp_permute(w, 2)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(np.array(unpermute_rows(mx.array(permuted), 2)), w)


def _assert_one_line(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


def test_random_bytes_are_not_a_gguf(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError) as e:
        load(str(path))
    _assert_one_line(e, "random.gguf", "not a GGUF file")


@pytest.mark.parametrize("keep", [0.9, 0.02, 6])
def test_truncated_gguf(tiny, tmp_path, keep):
    data = tiny[False]["gguf"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ValueError) as e:
        load(str(path))
    _assert_one_line(e, "cut.gguf", "download it again")


def test_empty_gguf(tmp_path):
    (tmp_path / "empty.gguf").touch()
    with pytest.raises(ValueError) as e:
        load_gguf(tmp_path / "empty.gguf")
    _assert_one_line(e, "empty.gguf", "empty")


def test_unknown_tensor_types_are_refused_by_name(tiny, tmp_path):
    block, size = GGML_QUANT_SIZES[T.IQ4_NL]
    raw = np.zeros((gf.HIDDEN, gf.INTERMEDIATE // block * size), dtype=np.uint8)
    path = _write_variant(tiny, "iq4.gguf", replace={"blk.1.ffn_down.weight": (raw, T.IQ4_NL)})
    with pytest.raises(ValueError) as e:
        load(str(path))
    _assert_one_line(e, "iq4.gguf", "'blk.1.ffn_down.weight'", "IQ4_NL", "Q4_K", "Q6_K")
    # a type id the gguf package does not know either: patch the tensor table entry
    data = bytearray(path.read_bytes())
    name = b"blk.1.ffn_down.weight"
    at = data.index(name) + len(name) + 4 + 8 * 2  # n_dims (uint32), 2 dims (uint64), then the type
    data[at : at + 4] = (250).to_bytes(4, "little")
    (tmp_path / "unknown.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError) as e:
        load(str(tmp_path / "unknown.gguf"))
    _assert_one_line(e, "'blk.1.ffn_down.weight'", "250 (unknown)")


def test_unsupported_architecture(tiny):
    path = _write_variant(tiny, "falcon.gguf", arch="falcon")
    with pytest.raises(ValueError) as e:
        load(str(path))
    _assert_one_line(e, "falcon.gguf", "'falcon'", "not supported", "llama", "qwen2", "qwen3")


def test_unsupported_tokenizer_model(tiny):
    path = _write_variant(tiny, "spm.gguf", tokenizer_model="llama")
    with pytest.raises(ValueError) as e:
        load(str(path))
    _assert_one_line(e, "spm.gguf", "'llama'", "gpt2")


def test_unknown_tensor_is_named(tiny):
    extra = {"rope_freqs.weight": (np.ones(gf.HEAD_DIM // 2, np.float32), T.F32)}
    path = _write_variant(tiny, "rope-freqs.gguf", replace=extra)
    with pytest.raises(ValueError) as e:
        load(str(path))
    _assert_one_line(e, "'rope_freqs.weight'", "not supported")


def test_missing_gguf(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_gguf(tmp_path / "nope.gguf")
    _assert_one_line(e, "nope.gguf")
