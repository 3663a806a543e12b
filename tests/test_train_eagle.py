"""EAGLE head training: draft vocabulary, sequence batches, the unrolled forward, learning, resume, CLI."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import numpy as np
import pytest
from conftest import byte_tokenizer, tiny_llama
from mlx_lm.models.cache import KVCache

from mlxspec.drafters.eagle import EagleDrafter
from mlxspec.engine.generate import generate
from mlxspec.heads.eagle import load_eagle
from mlxspec.train.corpus import build_corpus
from mlxspec.train.eagle import init_head, train_eagle, unroll
from mlxspec.train.eagle_data import (
    EagleEvalRecord,
    EagleTrainConfig,
    draft_vocabulary,
    make_batch,
    plan_epoch,
    sequence_batches,
    target_to_draft,
    token_counts,
)
from mlxspec.train.features import FeatureCache
from mlxspec.train.loop import StepRecord

pytestmark = pytest.mark.slow  # training


def _prompts(tok, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    texts = ["".join(rng.choice("abcdefgh") for _ in range(rng.randrange(3, 12))) for _ in range(n)]
    return [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
            for t in texts]


def _corpus(model, tok, root, train_prompts=64, validation_prompts=8):
    list(build_corpus(model, tok, _prompts(tok, train_prompts, 1), root / "train", max_new_tokens=48,
                      batch_size=16))
    list(
        build_corpus(
            model,
            tok,
            _prompts(tok, validation_prompts, 2),
            root / "validation",
            max_new_tokens=48,
            batch_size=8,
        )
    )
    return FeatureCache(root / "train"), FeatureCache(root / "validation")


@pytest.fixture(scope="module")
def tiny():
    """A 4-layer sharpened random target (EAGLE-3 taps the inputs of layers 2, 2, 1) and its corpus."""
    return tiny_llama(seed=0, num_layers=4, sharpen=4.0), byte_tokenizer()


@pytest.fixture(scope="module")
def corpus(tiny, tmp_path_factory):
    return _corpus(*tiny, tmp_path_factory.mktemp("corpus"))


CONFIG3 = EagleTrainConfig(version=3, draft_vocab_size=64, ttt_steps=3, epochs=3, batch_tokens=512,
                           learning_rate=3e-3, warmup_steps=5)
CONFIG1 = EagleTrainConfig(version=1, epochs=3, batch_tokens=512, learning_rate=3e-3, warmup_steps=5)


# --- draft vocabulary -------------------------------------------------------------------------


def test_draft_vocabulary_is_the_most_frequent_ids_as_offsets():
    counts = np.array([0, 5, 9, 9, 0, 7, 1, 0, 3, 9])
    d2t, t2d = draft_vocabulary(counts, 5)
    chosen = np.arange(5) + d2t  # target id = draft id + d2t[draft id]
    assert chosen.tolist() == [1, 2, 3, 5, 9]  # the five most frequent, ascending (ties: smaller id)
    assert t2d[chosen].all() and t2d.sum() == 5
    assert not np.array_equal(d2t, chosen)  # reading d2t as absolute ids would be wrong
    assert target_to_draft(d2t, len(counts)).tolist() == [-1, 0, 1, 2, -1, 3, -1, -1, -1, 4]
    # fewer seen ids than asked: smallest unseen fill up
    d2t, t2d = draft_vocabulary(np.array([0, 4, 0, 0]), 3)
    assert (np.arange(3) + d2t).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        draft_vocabulary(counts, 11)


def test_token_counts_cover_only_answer_tokens(corpus):
    train, _ = corpus
    counts = token_counts(train, 264)
    assert counts.sum() == train.manifest["masked_tokens"]
    chunks = [train.load_chunk(c) for c in range(train.num_chunks)]
    answers = np.concatenate([a["tokens"][a["mask"]] for a in chunks])
    prompts = np.concatenate([a["tokens"][~a["mask"]] for a in chunks])
    assert np.array_equal(counts, np.bincount(answers, minlength=264))
    prompt_only = np.setdiff1d(prompts, answers)
    assert len(prompt_only) > 0 and (counts[prompt_only] == 0).all()  # template tokens never count
    d2t, t2d = draft_vocabulary(counts, 16)
    assert t2d[np.arange(16) + d2t].all() and counts[t2d].min() >= np.sort(counts)[-16]


# --- batches ----------------------------------------------------------------------------------


def test_batches_hold_whole_examples_with_labels_shifted_per_step(corpus):
    train, _ = corpus
    config = EagleTrainConfig(version=3, ttt_steps=3, batch_tokens=512)
    arrays = train.load_chunk(0)
    c, spans = plan_epoch(train, config, shuffle=False)[0]
    assert c == 0 and spans[0] == (0, int(arrays["offsets"][1]))
    d2t, _ = draft_vocabulary(token_counts(train, 264), 64)
    to_draft = target_to_draft(d2t, 264)
    batch = make_batch(arrays, spans, config, to_draft)
    s, length = spans[0]
    T = batch.features.shape[1]
    assert T == max(n for _, n in spans) - 1 and batch.tokens.shape[1] == T + 2
    # draft position j: layer inputs of token j (low, mid, high) with token j + 1
    np.testing.assert_array_equal(
        np.array(batch.features[0, : length - 1]),
        arrays["aux"][s : s + length - 1].reshape(length - 1, -1).astype(np.float32),
    )
    assert np.array(batch.tokens[0, : length - 1]).tolist() == arrays["tokens"][s + 1 : s + length].tolist()
    for k in range(3):  # step k at j is scored on token j + 2 + k, an answer token of the same example
        rows = batch.eval_rows[k][batch.eval_rows[k] < T]  # row 0 of the batch
        assert rows.tolist() == [j for j in range(length - 2 - k) if arrays["mask"][s + j + 2 + k]]
        assert batch.eval_greedy[k][: len(rows)].tolist() == arrays["tokens"][s + rows + 2 + k].tolist()
        loss_rows = np.array(batch.rows[k])
        assert set(loss_rows.tolist()) <= set(batch.eval_rows[k].tolist())  # loss only where drafteable
        probs = np.array(batch.label_probs[k])
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
        assert (np.array(batch.label_ids[k]) < 64).all()


def test_the_batch_plan_is_seeded_so_resuming_replays_it(corpus):
    train, _ = corpus
    plan = plan_epoch(train, CONFIG3, epoch=1)
    assert plan == plan_epoch(train, CONFIG3, epoch=1) and plan != plan_epoch(train, CONFIG3, epoch=2)
    assert all(len(spans) * (max(n for _, n in spans) - 1) <= 512 or len(spans) == 1 for _, spans in plan)
    every = sorted(s for c, spans in plan for s, _ in spans if c == 0)
    assert every == sorted(
        s for c, spans in plan_epoch(train, CONFIG3, shuffle=False) for s, _ in spans if c == 0
    )
    a = list(sequence_batches(train, plan, CONFIG3, None, start=3))
    b = list(sequence_batches(train, plan, CONFIG3, None))[3:]
    assert len(a) == len(b) and all(
        np.array_equal(np.array(x.tokens), np.array(y.tokens)) for x, y in zip(a, b)
    )


# --- the unrolled forward ---------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 3])
def test_unrolled_step_k_is_what_a_chain_draft_sees(tiny, version):
    """Step k at position j equals the head run with a KV cache: the prefix 0..j with the target's
    features, then k chain steps each feeding its own previous output (docs/heads.md 5.6)."""
    model, _ = tiny
    head = init_head(model, EagleTrainConfig(version=version, draft_vocab_size=0))
    embed = model.model.embed_tokens
    T, S, F = 9, 3, 64 * (3 if version == 3 else 1)
    features = mx.random.normal((1, T, F), key=mx.random.key(1))
    tokens = mx.random.randint(0, 264, (1, T + S - 1), key=mx.random.key(2))
    outs = unroll(head, embed, features, tokens, S)
    np.testing.assert_allclose(np.array(outs[0]), np.array(head(features, tokens[:, :T], embed)), atol=1e-5)
    for j in (0, 4, T - 1):
        cache = KVCache()
        x = head(features[:, : j + 1], tokens[:, : j + 1], embed, cache=cache)[:, -1:]
        for k in range(1, S):
            x = head(x, tokens[:, j + k : j + k + 1], embed, cache=cache)
            np.testing.assert_allclose(np.array(x[0, 0]), np.array(outs[k][0, j]), atol=1e-4)


# --- training ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[CONFIG3, CONFIG1], ids=["eagle3", "eagle1"])
def trained(request, tiny, corpus, tmp_path_factory):
    """One 3-epoch run per version: (config, records, output folder)."""
    output = tmp_path_factory.mktemp(f"eagle{request.param.version}")
    return request.param, list(train_eagle(tiny[0], *corpus, output, request.param)), output


def test_training_lowers_the_loss_and_beats_chance(trained):
    _, records, _ = trained
    steps = [r for r in records if isinstance(r, StepRecord)]
    evals = [r for r in records if isinstance(r, EagleEvalRecord)]
    assert [e.epoch for e in evals] == [0, 1, 2, 3]
    assert np.mean([s.loss for s in steps[-4:]]) < 0.7 * np.mean([s.loss for s in steps[:4]])
    first, last = evals[0], evals[-1]
    assert last.acceptance[0] > 0.5 > 10 / 64 and last.acceptance[0] > first.acceptance[0] + 0.3
    assert last.chain_acceptance[1] <= last.chain_acceptance[0] and last.tau > 1.8 > first.tau
    assert last.positions >= 300


def test_resuming_mid_run_gives_the_same_head(tiny, corpus, tmp_path):
    model, _ = tiny
    config = EagleTrainConfig(version=3, draft_vocab_size=64, ttt_steps=2, epochs=2, batch_tokens=512,
                              warmup_steps=2, save_every=4)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    list(train_eagle(model, corpus[0], None, whole, config))
    for record in train_eagle(model, corpus[0], None, cut, config):
        if isinstance(record, StepRecord) and record.epoch == 1 and record.step == 4:
            break  # a checkpoint was written at this step
    state = json.loads((cut / "trainer_state.json").read_text())
    assert (state["epoch"], state["step"]) == (1, 4)
    rest = [r for r in train_eagle(model, corpus[0], None, cut, config) if isinstance(r, StepRecord)]
    assert rest[0].epoch == 1 and rest[0].step == 5
    a, b = mx.load(str(whole / "model.safetensors")), mx.load(str(cut / "model.safetensors"))
    assert set(a) == set(b) and {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= set(a)
    for key in a:
        np.testing.assert_allclose(np.array(a[key]), np.array(b[key]), atol=1e-5)
    with pytest.raises(ValueError, match="different ttt_steps"):
        next(
            train_eagle(
                model,
                corpus[0],
                None,
                cut,
                EagleTrainConfig(version=3, draft_vocab_size=64, ttt_steps=3, epochs=2, batch_tokens=512),
            )
        )


def test_the_checkpoint_loads_and_drafts_greedy_identical_text(tiny, trained):
    model, tok = tiny
    config, _, output = trained
    head = load_eagle(output / "epoch-3", target=model)  # float16 copy, cast to the target's float32
    assert head.config.version == config.version
    if config.version == 3:
        assert head.config.aux_layers == (2, 2, 1) and head.config.draft_vocab_size == 64
        d2t = np.array(head.d2t)
        assert np.array(head.t2d)[np.arange(64) + d2t].all()
    accepted = 0
    for prompt in _prompts(tok, 3, 5):
        plain = generate(model, tok, prompt, drafter="none", max_tokens=40)
        run = generate(
            model,
            tok,
            prompt,
            drafter=EagleDrafter(head, model, depth=4, top_k=1),
            num_draft_tokens=4,
            max_tokens=40,
        )
        assert run.tokens == plain.tokens
        accepted += run.stats.accepted
    assert accepted > 20  # the trained head's drafts are kept, not just verified away


# --- CLI --------------------------------------------------------------------------------------


def test_cli_trains_writes_the_record_and_refuses_bad_input(tiny_model_dir, tmp_path, capsys):
    from mlxspec.commands.train import main as train_main
    from mlxspec.loading.models import load

    model, tok = load(str(tiny_model_dir), dtype="float32")
    _corpus(model, tok, tmp_path / "corpus", train_prompts=16, validation_prompts=4)
    out = tmp_path / "head"
    argv = [
        "eagle",
        "--model",
        str(tiny_model_dir),
        "--corpus",
        str(tmp_path / "corpus"),
        "--output",
        str(out),
        "--draft-vocab-size",
        "32",
        "--ttt-steps",
        "2",
        "--epochs",
        "3",
        "--max-steps",
        "3",
        "--batch-tokens",
        "512",
    ]
    assert train_main(argv) == 0
    captured = capsys.readouterr()
    assert "before training: held-out agreement" in captured.out and "epoch 1:" in captured.out
    record = json.loads((out / "training.json").read_text())
    assert record["version"] == 3 and record["command"].startswith("mlxspec train eagle --model")
    # --max-steps caps the run
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
    assert record["heldout"][0]["epoch"] == 0 and record["train_s"] >= 0
    assert load_eagle(out / "epoch-1", target=model).config.draft_vocab_size == 32
    assert train_main(argv[:-2] + ["--batch-tokens", "0"]) == 2
    assert "batch-tokens must be >= 1" in capsys.readouterr().err
    assert train_main(["eagle", "--corpus", str(tmp_path / "nowhere"), "--output", str(out)]) == 2
    assert "no corpus in" in capsys.readouterr().err
    other = tiny_llama(seed=7)  # a corpus of another model
    _corpus(other, tok, tmp_path / "other", train_prompts=4, validation_prompts=2)
    argv = [
        "eagle",
        "--model",
        str(tiny_model_dir),
        "--corpus",
        str(tmp_path / "other"),
        "-o",
        str(tmp_path / "x"),
    ]
    assert train_main(argv) == 2
    assert "made by another model" in capsys.readouterr().err


def test_eagle3_fc_reads_normalised_features_in_training_and_raw_ones_once_saved(tiny, corpus, tmp_path):
    from mlxspec.train.eagle import EagleTask

    model, _ = tiny
    task = EagleTask(model, corpus[0], None, CONFIG3)
    F = 3 * model.args.hidden_size
    assert task.scale.shape == (F,)
    task.scale = np.linspace(0.05, 200.0, F).astype(np.float32)  # far from 1, so a missing fold shows
    head = task.init()
    raw = mx.random.normal((1, 5, F), key=mx.random.key(3)) * mx.array(task.scale)
    task.save(head, tmp_path / "h", None)
    saved = load_eagle(tmp_path / "h", target=model)
    np.testing.assert_allclose(np.array(saved.fc(raw)), np.array(head.fc(raw / mx.array(task.scale))),
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(task.load(tmp_path / "h").fc.weight), np.array(head.fc.weight),
                               rtol=1e-5, atol=1e-7)
    batch = next(iter(task.batches(head, 0, 0)))
    (fed,) = task.inputs(batch, 0)
    np.testing.assert_allclose(
        np.array(fed.features) * task.scale, np.array(batch.features), rtol=1e-5, atol=1e-6
    )
