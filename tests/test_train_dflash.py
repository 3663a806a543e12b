"""DFlash training: blocks drawn from packed examples, learning, held-out acceptance, resume, CLI."""

from __future__ import annotations

import dataclasses


import mlx.core as mx
import numpy as np
import pytest
from conftest import byte_tokenizer, tiny_llama

from mlxspec.drafters.dflash import DFlashDrafter
from mlxspec.engine.generate import generate
from mlxspec.heads.dflash import load_dflash
from mlxspec.train.dflash import (
    DFlashEvalRecord,
    DFlashTask,
    DFlashTrainConfig,
    block_batches,
    make_batch,
    plan_epoch,
    train_dflash,
)
from mlxspec.train.loop import StepRecord
from test_train_eagle import _corpus, _prompts

pytestmark = pytest.mark.slow  # training

CONFIG = DFlashTrainConfig(num_layers=1, block_size=4, epochs=3, batch_tokens=512, learning_rate=3e-3,
                           warmup_steps=5)


@pytest.fixture(scope="module")
def tiny():
    """A 4-layer sharpened random target (the corpus records the inputs of layers 2, 2, 1) and its corpus."""
    model, tok = tiny_llama(seed=0, num_layers=4, sharpen=4.0), byte_tokenizer()
    return model, tok


@pytest.fixture(scope="module")
def corpus(tiny, tmp_path_factory):
    return _corpus(*tiny, tmp_path_factory.mktemp("corpus"))


def test_blocks_see_only_their_example_before_the_anchor_and_carry_shifted_labels(corpus):
    train, _ = corpus
    c, spans = plan_epoch(train, CONFIG)[0]
    arrays = train.load_chunk(c)
    batch = make_batch(arrays, spans, CONFIG, 263, key=(0, 0, c))
    assert len(spans) > 1 and batch.features.shape[1] == sum(length for _, length in spans)
    starts = np.cumsum([0] + [length for _, length in spans])
    mask, anchors, blocks = np.array(batch.mask)[:, 0, 0], np.array(batch.anchors), np.array(batch.blocks)
    for n, a in enumerate(anchors):
        e = np.searchsorted(starts, a, side="right") - 1
        seen = np.flatnonzero(mask[n, : starts[-1]])
        assert seen.tolist() == list(range(starts[e], a))  # its own example, before the anchor
        assert mask[n, starts[-1]:].all() and blocks[n, 1:].tolist() == [263] * 3
        s = spans[e][0] + a - starts[e]  # the anchor in the chunk
        assert blocks[n, 0] == arrays["tokens"][s]
        for j in range(1, 4):  # the greedy label of block position j is the target's choice for token s + j
            if batch.greedy[n, j] >= 0:
                assert batch.greedy[n, j] == arrays["greedy"][s + j - 1] and arrays["mask"][s + j]
    again = make_batch(arrays, spans, CONFIG, 263, key=(0, 0, c))
    assert np.array_equal(np.array(again.anchors), anchors)  # seeded: a resumed run replays the blocks
    narrow = make_batch(arrays, spans, dataclasses.replace(CONFIG, context_window=2), 263, key=(0, 0, c))
    assert np.array_equal(np.array(narrow.anchors), anchors)
    for n, a in enumerate(anchors):  # a window keeps the last 2 positions of the example before the anchor
        e = np.searchsorted(starts, a, side="right") - 1
        seen = np.flatnonzero(np.array(narrow.mask)[n, 0, 0, : starts[-1]])
        assert seen.tolist() == list(range(max(starts[e], a - 2), a))


@pytest.fixture(scope="module")
def trained(tiny, corpus, tmp_path_factory):
    output = tmp_path_factory.mktemp("dflash")
    return list(train_dflash(tiny[0], *corpus, output, CONFIG)), output


def test_training_lowers_the_loss_and_raises_held_out_acceptance(trained):
    records, _ = trained
    steps = [r for r in records if isinstance(r, StepRecord)]
    evals = [r for r in records if isinstance(r, DFlashEvalRecord)]
    assert [e.epoch for e in evals] == [0, 1, 2, 3] and len(steps[0].parts) == 3
    assert np.mean([s.loss for s in steps[-4:]]) < 0.7 * np.mean([s.loss for s in steps[:4]])
    first, last = evals[0], evals[-1]
    assert last.acceptance[0] > first.acceptance[0] + 0.3 and last.tau > first.tau + 0.5
    assert last.chain_acceptance[2] <= last.chain_acceptance[1] <= last.chain_acceptance[0]
    assert last.positions >= 300


