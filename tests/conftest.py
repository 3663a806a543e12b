"""Tiny random models and a byte-level tokenizer, seeded per test. Tests never download."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

#: MLX's CPU matmuls call the BLAS that is in the process's global symbol scope when MLX loads
#: (``mlxspec.runtime.machine.blas_in_use``). An installed OpenBLAS is put there first, as the CLI's ``--blas
#: auto`` does by re-running itself: the real-model and training tests then run several times faster. Without
#: one the tests run on the reference BLAS bundled with MLX, only slower. Once MLX is loaded it is too late (a
#: script that imported MLX before this module, as tests/shard_worker.py does, keeps its BLAS).
OPENBLAS = ctypes.util.find_library("openblas") if sys.platform.startswith("linux") else None
if OPENBLAS and "mlx.core" not in sys.modules:
    ctypes.CDLL(OPENBLAS, mode=ctypes.RTLD_GLOBAL)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import pytest  # noqa: E402
from mlx_lm.models import llama, qwen2  # noqa: E402
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper  # noqa: E402


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory):
    """This session's ``MLXSPEC_CACHE``: measured costs, unpacked wheels (none of the caller's)."""
    return tmp_path_factory.mktemp("mlxspec-cache")


@pytest.fixture(autouse=True)
def hermetic(request, monkeypatch, session_cache):
    """A test sees none of the caller's ``MLXSPEC_*`` or ``LD_PRELOAD`` (this process's BLAS is chosen above,
    at import) and a cache folder of this session's, so no cost measured elsewhere (under load, say) steers
    it. Tests of the caller's real models (``real_model``, ``large_model``) keep the caller's wheels and
    cache."""
    if request.node.get_closest_marker("real_model") or request.node.get_closest_marker("large_model"):
        return
    for name in [name for name in os.environ if name.startswith("MLXSPEC_")] + ["LD_PRELOAD"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLXSPEC_CACHE", str(session_cache))


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts) is one worker per core, but one process where workers get in the way:
    with ``-s`` (a worker's output is not shown, ``breakpoint()`` cannot stop) or ``--pdb``."""
    if config.getoption("capture") == "no" or config.getoption("usepdb"):
        return 0
    return None  # xdist's own count


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselection sees the markers
def pytest_collection_modifyitems(items):
    """A test on the real default model is slow too: the fast tier runs on tiny random models only."""
    for item in items:
        if item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.slow)


def tiny_llama(seed: int = 0, vocab_size: int = 264, hidden_size: int = 64, num_layers: int = 2,
               dtype=mx.float32, sharpen: float = 1.0) -> nn.Module:
    """A random llama (2 layers, hidden 64) with float32 weights.

    ``sharpen`` scales the LM head so distributions are peakier (more realistic
    acceptance) without changing the architecture.
    """
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden_size, num_hidden_layers=num_layers,
        intermediate_size=2 * hidden_size, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=vocab_size, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    model.set_dtype(dtype)
    if sharpen != 1.0:
        model.lm_head.weight = model.lm_head.weight * sharpen
    mx.eval(model.parameters())
    model.eval()
    return model


def tiny_qwen2(seed: int = 0, vocab_size: int = 264, hidden_size: int = 64, num_layers: int = 2,
               sharpen: float = 1.0) -> nn.Module:
    """A random qwen2 (biased q/k/v projections, tied embeddings) shaped like ``tiny_llama``, float32."""
    mx.random.seed(seed)
    args = qwen2.ModelArgs(
        model_type="qwen2", hidden_size=hidden_size, num_hidden_layers=num_layers,
        intermediate_size=2 * hidden_size, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=vocab_size, max_position_embeddings=4096, tie_word_embeddings=True,
    )
    model = qwen2.Model(args)
    if sharpen != 1.0:
        model.model.embed_tokens.weight = model.model.embed_tokens.weight * sharpen
    mx.eval(model.parameters())
    model.eval()
    return model


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer() -> TokenizerWrapper:
    """A byte-level BPE tokenizer (256 byte tokens, no merges) + 3 special tokens.

    Ids 0..255 are the byte-level alphabet (sorted); 256 is ``<|im_end|>`` (EOS), then the other specials.
    Pair it with a model of vocab 259 or more (extra rows act as embedding padding).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE
    )
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    return TokenizerWrapper(tok, BPEStreamingDetokenizer)


@pytest.fixture
def target():
    return tiny_llama(seed=0)


@pytest.fixture
def tokenizer():
    return byte_tokenizer()


def save_tiny_model(path, model: nn.Module, tokenizer: TokenizerWrapper):
    """Write ``model`` and ``tokenizer`` as an mlx-lm model folder that ``mlx_lm.load`` opens."""
    import dataclasses

    from mlx_lm.utils import save_config, save_model

    save_model(path, model)
    save_config(dataclasses.asdict(model.args), path / "config.json")
    tokenizer._tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """An mlx-lm folder holding ``tiny_llama(seed=0, sharpen=4)`` and the byte tokenizer."""
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny-target"), tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    )


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory):
    """An mlx-lm folder holding a different random model with the same tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-draft"), tiny_llama(seed=3), byte_tokenizer())
