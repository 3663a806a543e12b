"""The self-distillation corpus: batched greedy answers and features equal one-at-a-time runs."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import byte_tokenizer, tiny_llama

from mlxspec.engine.generate import generate
from mlxspec.core.taps import HiddenTap, output_head
from mlxspec.train.corpus import build_corpus, default_aux_layers
from mlxspec.train.features import FeatureCache


def _prompts(tokenizer, texts):
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
            for t in texts]


def test_batched_corpus_equals_single_runs(tmp_path):
    model, tokenizer = tiny_llama(seed=3, num_layers=4, sharpen=4.0), byte_tokenizer()
    prompts = _prompts(tokenizer, ["hi", "a longer prompt here", "xyz", "what is up with padding?"])
    records = list(build_corpus(model, tokenizer, prompts, tmp_path, max_new_tokens=12, batch_size=3, topk=5))
    assert [r.done for r in records] == [3, 4]
    cache = FeatureCache(tmp_path)
    assert cache.num_chunks == 2 and cache.manifest["aux_layers"] == list(default_aux_layers(4))
    fresh = tiny_llama(seed=3, num_layers=4, sharpen=4.0)
    tap = HiddenTap(fresh, layers=default_aux_layers(4))
    head = output_head(fresh)
    seen = 0
    for c in range(cache.num_chunks):
        arrays = cache.load_chunk(c)
        offsets = arrays["offsets"]
        for e in range(len(offsets) - 1):
            lo, hi = offsets[e], offsets[e + 1]
            prompt = prompts[seen]
            seen += 1
            tokens, mask = arrays["tokens"][lo:hi], arrays["mask"][lo:hi]
            assert (
                list(tokens[: len(prompt)]) == prompt
                and not mask[: len(prompt)].any()
                and mask[len(prompt) :].all()
            )
            # the answer is what plain greedy decoding says, up to and including its end token
            reference = generate(fresh, tokenizer, prompt, drafter="none", max_tokens=12).tokens
            assert list(tokens[len(prompt):]) == reference[: hi - lo - len(prompt)]
            # features equal one unpadded forward over the whole example
            fresh.model(mx.array(tokens)[None])
            np.testing.assert_allclose(arrays["hidden"][lo:hi], np.array(tap.final[0]), atol=2e-2)
            for j, layer in enumerate(default_aux_layers(4)):
                np.testing.assert_allclose(
                    arrays["aux"][lo:hi, j], np.array(tap.layer_input(layer)[0]), atol=2e-2
                )
            logp = np.array(nn.log_softmax(head(tap.final[0]), axis=-1))
            rows = np.arange(len(prompt) - 1, hi - lo - 1)
            assert (arrays["greedy"][lo:hi][rows] == tokens[rows + 1]).all()
            assert (arrays["greedy"][lo:hi][: len(prompt) - 1] == -1).all()
            ids = arrays["topk_ids"][lo:hi][rows]
            np.testing.assert_allclose(arrays["topk_logprobs"][lo:hi][rows].astype(np.float32),
                                       np.take_along_axis(logp[rows], ids, axis=-1), atol=2e-2)
            assert (np.diff(arrays["topk_logprobs"][lo:hi][rows].astype(np.float32), axis=-1) <= 1e-3).all()
    assert seen == len(prompts)


def test_corpus_resumes_and_refuses_other_settings(tmp_path):
    model, tokenizer = tiny_llama(seed=1), byte_tokenizer()
    prompts = _prompts(tokenizer, ["one", "two", "three"])
    list(build_corpus(model, tokenizer, prompts[:2], tmp_path / "a", max_new_tokens=4, batch_size=1,
                      time_budget_s=0.0))
    assert FeatureCache(tmp_path / "a").num_chunks == 1  # the budget stopped it after one batch
    again = list(build_corpus(model, tokenizer, prompts[:2], tmp_path / "a", max_new_tokens=4, batch_size=1))
    assert [r.cached for r in again] == [True, False]
    with pytest.raises(ValueError, match="another model"):
        list(build_corpus(model, tokenizer, prompts, tmp_path / "a", max_new_tokens=4, batch_size=1))


def test_corpus_of_data_answers_holds_the_targets_features_and_labels(tmp_path):
    """--answers data: the target reads the given answers; features and top-k are its own on that text."""
    model, tokenizer = tiny_llama(seed=5, num_layers=4, sharpen=4.0), byte_tokenizer()
    prompts = _prompts(tokenizer, ["hi", "tell me more", "xyz"])
    answers = [list(tokenizer.encode(t)) for t in ("hello there", "no", "a much longer answer that gets cut")]
    records = list(build_corpus(model, tokenizer, prompts, tmp_path, answers=answers, max_new_tokens=10,
                                batch_size=2, topk=4))
    assert [r.done for r in records] == [2, 3]
    cache = FeatureCache(tmp_path)
    assert cache.manifest["source"] == "data" and cache.manifest["settings"]["answers"] == "data"
    tap, head = HiddenTap(model, layers=default_aux_layers(4)), output_head(model)
    e = 0
    for c in range(cache.num_chunks):
        arrays = cache.load_chunk(c)
        for lo, hi in zip(arrays["offsets"][:-1], arrays["offsets"][1:]):
            prompt, answer = prompts[e], answers[e][:10]
            e += 1
            tokens, mask = arrays["tokens"][lo:hi], arrays["mask"][lo:hi]
            assert list(tokens) == prompt + answer and mask.sum() == len(answer) and mask[len(prompt):].all()
            model.model(mx.array(tokens)[None])
            np.testing.assert_allclose(arrays["hidden"][lo:hi], np.array(tap.final[0]), atol=2e-2)
            np.testing.assert_allclose(
                arrays["aux"][lo:hi, 1], np.array(tap.layer_input(default_aux_layers(4)[1])[0]), atol=2e-2
            )
            logp = np.array(nn.log_softmax(head(tap.final[0]), axis=-1))
            rows = np.arange(len(prompt) - 1, hi - lo - 1)
            assert (arrays["greedy"][lo:hi][rows] == logp[rows].argmax(-1)).all()
            ids = arrays["topk_ids"][lo:hi][rows]
            assert (ids == np.argsort(-logp[rows], axis=-1)[:, :4]).all()
            np.testing.assert_allclose(arrays["topk_logprobs"][lo:hi][rows].astype(np.float32),
                                       np.take_along_axis(logp[rows], ids, axis=-1), atol=2e-2)
            assert (arrays["topk_logprobs"][lo:hi][: len(prompt) - 1] == -np.inf).all()
    assert e == 3
    # the same prompts with other answers are another corpus
    with pytest.raises(ValueError, match="another model"):
        list(build_corpus(model, tokenizer, prompts, tmp_path, answers=[[1], [2], [3]], max_new_tokens=10,
                          batch_size=2, topk=4))
    with pytest.raises(ValueError, match="one non-empty answer per prompt"):
        list(build_corpus(model, tokenizer, prompts, tmp_path / "b", answers=answers[:2]))


def test_topk_labels_are_the_largest_log_softmax_values_best_first():
    from mlxspec.train.corpus import _topk

    logits = mx.random.normal((6, 5000), key=mx.random.key(4)) * 4.0
    ids, logps = _topk(logits, 7)
    full = np.array(nn.log_softmax(logits, axis=-1))
    want = np.argsort(-full, axis=-1)[:, :7]
    np.testing.assert_array_equal(np.array(ids), want)
    np.testing.assert_allclose(np.array(logps), np.take_along_axis(full, want, axis=-1), rtol=1e-5, atol=1e-5)
