"""The shared training loop: a run killed mid-epoch and resumed ends bit for bit where an unbroken run
does."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import numpy as np
import pytest
from conftest import byte_tokenizer, tiny_llama
from test_train import alphabet_conversations, examples_of

from mlxspec.train import loop
from mlxspec.train.corpus import build_corpus
from mlxspec.train.draft import DraftTask
from mlxspec.train.draft_data import DraftTrainConfig
from mlxspec.train.features import FeatureCache, extract_features
from mlxspec.train.loop import EvalRecord, StepRecord, fit
from mlxspec.train.medusa import MedusaTask, MedusaTrainConfig

pytestmark = pytest.mark.slow  # training


class Killed(Exception):
    """Stands for the process dying (Ctrl-C, OOM killer, the machine going away)."""


def killed_at(task, global_step: int):
    """``task`` that dies as it reaches step ``global_step`` (0-based), before that step runs."""
    inputs = task.inputs

    def dying(batch, step):
        if step == global_step:
            raise Killed
        return inputs(batch, step)

    task.inputs = dying
    return task


def weights(folder, name):
    return {k: np.array(v) for k, v in mx.load(str(folder / name)).items()}


def assert_same_run(a, b, name):
    """Bit-identical weights and optimiser state, and the same per-epoch scores."""
    for file in (name, loop.OPTIMIZER):
        wa, wb = weights(a, file), weights(b, file)
        assert set(wa) == set(wb)
        for key in wa:
            assert np.array_equal(wa[key], wb[key]), f"{file}:{key} differs"
    sa, sb = (json.loads((f / loop.STATE).read_text()) for f in (a, b))
    drop = lambda h: {k: v for k, v in h.items() if k != "checkpoint"}  # noqa: E731
    assert [drop(h) for h in sa["history"]] == [drop(h) for h in sb["history"]]
    assert sa["global_step"] == sb["global_step"]


@pytest.fixture(scope="module")
def medusa(tmp_path_factory):
    model, tok = tiny_llama(seed=0), byte_tokenizer()
    root = tmp_path_factory.mktemp("features")
    list(extract_features(model, examples_of(tok, alphabet_conversations(40, seed=1)), root / "train",
                          chunk_tokens=600))
    list(extract_features(model, examples_of(tok, alphabet_conversations(6, seed=2)), root / "heldout"))
    return model, FeatureCache(root / "train"), FeatureCache(root / "heldout")


MEDUSA = MedusaTrainConfig(
    num_heads=2, epochs=2, batch_size=32, learning_rate=3e-3, warmup_steps=3, save_every=3, grad_clip=1.0
)


def test_medusa_killed_mid_epoch_resumes_to_the_same_weights(medusa, tmp_path):
    model, train, heldout = medusa
    per_epoch = train.steps_per_epoch(2, 32)
    assert per_epoch >= 8  # the kill below lands mid-epoch, after a save_every checkpoint
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    list(fit(MedusaTask(model, train, heldout, MEDUSA), whole, MEDUSA))
    with pytest.raises(Killed):
        list(fit(killed_at(MedusaTask(model, train, heldout, MEDUSA), per_epoch + 5), cut, MEDUSA))
    state = json.loads((cut / loop.STATE).read_text())
    assert (state["epoch"], state["step"]) == (1, 3)  # steps 4 and 5 of epoch 1 were lost with the process
    records = list(fit(MedusaTask(model, train, heldout, MEDUSA), cut, MEDUSA))
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert (steps[0].epoch, steps[0].step) == (1, 4) and len(steps) == per_epoch - 3
    assert [r.epoch for r in records if isinstance(r, EvalRecord)] == [2]
    assert_same_run(whole, cut, "medusa_lm_head.safetensors")


def test_a_kill_while_saving_keeps_the_previous_checkpoint(medusa, tmp_path, monkeypatch):
    model, train, _ = medusa
    config = MedusaTrainConfig(**{**vars(MEDUSA), "epochs": 1})
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    list(fit(MedusaTask(model, train, None, config), whole, config))
    task = MedusaTask(model, train, None, config)
    save, calls = task.save, []

    def dies_on_second_checkpoint(heads, folder, dtype):
        save(heads, folder, dtype)  # the weights are written, the optimizer and state are not
        calls.append(folder)
        if len(calls) == 2:
            raise Killed

    task.save = dies_on_second_checkpoint
    with pytest.raises(Killed):
        list(fit(task, cut, config))
    assert (cut / loop.PARTIAL).is_dir() and json.loads((cut / loop.STATE).read_text())["step"] == 3
    list(fit(MedusaTask(model, train, None, config), cut, config))
    assert not (cut / loop.PARTIAL).exists()
    assert_same_run(whole, cut, "medusa_lm_head.safetensors")
    # killed after the commit, while moving the files into place: the next start finishes the move
    publish = loop._publish

    def dies_before_moving(output):
        if (output / loop.READY).is_dir():
            raise Killed

    monkeypatch.setattr(loop, "_publish", dies_before_moving)
    again = tmp_path / "again"
    with pytest.raises(Killed):
        list(fit(MedusaTask(model, train, None, config), again, config))
    assert (again / loop.READY).is_dir() and not (again / loop.STATE).exists()
    monkeypatch.setattr(loop, "_publish", publish)
    steps = [
        r for r in fit(MedusaTask(model, train, None, config), again, config) if isinstance(r, StepRecord)
    ]
    assert steps[0].step == 4 and not (again / loop.READY).exists()
    assert_same_run(whole, again, "medusa_lm_head.safetensors")


def test_resume_refuses_other_settings_or_data(medusa, tmp_path):
    model, train, heldout = medusa
    config = MedusaTrainConfig(**{**vars(MEDUSA), "epochs": 1})
    list(fit(MedusaTask(model, train, None, config), tmp_path, config))
    with pytest.raises(ValueError, match="different seed"):
        next(
            fit(
                MedusaTask(model, train, None, config),
                tmp_path,
                MedusaTrainConfig(**{**vars(config), "seed": 1}),
            )
        )
    with pytest.raises(ValueError, match="different training data"):
        next(fit(MedusaTask(model, heldout, None, config), tmp_path, config))
    with pytest.raises(ValueError, match="already holds a training run"):
        next(fit(MedusaTask(model, train, None, config), tmp_path, config, resume=False))


def test_max_steps_ends_the_epoch_early_and_the_schedule_with_it(medusa, tmp_path):
    model, train, heldout = medusa
    config = MedusaTrainConfig(**{**vars(MEDUSA), "epochs": 3, "max_steps": 5})
    records = list(fit(MedusaTask(model, train, heldout, config), tmp_path, config))
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert len(steps) == 5 and {s.steps_per_epoch for s in steps} == {5}
    assert [r.epoch for r in records if isinstance(r, EvalRecord)] == [0, 1]  # scored and saved, then stop
    assert (tmp_path / "epoch-1").is_dir() and not (tmp_path / "epoch-2").exists()
    optimizer = mx.load(str(tmp_path / loop.OPTIMIZER))
    # the schedule spans the 5 steps: 3 of warm-up, the last one halfway down a 2-step cosine decay to 0
    # (a schedule over all 3 epochs would still be near its peak)
    assert optimizer["step"].item() == 5
    assert optimizer["learning_rate"].item() == pytest.approx(config.learning_rate / 2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    model, tok = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    rng = random.Random(0)
    words = ["apple", "river", "blue", "sky", "seven", "cloud"]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": " ".join(rng.sample(words, 3))}],
                                            add_generation_prompt=True)) for _ in range(24)]
    root = tmp_path_factory.mktemp("corpus")
    list(build_corpus(model, tok, prompts, root, max_new_tokens=16, batch_size=8, topk=8))
    return model, tok, FeatureCache(root)


def test_draft_killed_mid_epoch_resumes_to_the_same_weights(corpus, tmp_path):
    """Distillation with sampled negatives: the per-step randomness follows the global step."""
    model, tok, train = corpus
    config = DraftTrainConfig(layers=1, hidden=32, epochs=2, batch_tokens=160, warmup_steps=2, save_every=2,
                              heldout_examples=4, train_vocab=24, negatives=16, max_eval_positions=64)
    per_epoch = DraftTask(model, tok, train, None, config).steps_in_epoch(0)
    assert per_epoch >= 4
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    list(fit(DraftTask(model, tok, train, None, config), whole, config))
    with pytest.raises(Killed):
        list(fit(killed_at(DraftTask(model, tok, train, None, config), 3), cut, config))
    assert json.loads((cut / loop.STATE).read_text())["step"] == 2
    rest = [
        r for r in fit(DraftTask(model, tok, train, None, config), cut, config) if isinstance(r, StepRecord)
    ]
    assert (rest[0].epoch, rest[0].step) == (0, 3)
    assert_same_run(whole, cut, "model.safetensors")


def test_a_run_checkpointed_before_the_shared_loop_resumes(medusa, tmp_path):
    """trainer_state.json of the per-method trainers named the data ``features``/``corpus`` and had no loss
    sum."""
    model, train, _ = medusa
    config = MedusaTrainConfig(**{**vars(MEDUSA), "epochs": 1})
    list(fit(MedusaTask(model, train, None, config), tmp_path, config))
    state = json.loads((tmp_path / loop.STATE).read_text())
    state["features"] = state.pop("data")
    del state["loss_sum"], state["config"]["max_steps"], state["config"]["grad_clip"]
    (tmp_path / loop.STATE).write_text(json.dumps(state))
    more = MedusaTrainConfig(**{**vars(MEDUSA), "epochs": 2})
    records = list(fit(MedusaTask(model, train, None, more), tmp_path, more))
    assert records[0].epoch == 1 and isinstance(records[-1], EvalRecord) and records[-1].epoch == 2
    assert json.loads((tmp_path / loop.STATE).read_text())["data"] == str(train.directory.resolve())
