"""Exact on every target cache: sliding-window targets (greedy identity over 4× the window, every
drafter), checked trims, prompt caches reused across requests, plain decoding on recurrent caches,
and stats that count what was emitted."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama, mamba
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from conftest import byte_tokenizer, tiny_llama
from mlxspec import generate
from mlxspec.core.cache import PromptCache, rewindable, speculative_cache, trim
from mlxspec.drafters import DRAFTERS, Draft, Drafter
from test_generate import plain_greedy
from test_registry import build, models_dir, shipped_assets  # noqa: F401 (fixtures: heads shipped for "tiny")

WINDOW = 8
PROMPT = list(range(30, 50))  # 20 tokens: the window wraps during the prefill


def sliding_llama(seed: int = 0) -> llama.Model:
    """A tiny llama whose first layer attends within a sliding window (mlx-lm's RotatingKVCache)."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=264, max_position_embeddings=4096,
        tie_word_embeddings=False, layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,
    )
    model = llama.Model(args)
    model.lm_head.weight = model.lm_head.weight * 4.0
    mx.eval(model.parameters())
    return model


class AlwaysWrong(Drafter):
    """Drafts tokens the target never picks first (its argmax plus one), so every round rejects."""

    name = "wrong"

    def __init__(self, model):
        self.model = model

    def propose(self, history, num_draft_tokens, sampling, plan=None):
        logits = self.model(mx.array(history)[None])[0, -1]
        return Draft.chain([(int(mx.argmax(logits)) + 1) % 264] * num_draft_tokens)


def test_sliding_window_target_with_an_always_wrong_drafter_is_greedy_identical():
    target = sliding_llama()
    assert any(type(c) is RotatingKVCache for c in make_prompt_cache(target))  # mlx-lm's own cache rotates
    result = generate(target, byte_tokenizer(), PROMPT, drafter=AlwaysWrong(target), num_draft_tokens=3,
                      max_tokens=4 * WINDOW, stop_tokens=set())
    assert result.tokens == plain_greedy(target, PROMPT, 4 * WINDOW)
    assert result.stats.drafted > 0 and result.stats.accepted == 0


@pytest.mark.parametrize("name", DRAFTERS)
def test_every_drafter_is_greedy_identical_on_a_sliding_window_target(name):
    target, tokenizer = sliding_llama(), byte_tokenizer()
    drafter = build(name, target, tokenizer, tiny_llama(seed=3), "tiny")
    result = generate(target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=4, max_tokens=4 * WINDOW,
                      stop_tokens=set())
    assert result.tokens == plain_greedy(target, PROMPT, 4 * WINDOW)


def test_sliding_window_draft_model_is_rewound_too():
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    drafter = build("draft", target, tokenizer, sliding_llama(seed=5), "tiny")
    result = generate(target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=4, max_tokens=40,
                      stop_tokens=set())
    assert result.tokens == plain_greedy(target, PROMPT, 40) and result.stats.drafted > 0


def test_caches_that_cannot_be_rewound_exactly_are_refused_or_fail_loudly():
    with pytest.raises(ValueError, match="keeps its first 4 tokens"):
        rewindable(RotatingKVCache(WINDOW, keep=4))
    assert type(speculative_cache(sliding_llama())[0]) is KVCache
    wrapped = make_prompt_cache(sliding_llama())
    sliding_llama()(mx.array(PROMPT)[None], cache=wrapped)  # 20 tokens into a window of 8: it wrapped
    with pytest.raises(RuntimeError, match="removed 0 of 3 rejected positions"):
        trim(wrapped, 3)


def tiny_mamba():
    mx.random.seed(0)
    args = mamba.ModelArgs(model_type="mamba", vocab_size=264, hidden_size=64,
                           intermediate_size=128, state_size=8,
                           num_hidden_layers=2, conv_kernel=4, use_bias=False,
                           use_conv_bias=True, time_step_rank=8)
    model = mamba.Model(args)
    mx.eval(model.parameters())
    return model


def test_plain_decoding_runs_on_a_recurrent_cache_and_drafting_is_refused():
    model, tokenizer = tiny_mamba(), byte_tokenizer()
    result = generate(model, tokenizer, PROMPT, drafter="none", max_tokens=12, stop_tokens=set())
    assert result.tokens == plain_greedy(model, PROMPT, 12)
    with pytest.raises(ValueError, match="cannot be rewound"):
        generate(model, tokenizer, PROMPT, drafter="ngram", max_tokens=4)


