"""A draft model drafting from a draft vocabulary (FR-Spec; mlxspec.drafters.vocab, docs/drafters.md "A draft
vocabulary")."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama

from conftest import byte_tokenizer, tiny_llama
from mlxspec.drafters import vocab
from mlxspec.pacing import drafter_fingerprint
from mlxspec.drafters import make_drafter
from mlxspec.drafters.draft_model import DraftModelDrafter, check_sliceable
from mlxspec.engine.generate import generate
from mlxspec.core.sampling import SamplingParams, warp
from mlxspec.core.taps import head_slice, model_body
from stats import chi_square
from test_lossless import PROMPT, V, exact_joint, sample_joint

#: Drafted from in the lossless tests: with PROMPT's 1, 2, 3 the draft vocabulary is {0, 1, 2, 3, 4, 6}.
FREQUENT = np.array([0, 4, 6], dtype=np.int32)


@pytest.fixture(scope="module")
def models():
    return tiny_llama(seed=0, vocab_size=V, sharpen=3.0), tiny_llama(seed=7, vocab_size=V, sharpen=3.0)


def test_drafts_come_from_the_frequent_ids_and_the_texts_own(models):
    target, draft = models
    drafter = DraftModelDrafter(draft, V, V, vocab_ids=FREQUENT)
    drafter.prefill(PROMPT)
    proposed = drafter.propose(PROMPT, 6, SamplingParams(temp=1.0))
    q = np.exp(np.array(proposed.logprobs))  # [6, V]
    np.testing.assert_allclose(q.sum(axis=-1), 1.0, rtol=1e-5)
    assert q[:, [5, 7]].max() == 0.0  # neither frequent nor in the prompt
    assert q[:, [1, 2, 3]].min() > 0.0  # the prompt's own tokens are drafted from too
    assert set(proposed.tokens.tolist()) <= {0, 1, 2, 3, 4, 6}
    assert drafter.draft_vocab == 3
    history = PROMPT + [5]  # a committed 5 joins for the next round, and leaves with the next prompt
    drafter.commit(len(history), [])
    again = np.exp(np.array(drafter.propose(history, 2, SamplingParams(temp=1.0)).logprobs))
    assert again[:, 5].min() > 0.0 and again[:, 7].max() == 0.0
    drafter.prefill(PROMPT)
    assert np.exp(np.array(drafter.propose(PROMPT, 2, SamplingParams(temp=1.0)).logprobs))[:, 5].max() == 0.0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temp=1.0),
        SamplingParams(temp=1.0, top_p=0.8),
        SamplingParams(temp=1.0, repetition_penalty=1.5),
    ],
    ids=["temp1", "top_p", "rep"],
)
@pytest.mark.slow  # statistical
def test_drafting_from_a_draft_vocabulary_follows_the_target(models, params):
    target, draft = models
    stat, critical = chi_square(
        sample_joint(target, DraftModelDrafter(draft, V, V, vocab_ids=FREQUENT), params),
        exact_joint(target, params),
    )
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


class WholeVocabularyQ(DraftModelDrafter):
    """Samples from the draft vocabulary but reports q over the whole vocabulary (the mistake to catch)."""

    def propose(self, history, num_draft_tokens, sampling, plan=None):
        proposed = super().propose(history, num_draft_tokens, sampling)
        context = history + proposed.tokens.tolist()[:-1]
        whole = self.model(mx.array(context)[None])[0, len(history) - 1 :]
        proposed.logprobs = warp(whole, sampling)
        return proposed


@pytest.mark.slow  # statistical
def test_the_same_test_rejects_q_that_ignores_the_draft_vocabulary(models):
    target, draft = models
    params = SamplingParams(temp=1.0)
    stat, critical = chi_square(
        sample_joint(target, WholeVocabularyQ(draft, V, V, vocab_ids=FREQUENT), params),
        exact_joint(target, params),
    )
    assert stat > critical


def test_greedy_output_is_the_targets_and_the_answers_tokens_join_the_vocabulary():
    target, tokenizer = tiny_llama(seed=0), byte_tokenizer()
    prompt = [40, 41, 42, 43]
    plain = generate(target, tokenizer, prompt, drafter="none", max_tokens=200, stop_tokens=set())
    answer = set(plain.tokens) - set(prompt)
    frequent = np.array(sorted(answer)[: len(answer) // 2], dtype=np.int32)  # half of what the answer needs
    # the target drafting for itself
    drafter = DraftModelDrafter(target, 264, len(tokenizer), vocab_ids=frequent)
    result = generate(target, tokenizer, prompt, drafter=drafter, num_draft_tokens=4, max_tokens=200,
                      stop_tokens=set())
    assert result.tokens == plain.tokens
    assert 0.5 < result.stats.alpha < 0.9  # misses where a token was neither frequent nor seen yet (16 such)
    seen = {t for t in set(prompt) | set(plain.tokens[:-8]) if t < len(tokenizer)}  # no padding id (259+)
    assert seen - set(frequent.tolist()) <= set(drafter._extra) < set(range(len(tokenizer)))


def test_the_draft_vocabulary_is_part_of_the_cost_fingerprint(models):
    target, draft = models
    whole = drafter_fingerprint(DraftModelDrafter(draft, V, V), target)
    reduced = drafter_fingerprint(DraftModelDrafter(draft, V, V, vocab_ids=FREQUENT), target)
    # describe() says it
    assert whole["settings"] != reduced["settings"] and "3" in reduced["settings"]["describe"]


def _tied(quantized: bool) -> nn.Module:
    mx.random.seed(2)
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=1,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=264,
            tie_word_embeddings=True,
        )
    )
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("kind", ["linear", "quantized linear", "tied", "quantized tied"])
def test_a_sliced_head_gives_the_heads_rows_and_keeps_quantized_weights_quantized(kind):
    if kind.endswith("tied"):
        model = _tied(kind.startswith("quantized"))
    else:
        model = tiny_llama(seed=1)
        if kind.startswith("quantized"):
            nn.quantize(model, group_size=32, bits=4)
    ids = mx.array([3, 17, 100, 263], dtype=mx.int32)
    x = mx.array([[5, 6, 7]])
    expected = model(x)[0][:, ids]
    got = head_slice(model, ids)(model_body(model)(x)[0])
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-4)
    check_sliceable(model, np.array(ids))  # passes


def test_a_model_whose_logits_are_not_its_head_is_refused():
    model = tiny_llama(seed=1)
    model.args.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"softcapping; pass --draft-vocab 0"):
        check_sliceable(model, np.arange(10))

    class Scaled(nn.Module):  # logits scaled after the head, with no config field saying so
        def __init__(self, inner):
            super().__init__()
            self.model, self.lm_head, self.args = inner.model, inner.lm_head, inner.args

        def __call__(self, x, cache=None):
            return 2.0 * self.lm_head(self.model(x, cache=cache))

    with pytest.raises(ValueError, match=r"not its LM head applied to its last hidden state"):
        check_sliceable(Scaled(tiny_llama(seed=1)), np.arange(10))


def test_ranking_counts_and_draft_ids_keep_real_ids_sorted():
    tokenizer = byte_tokenizer()
    texts = ["aaaa bb c", "bb a"]
    ranking = vocab.rank_tokens(tokenizer, texts, 264)
    a, b, space = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in ("a", "b", " "))
    assert ranking[:3].tolist() == [a, b, space] and len(ranking) == 4  # a ×5, b ×4, space ×3, c ×1
    assert vocab.draft_ids(ranking, 2, 264).tolist() == sorted([a, b])
    padded = vocab.draft_ids(ranking, 6, 259)  # two unseen ids join, in id order
    assert len(padded) == 6 and set(ranking.tolist()) < set(padded.tolist()) and padded.max() < 259


def test_the_ranking_is_counted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    from mlxspec.loading import data
    from mlxspec.loading.data import Conversation, Turn

    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path))
    calls = []

    def fake_sharegpt():
        calls.append(1)
        return [Conversation("x", (Turn("user", "zzzz"), Turn("assistant", "ab ab ab")))], None

    monkeypatch.setattr(data, "load_sharegpt", fake_sharegpt)
    tokenizer, notes = byte_tokenizer(), []
    first = vocab.sharegpt_ranking(tokenizer, 264, notes.append)
    again = vocab.sharegpt_ranking(tokenizer, 264)
    assert calls == [1] and len(notes) == 1 and first.tolist() == again.tolist()
    assert set(tokenizer.decode([int(i)]) for i in first) == {"a", "b", " "}  # the user's turn is not counted
    assert (tmp_path / "vocab" / f"{vocab.tokenizer_digest(tokenizer)}.safetensors").is_file()


def test_the_option_picks_the_vocabulary(tmp_path, monkeypatch):
    from mlxspec.drafters import draft_model

    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path))
    target, draft, tokenizer = tiny_llama(seed=0), tiny_llama(seed=3), byte_tokenizer()
    build = lambda spec: make_drafter(spec, target, tokenizer, draft_model=draft)  # noqa: E731
    assert build("draft").draft_vocab is None  # auto: 259 tokens are too few to reduce
    assert build("draft:vocab=0").draft_vocab is None
    with pytest.raises(ValueError, match=r"vocab must be >= 0, got -1"):
        build("draft:vocab=-1")
    with pytest.raises(
        ValueError, match=r"--draft-vocab 259 is not below the vocabulary's 259 tokens.*--draft-vocab 0"
    ):
        # the N most frequent of 259 tokens would be every token: said, not silently done
        build("draft:vocab=259")
    monkeypatch.setattr(draft_model, "MIN_AUTO_VOCAB", 200)
    monkeypatch.setattr(draft_model, "DEFAULT_DRAFT_VOCAB", 100)
    assert build("draft").draft_vocab is None  # auto: no ranking ships or is cached for this tokenizer
    ranking = np.arange(258, -1, -1, dtype=np.int32)  # highest id most frequent
    vocab.save_ranking(tmp_path / "vocab" / f"{vocab.tokenizer_digest(tokenizer)}.safetensors", ranking, {})
    auto = build("draft")
    assert auto.draft_vocab == 100 and np.array(auto._base_ids).tolist() == list(range(159, 259))
    assert build("draft:vocab=50").draft_vocab == 50
