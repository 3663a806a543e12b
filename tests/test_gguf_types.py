"""Every GGUF tensor type and the llama/mistral/qwen2/qwen3 architectures, against references.

The reference for a tensor's values is ``gguf.quants.dequantize`` of its stored bytes (the ``gguf``
package's numpy implementation, independent of mlxspec's MLX decoders); the reference for a model
is mlx-lm's own class for the architecture holding those values in float32.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen2, qwen3

import gguf_fixtures as gf
from mlxspec.loading.ggml_quants import AFFINE_BITS, SUB_BLOCK_TYPES
from mlxspec.loading.gguf import load_gguf, read_header
from mlxspec.loading.models import is_quantized, load

DIMS = gf.Dims()
# One layer per type: the 13 supported types spread over a 2-layer llama (untied output).
TYPES = {
    "model.embed_tokens": T.Q6_K,
    "lm_head": T.Q8_0,
    "model.layers.0.self_attn.q_proj": T.Q4_K,
    "model.layers.0.self_attn.k_proj": T.Q5_K,
    "model.layers.0.self_attn.v_proj": T.Q6_K,
    "model.layers.0.self_attn.o_proj": T.Q2_K,
    "model.layers.0.mlp.gate_proj": T.Q3_K,
    "model.layers.0.mlp.up_proj": T.Q5_0,
    "model.layers.0.mlp.down_proj": T.Q5_1,
    "model.layers.1.self_attn.q_proj": T.Q4_0,
    "model.layers.1.self_attn.k_proj": T.Q4_1,
    "model.layers.1.self_attn.v_proj": T.Q8_0,
    "model.layers.1.self_attn.o_proj": T.BF16,
    "model.layers.1.mlp.gate_proj": T.F16,
    "model.layers.1.mlp.up_proj": T.Q4_K,
    "model.layers.1.mlp.down_proj": T.F32,
}
# A Qwen2.5 Q4_K_M-like mix: K-quants, legacy 32-groups for rows not a multiple of 256, Q8_0 embedding.
QWEN_TYPES = {
    "model.embed_tokens": T.Q8_0,
    **{f"model.layers.{i}.{p}": k for i in range(2) for p, k in (
        ("self_attn.q_proj", T.Q4_K), ("self_attn.k_proj", T.Q5_0), ("self_attn.v_proj", T.Q6_K),
        ("self_attn.o_proj", T.Q4_K), ("mlp.gate_proj", T.Q4_K), ("mlp.up_proj", T.Q5_K),
        ("mlp.down_proj", T.Q6_K))},
}
TOKENS = mx.array([[1, 87, 85, 71, 84, 201, 74, 75, 223, 19, 20, 2, 300, 17]])  # [B=1, T=14]


@pytest.fixture(scope="module")
def tokenizer():
    return gf.train_tokenizer()


@pytest.fixture(scope="module")
def typed(tmp_path_factory, tokenizer):
    """The all-types llama GGUF, its reference weights, and the model loaded three ways."""
    path, reference = gf.write_typed_gguf(
        tmp_path_factory.mktemp("typed") / "all-types.gguf", tokenizer, TYPES
    )
    return {
        "path": path,
        "reference": reference,
        "kept": load_gguf(path)[0],
        "float32": load_gguf(path, dtype="float32")[0],
        "requantized": load_gguf(path, requantize=True)[0],
    }


def _layer(model, name):
    return dict(model.named_modules())[name]


def _x(cols: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((3, cols)).astype(np.float32))  # [T=3, in]


def test_header_reads_every_k_quant_type(typed):
    header = read_header(typed["path"])
    assert header.tensors["blk.0.attn_output.weight"].type == T.Q2_K
    assert header.tensors["token_embd.weight"].type == T.Q6_K
    assert {t.type for t in header.tensors.values()} == {*TYPES.values()}


@pytest.mark.parametrize("name", list(TYPES), ids=[f"{TYPES[n].name}-{n.split('.')[-1]}" for n in TYPES])
def test_layer_output_equals_reference_dequantization(typed, name):
    kind, layer = TYPES[name], _layer(typed["kept"], name)
    w = typed["reference"][f"{name}.weight"]  # [out, in] float32, gguf.quants.dequantize
    if kind in AFFINE_BITS:
        assert isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        assert (layer.bits, layer.group_size) == (AFFINE_BITS[kind], 32)
    elif kind in SUB_BLOCK_TYPES:
        assert isinstance(layer, (nn.Linear, nn.Embedding)) and layer.weight.dtype == mx.float32
    else:
        expected = {T.F32: mx.float32, T.F16: mx.float16, T.BF16: mx.bfloat16}[kind]
        assert isinstance(layer, nn.Linear) and layer.weight.dtype == expected
    if name == "model.embed_tokens":
        rows = layer(TOKENS[0])  # [T, D]
        np.testing.assert_array_equal(np.array(rows.astype(mx.float32)), w[np.array(TOKENS[0])])
        return
    x = _x(w.shape[1])
    got = np.array(layer(x).astype(mx.float32))  # [3, out]
    np.testing.assert_allclose(got, np.array(x) @ w.T, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", [*AFFINE_BITS, *SUB_BLOCK_TYPES], ids=lambda k: k.name)
def test_exact_types_are_bit_exact_after_dequantization(typed, kind):
    names = [n for n, k in TYPES.items() if k == kind]
    assert names
    for name in names:
        w = typed["reference"][f"{name}.weight"]
        layer = _layer(typed["kept"], name)
        if kind in AFFINE_BITS:
            values = mx.dequantize(
                layer.weight,
                layer.scales.astype(mx.float32),
                layer.biases.astype(mx.float32),
                group_size=32,
                bits=layer.bits,
            )
        else:
            values = layer.weight
        np.testing.assert_array_equal(np.array(values), w)
        np.testing.assert_array_equal(np.array(_layer(typed["float32"], name).weight), w)


def test_float32_load_holds_exactly_the_reference_values(typed):
    model = typed["float32"]
    assert not is_quantized(model)
    params = dict(tree_flatten(model.parameters()))
    assert set(params) == set(typed["reference"])
    for name, w in typed["reference"].items():
        assert params[name].dtype == mx.float32
        np.testing.assert_array_equal(np.array(params[name]), w, err_msg=name)


@pytest.mark.parametrize("which", ["kept", "float32", "requantized"])
def test_decoding_in_row_chunks_changes_nothing(typed, monkeypatch, which):
    import mlxspec.loading.gguf

    # 3-row chunks of 256-value rows, or 1 row
    monkeypatch.setattr(mlxspec.loading.gguf, "_CHUNK_VALUES", 3 * 256)
    options = {"kept": {}, "float32": {"dtype": "float32"}, "requantized": {"requantize": True}}[which]
    model, _ = load_gguf(typed["path"], **options)
    expected = dict(tree_flatten(typed[which].parameters()))
    got = dict(tree_flatten(model.parameters()))
    assert set(got) == set(expected)
    for name, value in got.items():
        assert value.dtype == expected[name].dtype, name
        np.testing.assert_array_equal(
            np.array(value.astype(mx.float32) if value.dtype == mx.bfloat16 else value),
            np.array(expected[name].astype(mx.float32) if value.dtype == mx.bfloat16 else expected[name]),
            err_msg=name,
        )


def test_logits_equal_mlx_lm_llama_on_the_reference_weights(typed, tokenizer):
    reference = gf.reference_model("llama", typed["reference"], DIMS, tokenizer.get_vocab_size(), tied=False)
    expected = np.array(reference(TOKENS))  # [1, T, V]
    assert isinstance(typed["kept"], llama.Model)
    np.testing.assert_allclose(np.array(typed["float32"](TOKENS)), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        np.array(typed["kept"](TOKENS).astype(mx.float32)), expected, rtol=1e-3, atol=2e-3
    )


def test_requantize_puts_sub_block_types_in_8_bit_groups_within_one_step(typed):
    model = typed["requantized"]
    for name, kind in TYPES.items():
        layer = _layer(model, name)
        if kind not in SUB_BLOCK_TYPES:
            assert type(layer) is type(_layer(typed["kept"], name)), name
            continue
        assert isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and layer.bits == 8, name
        w = typed["reference"][f"{name}.weight"]
        got = np.array(mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=32, bits=8))
        groups = w.reshape(w.shape[0], -1, 32)
        step = (groups.max(-1) - groups.min(-1)) / 255  # [out, in/32]
        error = np.abs(got - w).reshape(groups.shape).max(-1)
        assert np.all(error <= step * 1.001 + 1e-7), name
        assert error.max() > 0  # lossy, as documented


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_architecture_logits_equal_mlx_lm_class(tmp_path, tokenizer, arch):
    types = QWEN_TYPES if arch != "mistral" else TYPES
    path, reference = gf.write_typed_gguf(
        tmp_path / f"{arch}.gguf", tokenizer, types, arch=arch, tied=True, seed=3
    )
    reference.pop("lm_head.weight", None)
    expected_class = {"qwen2": qwen2.Model, "qwen3": qwen3.Model, "mistral": llama.Model}[arch]
    ref = gf.reference_model(arch, reference, DIMS, tokenizer.get_vocab_size(), tied=True)
    expected = np.array(ref(TOKENS))
    model, tok = load(str(path), dtype="float32")
    assert isinstance(model, expected_class) and model.args.tie_word_embeddings
    np.testing.assert_allclose(np.array(model(TOKENS)), expected, rtol=1e-4, atol=1e-4)
    kept, _ = load(str(path))
    assert is_quantized(kept)
    np.testing.assert_allclose(np.array(kept(TOKENS).astype(mx.float32)), expected, rtol=1e-3, atol=2e-3)
    if arch == "qwen2":
        q_proj = _layer(kept, "model.layers.0.self_attn.q_proj")
        assert "bias" in q_proj and q_proj.bits == 4  # Q4_K weight, F32 bias
        np.testing.assert_array_equal(
            np.array(q_proj.bias), reference["model.layers.0.self_attn.q_proj.bias"]
        )
        assert tok.eos_token_ids == {0, gf.EOS_ID}  # <|endoftext|> and <|im_end|>


@pytest.mark.parametrize("keep", [0.999, 0.5])
def test_k_quant_gguf_cut_short(typed, tmp_path, keep):
    data = typed["path"].read_bytes()
    path = tmp_path / "cut-k.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError) as e:
        load(str(path))
    message = str(e.value)
    assert (
        "\n" not in message
        and "cut-k.gguf" in message
        and "truncated" in message
        and "download it again" in message
    )


def test_qwen2_head_size_must_be_hidden_over_heads(tmp_path, tokenizer):
    dims = gf.Dims(head_dim=32)
    path, _ = gf.write_typed_gguf(tmp_path / "odd.gguf", tokenizer, {}, arch="qwen2", dims=dims, tied=True)
    with pytest.raises(ValueError) as e:
        load(str(path))
    message = str(e.value)
    assert "\n" not in message and "head size 32" in message and "qwen2" in message