def test_checks_come_before_any_cost_measurement(monkeypatch):
    import mlxspec.pacing as gamma

    def no_measuring(*args, **kwargs):
        raise AssertionError("costs were measured before the checks")

    monkeypatch.setattr(gamma, "load_or_calibrate", no_measuring)
    with pytest.raises(ValueError, match="cannot be rewound"):
        generate(tiny_mamba(), byte_tokenizer(), PROMPT, drafter="ngram",
                 num_draft_tokens="auto", max_tokens=4)
    with pytest.raises(ValueError, match="context is 4096"):
        generate(tiny_llama(), byte_tokenizer(), list(range(4100)), drafter="ngram", num_draft_tokens="auto")


# --- prompt caches reused across requests ---------------------------------------------------------


@pytest.mark.parametrize("name", DRAFTERS)
def test_a_prompt_cache_is_reused_across_turns_exactly(name):
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    drafter = build(name, target, tokenizer, tiny_llama(seed=3), "tiny")
    store = PromptCache(target)
    first = generate(target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=3, max_tokens=12,
                     stop_tokens=set(), prompt_cache=store)
    assert store.tokens == PROMPT + first.tokens[:-1]
    turn = PROMPT + first.tokens + [61, 62, 63]  # the conversation so far and a follow-up
    assert store.reuse(turn, drafter.feature_layers if drafter.needs_hidden else None) == len(PROMPT) + 12 - 1
    second = generate(target, tokenizer, turn, drafter=drafter, num_draft_tokens=3, max_tokens=12,
                      stop_tokens=set(), prompt_cache=store)
    assert second.tokens == plain_greedy(target, turn, 12)
    other = [5, 6, 7, 8, 9]  # nothing in common: everything is trimmed and prefilled again
    third = generate(target, tokenizer, other, drafter=drafter, num_draft_tokens=3, max_tokens=8,
                     stop_tokens=set(), prompt_cache=store)
    assert third.tokens == plain_greedy(target, other, 8) and store.tokens == other + third.tokens[:-1]


OWN_CACHE = ("draft", "eagle", "mtp", "dflash", "dspark")  # drafters with a cache of their own


@pytest.mark.parametrize("name", DRAFTERS)
def test_each_chat_turn_prefills_only_its_new_tokens(name, monkeypatch):
    """Counted, not timed: the target's prefill, the draft model's own prefill and the EAGLE head's
    rows (and MTP's, DFlash's, DSpark's) each run only the tokens a turn adds to the conversation."""
    import sys

    engine, draft_module = sys.modules["mlxspec.engine.generate"], sys.modules["mlxspec.drafters.draft_model"]

    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    drafter = build(name, target, tokenizer, tiny_llama(seed=3), "tiny")
    counts = {"target": [], "draft model": []}
    for module, role in ((engine, "target"), (draft_module, "draft model")):
        def counting(model, cache, tokens, *args, _real=module.prefill, _role=role, **kwargs):
            counts[_role].append(len(tokens))
            return _real(model, cache, tokens, *args, **kwargs)
        monkeypatch.setattr(module, "prefill", counting)
    store, conversation, new_tokens = PromptCache(target), list(PROMPT), []
    for turn in range(3):
        before = len(store.tokens)
        result = generate(target, tokenizer, conversation, drafter=drafter, num_draft_tokens=3, max_tokens=10,
                          stop_tokens=set(), prompt_cache=store)
        assert result.tokens == plain_greedy(target, conversation, 10)
        new_tokens.append(len(conversation) - 1 - before)
        if turn and name in OWN_CACHE:  # the draft model's or the feature-reading drafter's own cache
            # plus at most the last round's tokens, whose features the head had not read yet
            assert drafter.prefilled <= new_tokens[-1] + 3 + 1 < len(conversation) // 2
        conversation = conversation + result.tokens + [61 + turn, 62, 63]  # the answer and a follow-up
    assert new_tokens[1] == new_tokens[2] == 3  # the last answer token and the follow-up, but the new root
    assert counts["target"] == new_tokens
    # the draft model reads the prompt once, then each turn's new tokens (+ the last round's)
    if name == "draft":
        assert counts["draft model"][0] == len(PROMPT) - 1
        assert all(n <= new + 3 + 1 for n, new in zip(counts["draft model"][1:], new_tokens[1:]))


