"""Draft-model distillation: sizing, the SVD embedding projection, KL training, the output folder, the CLI."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from conftest import byte_tokenizer, tiny_llama
from mlx_lm.models import llama
from test_cli import run as run_generate

from mlxspec.commands.train import main as train_main
from mlxspec.drafters import make_drafter
from mlxspec.engine.generate import generate
from mlxspec.loading.identity import write_card
from mlxspec.core.sampling import SamplingParams
from mlxspec.train.corpus import build_corpus
from mlxspec.train.draft import draft_model_config, init_draft, project_embeddings, train_draft
from mlxspec.train.draft_data import DraftTrainConfig, training_vocab
from mlxspec.train.loop import EvalRecord, StepRecord
from mlxspec.train.features import FeatureCache

pytestmark = pytest.mark.slow  # training

WORDS = ["apple", "river", "blue", "sky", "seven", "cloud", "stone", "fast", "green", "moon", "why", "how"]
SMALL = DraftTrainConfig(layers=1, hidden=32, epochs=4, batch_tokens=256, learning_rate=3e-3, warmup_steps=5,
                         max_eval_positions=512)


def _prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(tokenizer.apply_chat_template(
        [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 6)))}],
        add_generation_prompt=True)) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny():
    """The target of ``tiny_model_dir`` (sharpened random llama), its tokenizer, and a corpus of its own
    greedy answers: ``train`` (48 prompts) and ``validation`` (16 other prompts)."""
    return tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()


@pytest.fixture(scope="module")
def corpus(tiny, tmp_path_factory):
    model, tokenizer = tiny
    root = tmp_path_factory.mktemp("corpus")
    for name, n, seed in (("train", 48, 0), ("validation", 16, 1)):
        for _ in build_corpus(model, tokenizer, _prompts(tokenizer, n, seed), root / name, max_new_tokens=32,
                              batch_size=16, topk=8):
            pass
    return root


def test_draft_config_keeps_the_family_and_sizes_it():
    smollm2 = llama.ModelArgs(
        model_type="llama",
        hidden_size=576,
        num_hidden_layers=30,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        vocab_size=49152,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        layer_types=["full_attention"] * 30,
    )
    config = draft_model_config(SimpleNamespace(args=smollm2), DraftTrainConfig(layers=4, hidden=256))
    assert (config["model_type"], config["vocab_size"], config["rope_theta"]) == ("llama", 49152, 100000.0)
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (4, 256, 64)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]) == (
        4,
        1,
        704,
    )
    assert config["layer_types"] == ["full_attention"] * 4 and config["tie_word_embeddings"] is True
    with pytest.raises(ValueError, match="multiple of kv-heads"):
        draft_model_config(
            SimpleNamespace(args=smollm2), DraftTrainConfig(layers=2, hidden=256, heads=4, kv_heads=3)
        )


def test_embedding_projection_keeps_a_low_rank_embedding_exactly():
    rng = np.random.default_rng(0)
    embeddings = rng.normal(size=(300, 5)) @ rng.normal(size=(5, 48))  # rank 5, D = 48
    projected = project_embeddings(embeddings, 8)
    assert projected.shape == (300, 8) and projected.dtype == np.float32
    # the top-8 right singular vectors span the row space: inner products (hence logits) are kept
    np.testing.assert_allclose(projected @ projected.T, embeddings @ embeddings.T, rtol=1e-3, atol=1e-2)
    assert project_embeddings(embeddings, 48).shape == (300, 48)


def test_init_copies_or_projects_the_target_embeddings(tiny):
    target, _ = tiny
    same, _ = init_draft(target, DraftTrainConfig(layers=1, hidden=64))
    np.testing.assert_array_equal(
        np.array(same.model.embed_tokens.weight), np.array(target.model.embed_tokens.weight)
    )
    small, config = init_draft(target, DraftTrainConfig(layers=1, hidden=16))
    assert small.model.embed_tokens.weight.shape == (264, 16) and config["hidden_size"] == 16


def _alpha(target, tokenizer, draft, temp: float) -> float:
    """Realised α of speculative decoding with ``draft`` over fixed prompts and seeds (~800 drafts)."""
    accepted = drafted = 0
    for i, prompt in enumerate(_prompts(tokenizer, 12, seed=7)):
        drafter = make_drafter("draft", target=target, tokenizer=tokenizer, draft_model=draft)
        stats = generate(target, tokenizer, prompt, drafter=drafter, num_draft_tokens=3, max_tokens=40,
                         sampling=SamplingParams(temp=temp), seed=i).stats
        accepted += stats.accepted
        drafted += stats.drafted
    return accepted / drafted


def test_distillation_lowers_heldout_kl_and_beats_an_untrained_draft(tiny, corpus, tmp_path):
    target, tokenizer = tiny
    records = list(
        train_draft(
            target,
            tokenizer,
            FeatureCache(corpus / "train"),
            FeatureCache(corpus / "validation"),
            tmp_path / "run",
            SMALL,
        )
    )
    evals = [r for r in records if isinstance(r, EvalRecord)]
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert [e.epoch for e in evals] == [0, 1, 2, 3, 4]
    assert len(steps) == sum({s.epoch: s.steps_per_epoch for s in steps}.values())
    assert [s.step for s in steps if s.epoch == 0] == list(range(1, steps[0].steps_per_epoch + 1))
    kls = [e.kl for e in evals]
    assert kls[-1] < 0.6 * kls[0] and all(b < a for a, b in zip(kls, kls[1:3]))
    assert evals[-1].alpha > evals[0].alpha + 0.15 and evals[-1].top1 > evals[0].top1
    answer_tokens = FeatureCache(corpus / "validation").manifest["masked_tokens"]
    assert 0 <= evals[-1].alpha <= 1 and evals[-1].positions == answer_tokens < SMALL.max_eval_positions
    # α realised by speculative decoding under the target: trained vs untrained draft of the same size
    untrained, _ = init_draft(target, SMALL)
    trained, _ = mlx_lm.load(str(tmp_path / "run" / "epoch-4"))
    # (greedy contexts are the corpus's; sampled ones at temperature 1 drift away from it, so the gap is
    # smaller)
    assert _alpha(target, tokenizer, trained, 0.0) > _alpha(target, tokenizer, untrained, 0.0) + 0.1
    assert _alpha(target, tokenizer, trained, 1.0) > _alpha(target, tokenizer, untrained, 1.0) + 0.04


def test_a_training_vocabulary_still_distils(tiny, corpus, tmp_path):
    target, tokenizer = tiny
    train = FeatureCache(corpus / "train")
    keep = training_vocab(train, 40, 264)
    assert keep.shape == (40,) and (np.diff(keep) > 0).all()
    config = DraftTrainConfig(**{**vars(SMALL), "train_vocab": 40, "negatives": 48, "epochs": 3})
    evals = [
        r
        for r in train_draft(target, tokenizer, train, FeatureCache(corpus / "validation"), tmp_path, config)
        if isinstance(r, EvalRecord)
    ]
    # scored on the full vocabulary
    assert evals[-1].kl < 0.7 * evals[0].kl and evals[-1].alpha > evals[0].alpha + 0.2


def test_resume_continues_and_refuses_other_settings(tiny, corpus, tmp_path):
    target, tokenizer = tiny
    train = FeatureCache(corpus / "train")
    config = DraftTrainConfig(layers=1, hidden=32, epochs=1, batch_tokens=512, max_eval_positions=128)
    first = list(train_draft(target, tokenizer, train, None, tmp_path, config))
    assert isinstance(first[0], EvalRecord) and first[0].epoch == 0  # held out from the end of the corpus
    more = list(
        train_draft(
            target, tokenizer, train, None, tmp_path, DraftTrainConfig(**{**vars(config), "epochs": 2})
        )
    )
    assert isinstance(more[0], StepRecord) and more[0].epoch == 1 and more[-1].epoch == 2
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert [h["epoch"] for h in state["history"]] == [0, 1, 2]
    with pytest.raises(ValueError, match="different hidden"):
        list(
            train_draft(
                target, tokenizer, train, None, tmp_path, DraftTrainConfig(**{**vars(config), "hidden": 48})
            )
        )
    with pytest.raises(ValueError, match="already holds a training run"):
        list(train_draft(target, tokenizer, train, None, tmp_path, config, resume=False))


def test_cli_output_is_an_mlx_lm_folder_for_both_generators(
    capsys, corpus, tmp_path, tiny_model_dir, monkeypatch
):
    out = tmp_path / "draft"
    code = train_main(["draft", "--model", str(tiny_model_dir), "--corpus", str(corpus), "--output", str(out),
                       "--layers", "1", "--hidden", "32", "--epochs", "1", "--batch-tokens", "512"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert (
        "held-out KL" in captured.out
        and "expected α" in captured.out
        and "decode step, float32" in captured.err
    )
    folder = out / "epoch-1"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["eos_token_id"] == 256 and config["tie_word_embeddings"]
    assert json.loads((out / "run.json").read_text())["history"][-1]["checkpoint"] == str(folder)
    # mlx-lm opens it: same tokenizer, float16 weights, and its own speculative decoding accepts it
    draft, draft_tokenizer = mlx_lm.load(str(folder))
    target, tokenizer = mlx_lm.load(str(tiny_model_dir))
    assert draft_tokenizer.get_vocab() == tokenizer.get_vocab() and draft_tokenizer.eos_token_ids == {256}
    assert draft.model.embed_tokens.weight.dtype == mx.float16
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "blue sky"}], add_generation_prompt=True
    )
    plain = mlx_lm.generate(target, tokenizer, prompt, max_tokens=16)
    assert (
        mlx_lm.generate(target, tokenizer, prompt, max_tokens=16, draft_model=draft, num_draft_tokens=3)
        == plain
    )
    # mlxspec generate --draft-model: lossless at temperature 0
    base = ["--model", str(tiny_model_dir), "--prompt", "blue sky", "--max-tokens", "16", "--json"]
    code, stdout, _ = run_generate(capsys, *base, "--draft-model", str(folder), "--num-draft-tokens", "3")
    assert code == 0 and json.loads(stdout)["drafter"] == "draft"
    assert (
        json.loads(stdout)["text"] == json.loads(run_generate(capsys, *base, "--drafter", "none")[1])["text"]
    )
    # --drafter draft without --draft-model takes the draft shipped under models/draft/<target name>/
    code, _, err = run_generate(capsys, *base, "--drafter", "draft")
    assert code == 2 and "needs a draft model" in err and f"none ships for {tiny_model_dir.name}" in err
    monkeypatch.setenv("MLXSPEC_MODELS", str(tmp_path / "models"))
    (tmp_path / "models" / "draft").mkdir(parents=True)
    folder.rename(tmp_path / "models" / "draft" / tiny_model_dir.name)
    code, stdout, err = run_generate(capsys, *base, "--drafter", "draft", "--num-draft-tokens", "3")
    assert code == 0, err
    assert json.loads(stdout)["drafter"] == "draft" and json.loads(stdout)["draft_model"].startswith(
        tiny_model_dir.name
    )
    # make_drafter("draft") in Python takes the shipped draft whose card matches the target, and only that one
    shipped = tmp_path / "models" / "draft" / tiny_model_dir.name
    with pytest.raises(ValueError, match="needs a draft model.*none ships for this model"):
        make_drafter("draft", target, tokenizer)  # no card: never matched by name alone
    write_card(shipped, target, tiny_model_dir.name)
    drafter = make_drafter("draft", target, tokenizer)
    assert mx.array_equal(
        drafter.model.model.embed_tokens.weight, mlx_lm.load(str(shipped))[0].model.embed_tokens.weight
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "blue sky"}], add_generation_prompt=True
    )
    drafted = generate(target, tokenizer, prompt, drafter=drafter, num_draft_tokens=3, max_tokens=16)
    assert drafted.stats.drafted > 0
    assert drafted.tokens == generate(target, tokenizer, prompt, drafter="none", max_tokens=16).tokens


def test_cli_errors_are_one_line(capsys, tmp_path):
    assert train_main(["draft", "--corpus", str(tmp_path / "nothing"), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlxspec: error: no corpus in") and err.count("\n") == 1
    assert (
        train_main(["draft", "--corpus", str(tmp_path), "--output", str(tmp_path / "o"), "--hidden", "0"])
        == 2
    )
    assert "hidden must be >= 1" in capsys.readouterr().err
