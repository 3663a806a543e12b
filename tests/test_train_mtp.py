"""MTP module training: the loss falls and held-out agreement rises, a resumed run ends with the same
module, the saved module loads and drafts greedy-identical text, and the CLI writes its record."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import byte_tokenizer, tiny_llama
from mlxspec import generate
from mlxspec.drafters.mtp import MTPDrafter
from mlxspec.heads.mtp import load_mtp
from mlxspec.train.eagle_data import EagleEvalRecord, token_counts
from mlxspec.train.features import FeatureCache
from mlxspec.train.loop import StepRecord
from mlxspec.train.mtp import MTPTrainConfig, train_mtp
from test_train_eagle import _corpus, _prompts

pytestmark = pytest.mark.slow  # training

CONFIG = MTPTrainConfig(
    ttt_steps=2, eval_steps=2, epochs=3, batch_tokens=512, learning_rate=3e-3, warmup_steps=5
)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=0, num_layers=2, sharpen=4.0), byte_tokenizer()


@pytest.fixture(scope="module")
def corpus(tiny, tmp_path_factory):
    return _corpus(*tiny, tmp_path_factory.mktemp("corpus"), train_prompts=48, validation_prompts=8)


@pytest.fixture(scope="module")
def trained(tiny, corpus, tmp_path_factory):
    output = tmp_path_factory.mktemp("mtp")
    return list(train_mtp(tiny[0], *corpus, output, CONFIG)), output


def test_training_lowers_the_loss_and_raises_agreement(trained):
    records, _ = trained
    steps = [r for r in records if isinstance(r, StepRecord)]
    evals = [r for r in records if isinstance(r, EagleEvalRecord)]
    assert [e.epoch for e in evals] == [0, 1, 2, 3] and len(steps[0].parts) == 2
    assert np.mean([s.loss for s in steps[-4:]]) < 0.85 * np.mean([s.loss for s in steps[:4]])
    first, last = evals[0], evals[-1]
    assert last.acceptance[0] > first.acceptance[0] + 0.2 and last.acceptance[0] > 0.35
    assert last.tau > first.tau and last.positions >= 200


def test_resuming_mid_run_gives_the_same_module(tiny, corpus, tmp_path):
    model, _ = tiny
    config = MTPTrainConfig(ttt_steps=2, epochs=2, batch_tokens=512, warmup_steps=2, save_every=3)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    list(train_mtp(model, corpus[0], None, whole, config))
    for record in train_mtp(model, corpus[0], None, cut, config):
        if isinstance(record, StepRecord) and record.epoch == 1 and record.step == 3:
            break  # a checkpoint was written at this step
    assert json.loads((cut / "trainer_state.json").read_text())["step"] == 3
    rest = [r for r in train_mtp(model, corpus[0], None, cut, config) if isinstance(r, StepRecord)]
    assert (rest[0].epoch, rest[0].step) == (1, 4)
    a, b = mx.load(str(whole / "model.safetensors")), mx.load(str(cut / "model.safetensors"))
    assert set(a) == set(b) and "model.layers.2.eh_proj.weight" in a
    for key in a:
        np.testing.assert_allclose(np.array(a[key]), np.array(b[key]), atol=1e-5)
    with pytest.raises(ValueError, match="different ttt_steps"):
        next(train_mtp(model, corpus[0], None, cut, MTPTrainConfig(ttt_steps=3, epochs=2, batch_tokens=512)))


def test_the_trained_module_drafts_greedy_identical_text_and_is_accepted(tiny, trained):
    model, tok = tiny
    _, output = trained
    stack = load_mtp(output / "epoch-3", model)  # the float16 copy, cast to the target's float32
    accepted = 0
    for prompt in _prompts(tok, 3, 5):
        plain = generate(model, tok, prompt, drafter="none", max_tokens=40)
        run = generate(model, tok, prompt, drafter=MTPDrafter(stack, model, depth=2), num_draft_tokens=2,
                       max_tokens=40)
        assert run.tokens == plain.tokens
        accepted += run.stats.accepted
    assert accepted > 15


def test_cli_trains_and_writes_the_record(tiny_model_dir, tmp_path, capsys):
    from mlxspec.commands.train import main as train_main
    from mlxspec.loading.models import load

    model, tok = load(str(tiny_model_dir), dtype="float32")
    _corpus(model, tok, tmp_path / "corpus", train_prompts=8, validation_prompts=2)
    out = tmp_path / "mtp"
    argv = ["mtp", "--model", str(tiny_model_dir), "--corpus", str(tmp_path / "corpus"), "--output", str(out),
            "--max-steps", "2", "--batch-tokens", "512", "--draft-vocab-size", "40"]
    assert train_main(argv) == 0
    captured = capsys.readouterr()
    assert "before training: held-out agreement" in captured.out and "epoch 1:" in captured.out
    record = json.loads((out / "training.json").read_text())
    assert record["command"].startswith("mlxspec train mtp --model") and record["heldout"][0]["epoch"] == 0
    stack = load_mtp(out, model)
    assert stack.config.num_modules == 1
    # the draft vocabulary: the 40 most frequent answer tokens of the training corpus, sorted
    counts = token_counts(FeatureCache(tmp_path / "corpus" / "train"), model.args.vocab_size)
    assert len(stack.draft_ids) == 40 and list(stack.draft_ids) == sorted(stack.draft_ids)
    assert counts[stack.draft_ids].min() >= np.delete(counts, stack.draft_ids).max()
    np.testing.assert_array_equal(load_mtp(out / "epoch-1", model).draft_ids, stack.draft_ids)
    assert train_main(argv[:-4] + ["--ttt-steps", "0"]) == 2
    assert "ttt-steps must be >= 1" in capsys.readouterr().err
