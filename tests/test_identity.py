"""Shipped heads are matched to the target by what it is (shape + weights fingerprint), never by a
folder's name: the same weights in another dtype or quantization match, another model does not."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from conftest import byte_tokenizer, save_tiny_model, tiny_llama
from mlxspec.commands.cli import main
from mlxspec.heads.eagle import save_eagle
from mlxspec.loading.identity import model_card, require_shipped_for, same_model, shipped_for, write_card
from test_eagle import random_head


def quantized(model: nn.Module) -> nn.Module:
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def test_a_card_survives_dtype_and_quantization_but_not_another_model():
    card = model_card(tiny_llama(seed=0))
    assert same_model(card, model_card(tiny_llama(seed=0, dtype=mx.float16)))
    assert same_model(card, model_card(quantized(tiny_llama(seed=0))))
    assert same_model(card, model_card(tiny_llama(seed=0, sharpen=4.0)))  # same embedding, same model here
    assert not same_model(card, model_card(tiny_llama(seed=1)))  # same shape, other weights
    assert not same_model(card, model_card(tiny_llama(seed=0, num_layers=3)))
    assert not same_model(card, model_card(tiny_llama(seed=0, hidden_size=32)))


@pytest.fixture
def shipped_eagle(tmp_path, monkeypatch):
    """An EAGLE head shipped under an unhelpful folder name, for tiny_llama(seed=0)."""
    folder = tmp_path / "models" / "eagle" / "some-name"
    save_eagle(random_head(1), folder)
    write_card(folder, tiny_llama(seed=0))
    save_eagle(random_head(1), tmp_path / "models" / "eagle" / "no-card")  # never matched: no card
    monkeypatch.setenv("MLXSPEC_MODELS", str(tmp_path / "models"))
    return folder


def test_heads_are_found_by_the_model_not_the_folder(shipped_eagle):
    assert shipped_for("eagle", quantized(tiny_llama(seed=0))) == shipped_eagle
    assert shipped_for("eagle", tiny_llama(seed=2)) is None
    assert shipped_for("medusa", tiny_llama(seed=0)) is None
    with pytest.raises(ValueError) as e:
        require_shipped_for("eagle", tiny_llama(seed=0, hidden_size=32))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("no EAGLE head ships for this model (llama, hidden 32, 2 layers")
    assert "--eagle-heads" in message


def test_a_model_named_like_the_target_gets_no_head(shipped_eagle, tmp_path, capsys):
    """The issue's case: another architecture in a folder with the shipped head's name."""
    other = tiny_llama(seed=0, hidden_size=32)
    folder = save_tiny_model(tmp_path / "x" / shipped_eagle.name, other, byte_tokenizer())
    assert main(["generate", "--model", str(folder), "--drafter", "eagle", "--prompt", "hi",
                 "--max-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "no EAGLE head ships for this model" in err