def test_the_checkpoint_loads_and_drafts_greedy_identical_text(tiny, trained):
    model, tok = tiny
    _, output = trained
    net = load_dflash(output / "epoch-3", target=model)  # the float16 copy, cast to the target's float32
    assert net.config.target_layer_ids == (1, 1, 0) and net.config.block_size == 4
    accepted = 0
    for prompt in _prompts(tok, 3, 5):
        plain = generate(model, tok, prompt, drafter="none", max_tokens=40)
        run = generate(
            model, tok, prompt, drafter=DFlashDrafter(net, model), num_draft_tokens=3, max_tokens=40
        )
        assert run.tokens == plain.tokens
        accepted += run.stats.accepted
    assert accepted > 20  # the trained drafter's blocks are kept, not just verified away


def test_resuming_mid_run_gives_the_same_drafter(tiny, corpus, tmp_path):
    model, _ = tiny
    config = DFlashTrainConfig(
        num_layers=1, block_size=4, epochs=2, batch_tokens=512, warmup_steps=2, save_every=2
    )
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    list(train_dflash(model, corpus[0], None, whole, config))
    for record in train_dflash(model, corpus[0], None, cut, config):
        if isinstance(record, StepRecord) and record.epoch == 1 and record.step == 2:
            break  # a checkpoint was written at this step
    rest = [r for r in train_dflash(model, corpus[0], None, cut, config) if isinstance(r, StepRecord)]
    assert rest[0].epoch == 1 and rest[0].step == 3
    a, b = mx.load(str(whole / "model.safetensors")), mx.load(str(cut / "model.safetensors"))
    assert set(a) == set(b) and {
        "fc.weight",
        "hidden_norm.weight",
        "layers.0.self_attn.k_norm.weight",
    } <= set(a)
    for key in a:
        np.testing.assert_allclose(np.array(a[key]), np.array(b[key]), atol=1e-5)
    with pytest.raises(ValueError, match="different block_size"):
        next(train_dflash(model, corpus[0], None, cut, DFlashTrainConfig(num_layers=1, block_size=5, epochs=2,
                                                                         batch_tokens=512, save_every=2)))


def test_cli_trains_writes_the_record_and_refuses_bad_input(tiny_model_dir, tmp_path, capsys):
    from mlxspec.commands.train import main as train_main
    from mlxspec.loading.models import load

    model, tok = load(str(tiny_model_dir), dtype="float32")  # 2 layers: its corpus records the embedding
    _corpus(model, tok, tmp_path / "corpus", train_prompts=4, validation_prompts=2)
    argv = [
        "dflash",
        "--model",
        str(tiny_model_dir),
        "--corpus",
        str(tmp_path / "corpus"),
        "-o",
        str(tmp_path / "d"),
    ]
    assert train_main(argv) == 2
    assert "records the input of layer 0" in capsys.readouterr().err
    assert train_main(argv + ["--block-size", "1"]) == 2
    assert "block-size must be >= 2" in capsys.readouterr().err


def test_training_reads_normalised_features_and_saves_a_drafter_that_reads_raw_ones(tiny, corpus, tmp_path):
    """Massive feature dimensions (Qwen: RMS 175 against a median of 0.6) are divided out in training and
    folded into fc on saving, so the saved drafter computes on raw features what training computed."""
    model, _ = tiny
    task = DFlashTask(model, corpus[0], None, CONFIG)
    K_H = 3 * model.args.hidden_size
    assert task.scale.shape == (K_H,) and (task.scale >= 1e-2).all()
    task.scale = np.linspace(0.05, 200.0, K_H).astype(np.float32)  # far from 1, so a missing fold shows
    net = task.init()
    raw = mx.random.normal((1, 6, K_H), key=mx.random.key(2)) * mx.array(task.scale)
    want = net.fuse(raw / mx.array(task.scale))
    task.save(net, tmp_path / "d", None)
    saved = load_dflash(tmp_path / "d", target=model)
    np.testing.assert_allclose(np.array(saved.fuse(raw)), np.array(want), rtol=1e-4, atol=1e-4)
    resumed = task.load(tmp_path / "d")  # back in the training parametrisation
    np.testing.assert_allclose(np.array(resumed.fc.weight), np.array(net.fc.weight), rtol=1e-5, atol=1e-7)
    batch = next(iter(task.batches(net, 0, 0)))
    unscaled = next(iter(block_batches(corpus[0], task._plan(0), CONFIG, task.mask_token_id, epoch=0)))
    np.testing.assert_allclose(np.array(batch.features) * task.scale, np.array(unscaled.features), rtol=1e-5)
