"""DSpark training: teacher-forced blocks in the published layout, learning, calibration, resume, DFlash
initialisation, the trained drafter in generation, the CLI."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import byte_tokenizer, save_tiny_model, tiny_llama

from mlxspec.drafters import make_drafter
from mlxspec.pacing import make_pacer
from mlxspec.engine.generate import generate
from mlxspec.heads.dspark import ConfidenceHead, load_dspark
from mlxspec.train.dflash import DFlashTrainConfig, make_batch, plan_epoch, train_dflash
from mlxspec.train.dspark import DSparkEvalRecord, DSparkTrainConfig, evaluate, train_dspark
from mlxspec.train.loop import StepRecord
from test_schedule import linear_costs
from test_train_eagle import _corpus, _prompts

pytestmark = pytest.mark.slow  # training

CONFIG = DSparkTrainConfig(num_layers=1, block_size=4, markov_rank=8, epochs=3, batch_tokens=512,
                           learning_rate=3e-3, warmup_steps=5)


@pytest.fixture(scope="module")
def tiny():
    """A 4-layer sharpened random target (the corpus records the inputs of layers 2, 2, 1)."""
    return tiny_llama(seed=0, num_layers=4, sharpen=4.0), byte_tokenizer()


@pytest.fixture(scope="module")
def corpus(tiny, tmp_path_factory):
    return _corpus(*tiny, tmp_path_factory.mktemp("corpus"))


def test_published_blocks_score_draft_1_at_the_anchor_row_with_the_previous_text_token(corpus):
    train, _ = corpus
    c, spans = plan_epoch(train, CONFIG)[0]
    arrays = train.load_chunk(c)
    batch = make_batch(arrays, spans, CONFIG, 263, key=(0, 0, c), first_row=0)
    starts = np.cumsum([0] + [length for _, length in spans])
    anchors, previous = np.array(batch.anchors), np.array(batch.previous)
    rows, scored = set(np.array(batch.rows).tolist()), 0
    for n, a in enumerate(anchors):
        e = np.searchsorted(starts, a, side="right") - 1
        s = spans[e][0] + a - starts[e]  # the anchor in the chunk
        end = spans[e][0] + spans[e][1]
        # row r scores draft r + 1, the token at s + r + 1, after that at s + r
        for r in range(min(4, end - s - 1)):
            assert previous[n, r] == arrays["tokens"][s + r]
            if batch.greedy[n, r] >= 0:
                assert batch.greedy[n, r] == arrays["greedy"][s + r] and arrays["mask"][s + r + 1]
                scored += 1
                assert n * 4 + r in rows  # a greedy label has a soft label too (the corpus stores both)
    assert scored > 20 and batch.onehot.shape[0] == 4  # P = B drafts


@pytest.fixture(scope="module")
def trained(tiny, corpus, tmp_path_factory):
    output = tmp_path_factory.mktemp("dspark")
    return list(train_dspark(tiny[0], *corpus, output, CONFIG)), output


def test_training_lowers_the_loss_and_raises_held_out_acceptance(trained):
    records, output = trained
    steps = [r for r in records if isinstance(r, StepRecord)]
    evals = [r for r in records if isinstance(r, DSparkEvalRecord)]
    assert [e.epoch for e in evals] == [0, 1, 2, 3] and len(steps[0].parts) == 4 + 1  # CE per draft, then BCE
    assert np.mean([s.loss for s in steps[-4:]]) < 0.7 * np.mean([s.loss for s in steps[:4]])
    first, last = evals[0], evals[-1]
    assert last.acceptance[0] > first.acceptance[0] + 0.3 and last.tau > first.tau + 0.5
    assert (
        last.chain_acceptance[3]
        <= last.chain_acceptance[2]
        <= last.chain_acceptance[1]
        <= last.chain_acceptance[0]
    )
    assert last.positions >= 300
    config = json.loads((output / "config.json").read_text())["dflash_config"]
    assert (
        config["projector_type"] == "dspark" and config["sample_from_anchor"] and config["markov_rank"] == 8
    )


def test_the_confidence_head_becomes_calibrated(tiny, corpus, trained):
    records, output = trained
    evals = [r for r in records if isinstance(r, DSparkEvalRecord)]
    assert evals[-1].calibration_error < 0.5 * evals[0].calibration_error
    # on the same trained drafter, the trained head predicts survival better than an untrained one
    model = tiny[0]
    net = load_dspark(output, target=model)
    embed, lm_head = model.model.embed_tokens, model.lm_head
    trained_head = evaluate(net, embed, lm_head, corpus[1], CONFIG, 263)
    mx.random.seed(1)
    net.confidence_head = ConfidenceHead(64, 8, with_markov=True)
    fresh_head = evaluate(net, embed, lm_head, corpus[1], CONFIG, 263)
    # the head reads the drafter, it does not change it
    assert trained_head.acceptance == fresh_head.acceptance
    assert trained_head.brier < fresh_head.brier - 0.02
    assert trained_head.calibration_error < fresh_head.calibration_error


def test_the_trained_drafter_loads_and_is_greedy_identical(tiny, trained):
    model, tok = tiny
    _, output = trained
    net = load_dspark(output / "epoch-3", target=model)  # the float16 copy, cast to the target's float32
    assert net.dspark.proposals == 4 and net.config.target_layer_ids == (1, 1, 0)
    accepted = 0
    for prompt in _prompts(tok, 3, 5):
        plain = generate(model, tok, prompt, drafter="none", max_tokens=40)
        for scheduled in (False, True):
            drafter = make_drafter(f"dspark:heads={output / 'epoch-3'}", model, tok)
            gamma = (
                make_pacer("scheduled", model, drafter, costs=linear_costs(1.0), learn=False)
                if scheduled
                else 4
            )
            run = generate(model, tok, prompt, drafter=drafter, num_draft_tokens=gamma, max_tokens=40)
            assert run.tokens == plain.tokens
            accepted += run.stats.accepted
    assert accepted > 20  # the trained drafter's blocks are kept, not just verified away


def test_resuming_mid_run_gives_the_same_drafter(tiny, corpus, tmp_path):
    model, _ = tiny
    config = DSparkTrainConfig(
        num_layers=1, block_size=4, markov_rank=8, epochs=2, batch_tokens=512, warmup_steps=2, save_every=2
    )
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    list(train_dspark(model, corpus[0], None, whole, config))
    for record in train_dspark(model, corpus[0], None, cut, config):
        if isinstance(record, StepRecord) and record.epoch == 1 and record.step == 2:
            break  # a checkpoint was written at this step
    rest = [r for r in train_dspark(model, corpus[0], None, cut, config) if isinstance(r, StepRecord)]
    assert rest[0].epoch == 1 and rest[0].step == 3
    a, b = mx.load(str(whole / "model.safetensors")), mx.load(str(cut / "model.safetensors"))
    assert set(a) == set(b) and {
        "fc.weight",
        "markov_head.markov_w1.weight",
        "confidence_head.proj.weight",
    } <= set(a)
    for key in a:
        np.testing.assert_allclose(np.array(a[key]), np.array(b[key]), atol=1e-5)
    with pytest.raises(ValueError, match="different markov_rank"):
        next(train_dspark(model, corpus[0], None, cut, DSparkTrainConfig(
            num_layers=1, block_size=4, markov_rank=4, epochs=2, batch_tokens=512, save_every=2)))


def test_a_drafter_initialised_from_dflash_starts_drafting_as_it(tiny, corpus, tmp_path):
    model, _ = tiny
    dflash = DFlashTrainConfig(num_layers=1, block_size=4, epochs=1, batch_tokens=512, learning_rate=3e-3,
                               warmup_steps=5)
    trained = [
        r for r in train_dflash(model, *corpus, tmp_path / "dflash", dflash) if not isinstance(r, StepRecord)
    ]
    config = DSparkTrainConfig(num_layers=1, block_size=4, markov_rank=8, epochs=1, learning_rate=1e-3,
                               warmup_steps=5, init_dflash=str(tmp_path / "dflash"))
    evals = [
        r for r in train_dspark(model, *corpus, tmp_path / "dspark", config) if not isinstance(r, StepRecord)
    ]
    start, end = evals[0], evals[-1]
    assert start.epoch == 0 and start.acceptance == trained[-1].acceptance  # same rows, zero Markov bias
    assert len(start.acceptance) == 3  # DFlash's rows: B - 1 drafts
    # trains the same rows on
    assert end.tau > start.tau - 0.1 and end.acceptance[0] > start.acceptance[0] - 0.05
    assert not load_dspark(tmp_path / "dspark").dspark.sample_from_anchor
    wrong = DSparkTrainConfig(num_layers=1, block_size=5, init_dflash=str(tmp_path / "dflash"))
    with pytest.raises(ValueError, match="has 1 layers and block size 4 but this run asks for 1 and 5"):
        next(train_dspark(model, *corpus, tmp_path / "other", wrong))


def test_cli_trains_writes_the_record_and_refuses_bad_input(tmp_path, capsys):
    from mlxspec.commands.train import main as train_main

    tiny = tiny_llama(seed=0, num_layers=4, sharpen=4.0), byte_tokenizer()
    model_dir = save_tiny_model(tmp_path / "target", *tiny)
    _corpus(*tiny, tmp_path / "corpus", train_prompts=8, validation_prompts=2)
    argv = [
        "dspark",
        "--model",
        str(model_dir),
        "--corpus",
        str(tmp_path / "corpus"),
        "-o",
        str(tmp_path / "d"),
        "--num-layers",
        "1",
        "--block-size",
        "4",
        "--markov-rank",
        "4",
        "--max-steps",
        "2",
        "--warmup-steps",
        "1",
    ]
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    assert "before training: held-out agreement" in out and "Brier" in out and "calibration error" in out
    record = json.loads((tmp_path / "d" / "training.json").read_text())
    assert record["config"]["markov_rank"] == 4 and record["heldout"][-1]["epoch"] == 1
    assert len(record["heldout"][-1]["confidence"]) == 4
    assert train_main(argv + ["--markov-rank", "0"]) == 2
    assert "markov-rank must be >= 1" in capsys.readouterr().err
    assert train_main(argv[:5] + ["-o", str(tmp_path / "e"), "--init-dflash", str(tmp_path / "none")]) == 2
    assert "no such DFlash drafter folder" in capsys.readouterr().err
