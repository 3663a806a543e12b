"""The engine loop: greedy equivalence, self-drafting, stops, caches, streaming text, drafters."""

from __future__ import annotations

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from conftest import byte_tokenizer, tiny_llama
from mlxspec import PromptCache, SamplingParams, TokenEvent, generate, make_drafter, stream_generate
from mlxspec.drafters import check_same_tokenizer
from mlxspec.drafters import Plan
from mlxspec.pacing import Auto, Costs, make_pacer
from mlxspec.engine.generate import speculative_rounds

PROMPT = [10, 20, 30, 40, 10, 20, 30, 41, 50, 60]


def plain_greedy(model, prompt, n, processors=None) -> list[int]:
    """Reference: mlx-lm's own greedy decoding."""
    steps = generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=processors)
    return [token for token, _ in steps]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, sharpen=4.0)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def reference(target):
    return plain_greedy(target, PROMPT, 300)


def _draft(target, tokenizer, draft_model):
    return make_drafter("draft", target=target, tokenizer=tokenizer, draft_model=draft_model,
                        draft_tokenizer=tokenizer)


@pytest.mark.parametrize("kind", ["poor-draft", "ngram", "none"])
def test_greedy_equals_plain_greedy_over_300_tokens(target, tokenizer, reference, kind):
    drafter = {"poor-draft": lambda: _draft(target, tokenizer, tiny_llama(seed=3)),
               "ngram": lambda: make_drafter("ngram"), "none": lambda: make_drafter("none")}[kind]()
    result = generate(target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=5,
                      max_tokens=300, stop_tokens=set())
    assert result.tokens == reference
    if kind == "ngram":
        assert result.stats.accepted > 0 and result.stats.rounds < 300
    if kind == "poor-draft":
        assert result.stats.drafted > 0


def test_greedy_with_repetition_penalty_matches_mlx_lm(target, tokenizer):
    processors = make_logits_processors(repetition_penalty=1.3)
    expected = plain_greedy(target, PROMPT, 120, processors)
    for drafter in (_draft(target, tokenizer, tiny_llama(seed=3)), make_drafter("ngram")):
        result = generate(target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=4, max_tokens=120,
                          stop_tokens=set(), sampling=SamplingParams(repetition_penalty=1.3))
        assert result.tokens == expected


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_target_as_its_own_draft_accepts_everything(target, tokenizer, reference, gamma):
    n = 8 * (gamma + 1)
    events = list(stream_generate(target, tokenizer, PROMPT, drafter=_draft(target, tokenizer, target),
                                  num_draft_tokens=gamma, max_tokens=n, stop_tokens=set()))
    stats = events[-1]
    assert stats.alpha == 1.0 and stats.tau == gamma + 1 and stats.rounds == 8
    kinds = [e.kind for e in events if isinstance(e, TokenEvent)]
    assert kinds == (["accepted"] * gamma + ["bonus"]) * 8
    assert [e.token for e in events if isinstance(e, TokenEvent)] == reference[:n]


def test_the_draft_model_asks_before_each_further_token_and_stops_when_told(target, tokenizer):
    drafter = _draft(target, tokenizer, tiny_llama(seed=0, sharpen=1.5))
    drafter.prefill(PROMPT)
    # the survival it reports: its confidences multiplied
    whole = drafter.propose(PROMPT, 8, SamplingParams())
    survival = np.array(whole.survival)
    assert whole.size == 8 and 0 < survival[-1] < survival[0] < 1
    drafter.commit(len(PROMPT), [])
    # it stops after token k when the survival of the first k is at or below keep_above[k - 1]: here after 3
    keep_above = tuple(float(s) / 2 if k < 3 else 1.0 for k, s in enumerate(survival[:7], 1))
    draft = drafter.propose(PROMPT, 8, SamplingParams(), Plan(8, keep_above=keep_above))
    assert draft.size == 3 and np.allclose(np.array(draft.survival), survival[:3], rtol=1e-5)


@pytest.mark.parametrize("draft_kind", ["same-argmax", "confident-and-wrong"])
def test_auto_lets_the_draft_model_end_its_rounds_and_stays_greedy(target, tokenizer, reference, draft_kind):
    """γ auto with a draft model: each round drafts until the next token would not pay (``Plan.keep_above``);
    rounds of many lengths, kept whole or rejected early, leave the output plain greedy decoding's."""
    draft_model = (tiny_llama(seed=0, sharpen=8.0) if draft_kind == "same-argmax"
                   else tiny_llama(seed=3, sharpen=10.0))
    # another token pays while survival > 0.015
    cheap = Costs([1.0 + 0.005 * k for k in range(16)], draft_s=0.01)
    # as given
    policy = make_pacer("auto", target, _draft(target, tokenizer, draft_model), costs=cheap, learn=False)
    assert isinstance(policy, Auto) and policy.plan().keep_above is not None
    result = generate(target, tokenizer, PROMPT, drafter=_draft(target, tokenizer, draft_model),
                      num_draft_tokens=policy, max_tokens=120, stop_tokens=set())
    assert result.tokens == reference[:120]
    lengths = [g for g, n in enumerate(result.stats.gamma_rounds) if n and g > 0]  # drafted per round
    assert len(lengths) >= 3 and max(lengths) < 15, result.stats.gamma_rounds
    if draft_kind == "same-argmax":
        assert result.stats.accepted == result.stats.drafted > 0
    else:
        assert result.stats.accepted < result.stats.drafted