def test_a_used_cache_list_is_refused():
    target, tokenizer = tiny_llama(seed=0), byte_tokenizer()
    cache = make_prompt_cache(target)
    generate(target, tokenizer, PROMPT, max_tokens=4, prompt_cache=cache)
    assert cache[0].offset == len(PROMPT) + 3
    with pytest.raises(ValueError, match="already holds tokens from an earlier request"):
        generate(target, tokenizer, PROMPT, max_tokens=4, prompt_cache=cache)


# --- stats count what was emitted -------------------------------------------------------------------


def test_a_stop_inside_accepted_drafts_counts_only_what_was_emitted():
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    reference = plain_greedy(target, PROMPT, 40)
    stop = reference[5]
    drafter = build("draft", target, tokenizer, target, "tiny")  # the target as its own draft: all accepted
    result = generate(target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=8, max_tokens=40,
                      stop_tokens={stop})
    s = result.stats
    assert result.tokens == reference[: reference.index(stop) + 1] and s.finish_reason == "stop"
    assert s.accepted <= s.generation_tokens and s.tau == s.generation_tokens / s.rounds


# --- stop strings ----------------------------------------------------------------------------------


def scripted(answer: str):
    from test_generate import ScriptedModel

    tokenizer = byte_tokenizer()
    prompt = tokenizer.encode("Q: ")
    script = prompt + tokenizer.encode(answer) + [tokenizer.eos_token_id]
    return tokenizer, prompt, ScriptedModel(script, 264), ScriptedModel(script, 264)


@pytest.mark.parametrize("gamma", [12, 1])
def test_stop_strings_end_the_output_exactly(gamma):
    """γ 12: "END" is completed inside one round of accepted drafts; γ 1: across rounds, and the held
    tail ("EN" of "ENjoy") is released once it cannot be a stop string any more."""
    from mlxspec import TokenEvent, stream_generate
    from mlxspec.drafters import DraftModelDrafter

    tokenizer, prompt, model, draft = scripted("ENjoy 42. END and then more text")
    store = PromptCache(model)
    drafter = DraftModelDrafter(draft, 264, len(tokenizer))  # the script itself: every draft is accepted
    events = list(stream_generate(model, tokenizer, prompt, drafter=drafter,
                                  num_draft_tokens=gamma, max_tokens=60,
                                  stop=["zzz", "END"], prompt_cache=store))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    stats = events[-1]
    assert "".join(e.text for e in tokens) == "ENjoy 42. " and stats.finish_reason == "stop"
    assert tokenizer.decode([e.token for e in tokens]) == "ENjoy 42. END"  # nothing generated after it
    assert store.tokens == prompt + [e.token for e in tokens][:-1]  # the cache holds exactly what was emitted
    assert not any("E" in e.text for e in tokens[6:])  # no part of the stop string was ever streamed
    if gamma == 12:
        assert tokens[-1].round == tokens[-3].round and stats.rounds == 1


def test_bad_stop_strings_are_refused(capsys, tiny_model_dir):
    from mlxspec.commands.cli import main

    tokenizer, prompt, model, _ = scripted("abc")
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        generate(model, tokenizer, prompt, stop=[""])
    with pytest.raises(SystemExit) as exit_:  # refused while parsing, before any model loads
        main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--stop", ""])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the stop text is empty" in err and "leave --stop out" in err


def test_the_chat_engine_refuses_drafting_on_a_recurrent_target_at_load_time(tmp_path):
    """Loaded as "Ready" with a drafter it could not use, every message failed; now it falls back."""
    import queue

    from conftest import save_tiny_model
    from mlxspec_app.engine import Engine, EngineConfig
    from mlxspec_app.messages import EngineReady, GenerationDone, GenerationFailed, LoadFailed

    folder = save_tiny_model(tmp_path / "mamba", tiny_mamba(), byte_tokenizer())
    posted: queue.Queue = queue.Queue()
    engine = Engine(EngineConfig(model=str(folder), drafter="ngram", max_tokens=6))
    engine.start(posted.put)
    messages = []
    while not any(isinstance(m, EngineReady) for m in messages):
        messages.append(posted.get(timeout=60))
    failed = [m for m in messages if isinstance(m, LoadFailed)]
    assert failed and "cannot be rewound" in failed[0].error and "none drafter in F2" in failed[0].error
    assert messages[-1].info.drafter == "none"
    engine.generate(1, [{"role": "user", "content": "hi"}])
    while not isinstance(message := posted.get(timeout=60), (GenerationDone, GenerationFailed)):
        pass
    engine.close()
    assert isinstance(message, GenerationDone) and message.stats.tokens == 6
