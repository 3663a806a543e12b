"""``mlxspec convert``: a GGUF (K-quants, qwen2) to an mlx-lm folder that ``mlx_lm.load`` opens unchanged."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from mlx_lm import load as mlx_lm_load

import gguf_fixtures as gf
from mlxspec.commands.convert import main
from mlxspec.loading.models import is_quantized, load

TOKENS = mx.array([[1, 87, 85, 71, 84, 201, 74, 75, 223, 19, 20, 2, 300, 17]])  # [B=1, T=14]
TYPES = {"model.embed_tokens": T.Q8_0, "model.layers.0.self_attn.q_proj": T.Q4_K,
         "model.layers.0.mlp.up_proj": T.Q5_0, "model.layers.1.mlp.down_proj": T.Q6_K,
         "model.layers.1.self_attn.v_proj": T.Q5_K}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path, _ = gf.write_typed_gguf(tmp_path_factory.mktemp("convert") / "tiny-qwen2.gguf",
                                  gf.train_tokenizer(), TYPES, arch="qwen2", tied=False, seed=5)
    return path


def test_kept_quantized_folder_loads_in_mlx_lm_with_identical_logits(gguf_path, tmp_path, capsys):
    out = tmp_path / "mlx"
    assert main([str(gguf_path), str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and "wrote" in captured.err
    ours, tokenizer = load(str(gguf_path))
    model, mlx_tokenizer = mlx_lm_load(str(out))
    assert type(model).__module__ == "mlx_lm.models.qwen2" and is_quantized(model)
    layers = dict(model.named_modules())
    assert layers["model.layers.0.self_attn.q_proj"].bits == 4  # Q4_K
    assert layers["model.layers.0.mlp.up_proj"].bits == 5  # Q5_0
    assert layers["model.layers.1.self_attn.v_proj"].bits == 5  # Q5_K
    assert isinstance(layers["model.layers.1.mlp.down_proj"], nn.Linear)  # Q6_K, dequantized
    assert isinstance(layers["model.embed_tokens"], nn.QuantizedEmbedding)
    assert layers["model.embed_tokens"].bits == 8
    np.testing.assert_array_equal(np.array(model(TOKENS)), np.array(ours(TOKENS)))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["model.layers.0.mlp.up_proj"] == {"group_size": 32, "bits": 5,
                                                                      "mode": "affine"}
    assert sorted(config["eos_token_id"]) == [0, gf.EOS_ID]
    text = "<|im_start|>user\nhéllo 2024<|im_end|>\n"
    assert mlx_tokenizer.encode(text) == tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert mlx_tokenizer.apply_chat_template(messages, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert set(mlx_tokenizer.eos_token_ids) == {0, gf.EOS_ID}


def test_float32_folder_equals_the_float32_load(gguf_path, tmp_path):
    out = tmp_path / "f32"
    assert main([str(gguf_path), str(out), "--dtype", "float32"]) == 0
    model, _ = mlx_lm_load(str(out))
    ours, _ = load(str(gguf_path), dtype="float32")
    assert not is_quantized(model) and "quantization" not in json.loads((out / "config.json").read_text())
    np.testing.assert_array_equal(np.array(model(TOKENS)), np.array(ours(TOKENS)))


def test_requantize_writes_8_bit_layers(gguf_path, tmp_path):
    out = tmp_path / "q8"
    assert main([str(gguf_path), str(out), "--requantize"]) == 0
    model, _ = mlx_lm_load(str(out))
    assert dict(model.named_modules())["model.layers.1.mlp.down_proj"].bits == 8


def test_bad_input_is_one_line(gguf_path, tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert main([str(gguf_path), str(busy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an empty folder" in err
    assert main([str(tmp_path / "missing.gguf"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.gguf" in err
    assert not (tmp_path / "o").exists()