def _run(target, tokenizer, drafter, gamma, max_tokens, stop):
    cache = make_prompt_cache(target)
    result = generate(target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=gamma,
                      max_tokens=max_tokens, stop_tokens={stop}, prompt_cache=cache)
    return result, cache[0].offset


@pytest.mark.parametrize("draft_kind", ["self", "poor"])
def test_stops_end_output_where_plain_decoding_would(target, tokenizer, reference, draft_kind):
    draft_model = target if draft_kind == "self" else tiny_llama(seed=3)
    stops = sorted({reference[i] for i in (0, 3, 9, 17)})
    for stop, max_tokens, gamma in itertools.product(stops, (1, 5, 12, 30), (1, 4, 7)):
        first = reference.index(stop)
        expected = reference[: min(first + 1, max_tokens)]
        result, cache_length = _run(target, tokenizer, _draft(target, tokenizer, draft_model), gamma,
                                    max_tokens, stop)
        case = f"stop={stop} at {first}, max_tokens={max_tokens}, γ={gamma}"
        assert result.tokens == expected, case
        assert result.stats.finish_reason == ("stop" if first < max_tokens else "length"), case
        assert result.stats.generation_tokens == len(expected), case
        assert cache_length == len(PROMPT) + len(expected) - 1, case


def test_pipelined_plain_steps_stop_and_close_at_the_committed_length(target, tokenizer, reference):
    """Plain steps queue the next forward before reading a token; a stop, max_tokens or closing the
    generator must still leave the cache holding exactly the committed tokens but the last."""
    for stop, max_tokens in itertools.product(sorted({reference[i] for i in (0, 3, 9)}), (1, 5, 30)):
        expected = reference[: min(reference.index(stop) + 1, max_tokens)]
        result, cache_length = _run(target, tokenizer, make_drafter("none"), 0, max_tokens, stop)
        assert result.tokens == expected and cache_length == len(PROMPT) + len(expected) - 1
    store = PromptCache(target)
    events = stream_generate(target, tokenizer, PROMPT, drafter="none", max_tokens=50, stop_tokens=set(),
                             prompt_cache=store)
    tokens = [e.token for e in itertools.islice((e for e in events if isinstance(e, TokenEvent)), 7)]
    events.close()
    assert tokens == reference[:7]
    assert store.layers[0].offset == len(store.tokens) == len(PROMPT) + 7 - 1


def test_draft_cache_tracks_committed_tokens(target, tokenizer):
    drafter = _draft(target, tokenizer, tiny_llama(seed=3))
    history = list(PROMPT)
    for round_ in speculative_rounds(
        target, PROMPT, drafter, num_draft_tokens=4, max_tokens=60, sampling=SamplingParams(temp=1.0),
        stop_tokens=set(),
    ):
        history += round_.tokens
        assert drafter.cache[0].offset <= len(history) - 1
        rebuilt = make_prompt_cache(drafter.model)
        valid = drafter.cache[0].offset
        drafter.model(mx.array(history[:valid])[None], cache=rebuilt)
        k_cached = drafter.cache[0].keys[..., :valid, :]
        assert mx.allclose(k_cached, rebuilt[0].keys[..., :valid, :], atol=1e-5).item()


class ScriptedModel(nn.Module):
    """A model that always predicts the next token of a script (one-hot logits)."""

    def __init__(self, script: list[int], vocab_size: int):
        super().__init__()
        self.script, self.vocab_size = script, vocab_size
        self.layers = [nn.Identity()]

    def make_cache(self):
        return [KVCache()]

    def __call__(self, inputs, cache=None):
        T = inputs.shape[1]
        start = cache[0].offset
        cache[0].update_and_fetch(mx.zeros((1, 1, T, 1)), mx.zeros((1, 1, T, 1)))
        upcoming = [self.script[min(i + 1, len(self.script) - 1)] for i in range(start, start + T)]
        return (10 * mx.eye(self.vocab_size)[mx.array(upcoming)])[None]


