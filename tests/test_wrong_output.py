"""Silent wrong output refused (issue 46, item 1): a prompt cache made for another model, and a stop string
given as one ``str`` (which used to become one stop string per character)."""

from __future__ import annotations

import pytest
from mlx_lm.models.cache import make_prompt_cache

from conftest import tiny_llama
from mlxspec import PromptCache, generate
from mlxspec.core.stops import check_stops
from test_generate import plain_greedy


def test_a_prompt_cache_made_for_another_model_is_refused(target, tokenizer):
    """A 4-layer model's cache handed to a 2-layer target (or another model with as many layers) used to run:
    mlx-lm zips layers with caches, so the target ran only as many layers as the cache had, or attended to
    another model's keys, and answered garbage."""
    other = tiny_llama(seed=5, num_layers=4)
    foreign = PromptCache(other)
    with pytest.raises(ValueError, match="prompt_cache was made for another model"):
        generate(target, tokenizer, [5, 6, 7], max_tokens=4, prompt_cache=foreign)
    twin = tiny_llama(seed=7)
    same_shape = PromptCache(twin)  # another model, same layers: its keys are not the target's
    generate(twin, tokenizer, [5, 6, 7], max_tokens=4, prompt_cache=same_shape)
    with pytest.raises(ValueError, match="prompt_cache was made for another model"):
        generate(target, tokenizer, [5, 6, 7], max_tokens=4, prompt_cache=same_shape)


def test_a_cache_list_of_the_wrong_length_or_kind_is_refused(target, tokenizer):
    with pytest.raises(ValueError, match=r"prompt_cache has 4 layer caches but the target has 2 layers"):
        generate(target, tokenizer, [5, 6, 7], max_tokens=4,
                 prompt_cache=make_prompt_cache(tiny_llama(num_layers=4)))
    with pytest.raises(ValueError, match=r"prompt_cache has 1 layer caches but the target has 2 layers"):
        generate(target, tokenizer, [5, 6, 7], max_tokens=4, prompt_cache=make_prompt_cache(target)[:1])
    with pytest.raises(TypeError, match="prompt_cache"):
        generate(target, tokenizer, [5, 6, 7], max_tokens=4, prompt_cache=[None, None])
    ok = make_prompt_cache(target)  # its own empty list still works, and gives plain greedy's tokens
    assert (generate(target, tokenizer, [5, 6, 7], max_tokens=6, prompt_cache=ok).tokens
            == plain_greedy(target, [5, 6, 7], 6))


def test_a_prompt_cache_whose_layers_were_swapped_is_refused(target, tokenizer):
    cache = PromptCache(target)
    cache.layers[:] = make_prompt_cache(tiny_llama(num_layers=3))
    with pytest.raises(ValueError, match="3 layer caches but the target has 2 layers"):
        generate(target, tokenizer, [5, 6, 7], max_tokens=4, prompt_cache=cache)


def test_a_stop_string_given_as_one_str_is_one_stop_string(target, tokenizer):
    """``stop="colors"`` used to become six stop strings ('c', 'o', 'l', ...) and cut the
    answer at its first c."""
    assert check_stops("colors") == ("colors",)
    assert check_stops(["a", "bc"]) == ("a", "bc")
    assert check_stops(None) == ()
    assert check_stops({"b", "a"}) == ("a", "b")  # a set too, in a fixed order
    plain = generate(target, tokenizer, "Hello", max_tokens=24)
    char = next(c for c in plain.text[2:] if c.isprintable() and c not in plain.text[:2])
    word = plain.text[plain.text.index(char): plain.text.index(char) + 2]  # two characters from the output
    cut = generate(target, tokenizer, "Hello", max_tokens=24, stop=word)
    assert cut.text == plain.text[: plain.text.index(word)]
    absent = "\x00never-in-output"
    assert generate(target, tokenizer, "Hello", max_tokens=24, stop=absent).text == plain.text


@pytest.mark.parametrize("stop, kind", [(5, TypeError), (b"ab", TypeError),
                                        ({"a": 1}, TypeError), ([b"a"], TypeError),
                                        ([""], ValueError), ([None], TypeError), ("", ValueError)])
def test_odd_stop_values_are_refused_naming_stop(stop, kind):
    with pytest.raises(kind, match="stop"):
        check_stops(stop)


def test_the_chat_engine_takes_a_stop_str_as_one_stop_string():
    from app.engine import EngineConfig

    assert EngineConfig(stop="colors").stop == ("colors",)
    with pytest.raises(TypeError, match="stop"):
        EngineConfig(stop=5)