def test_streamed_text_never_splits_a_character(tokenizer):
    text = "Ça coûte 5 €, 世界! 👋"
    prompt = tokenizer.encode("Q: ")
    answer = tokenizer.encode(text)
    model = ScriptedModel(prompt + answer + [tokenizer.eos_token_id], 264)
    for drafter in ("ngram", "none"):
        events = [e for e in stream_generate(model, tokenizer, prompt, drafter=drafter, max_tokens=100)
                  if isinstance(e, TokenEvent)]
        assert "".join(e.text for e in events) == text
        assert all("\ufffd" not in e.text for e in events)
        # the space waits for the next token (mlx-lm BPE detokenizer); 👋 is 4 bytes; then the EOS
        assert [e.text for e in events[-6:]] == ["", "", "", "", " 👋", ""]


def test_draft_model_never_proposes_padding_ids(target, tokenizer):
    draft_model = tiny_llama(seed=4, vocab_size=300)
    draft_model.lm_head.weight[len(tokenizer):] = 50.0  # padding rows would win every argmax
    drafter = _draft(target, tokenizer, draft_model)
    for params in (SamplingParams(), SamplingParams(temp=1.0)):
        drafter.prefill(PROMPT)
        draft = drafter.propose(PROMPT, 6, params)
        assert max(draft.tokens.tolist()) < len(tokenizer)
        if draft.logprobs is not None:
            assert draft.logprobs.shape == (6, 264)
            assert mx.all(mx.isinf(draft.logprobs[:, len(tokenizer):])).item()


def test_mismatched_tokenizer_is_refused(tokenizer):
    other = byte_tokenizer()
    other._tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    with pytest.raises(ValueError, match="tokenizer differs") as error:
        check_same_tokenizer(tokenizer, other)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("kwargs,message", [
    ({"num_draft_tokens": -1}, "num_draft_tokens must be from 0 to 64"),
    ({"num_draft_tokens": 65}, "num_draft_tokens must be from 0 to 64"),  # pacing.MAX_NUM_DRAFT_TOKENS
    ({"max_tokens": 0}, "max_tokens"),
    ({"drafter": "medusa-typo"}, "unknown drafter"),
])
def test_bad_arguments_are_clear_errors(target, tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(target, tokenizer, PROMPT, **kwargs)


@pytest.mark.parametrize("prompt,kwargs,error,message", [
    # was a crash
    ([10**7], {}, ValueError, r"token id 10000000 is outside the model's vocabulary \(ids 0 to 263\)"),
    ([-1, 5], {}, ValueError, "token id -1 is outside"),  # was read as the last row of the embedding
    (b"hi", {}, TypeError, "prompt must be text .* got bytes"),  # was read as the ids 104, 105
    (None, {}, TypeError, "prompt must be text .* got NoneType"),
    (PROMPT, {"num_draft_tokens": 3.5}, TypeError, "num_draft_tokens must be an integer"),
    (PROMPT, {"num_draft_tokens": True}, TypeError, "num_draft_tokens must be an integer"),
    (PROMPT, {"max_tokens": "8"}, TypeError, "max_tokens must be an integer"),
    (PROMPT, {"drafter": None}, TypeError, "drafter must be a Drafter"),
    (PROMPT, {"sampling": {"temp": 0.7}}, TypeError, "sampling must be a SamplingParams"),
    (PROMPT, {"prompt_cache": "x"}, TypeError, "prompt_cache must be a mlxspec.PromptCache"),
])
def test_arguments_of_the_wrong_kind_are_clear_errors(target, tokenizer, prompt, kwargs, error, message):
    with pytest.raises(error, match=message):
        generate(target, tokenizer, prompt, **kwargs)


def test_token_ids_may_come_as_integer_arrays(target, tokenizer):
    ids = [1, 2, 3]
    expected = generate(target, tokenizer, ids, max_tokens=4).tokens
    for prompt in (tuple(ids), np.array(ids), mx.array(ids)):
        assert generate(target, tokenizer, prompt, max_tokens=4).tokens == expected


def test_make_drafter_refuses_a_draft_model_it_would_ignore_and_a_spec_of_the_wrong_kind(target, tokenizer):
    with pytest.raises(ValueError,
                       match="draft_model is used by the draft drafter only, but the drafter is ngram"):
        make_drafter("ngram", target, tokenizer, draft_model=target)
    with pytest.raises(TypeError, match="spec must be a drafter spec string"):
        make_drafter(5, target, tokenizer)


@pytest.mark.parametrize("kwargs,message", [
    ({"temp": -0.5}, "temp must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.0}, "min_p"),
])
def test_bad_sampling_parameters_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_longer_than_the_context_is_refused(target, tokenizer):
    with pytest.raises(ValueError, match="context is 4096"):
        generate(target, tokenizer, [1] * 5000)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5])
def test_bad_seeds_are_clear_errors(target, tokenizer, seed):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
        generate(target, tokenizer, PROMPT, seed=seed)
