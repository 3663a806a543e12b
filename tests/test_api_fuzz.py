"""Malformed input through the Python API (issue 46): each case is refused with a ``TypeError`` or
``ValueError`` whose message names the argument, or gives the correct output (checked against plain greedy
decoding) — never a crash, never garbage. Tiny random models only."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from conftest import tiny_llama
from mlxspec import PromptCache, SamplingParams, generate, load, make_drafter, stream_generate
from test_generate import plain_greedy

PROMPT = [5, 6, 7, 8]
NAN, INF = math.nan, math.inf


@pytest.fixture(scope="module")
def other():
    return tiny_llama(seed=9, num_layers=3)


# (label, keyword arguments of generate, the exception, what its message must name)
REFUSED = [
    ("bytes prompt", dict(prompt=b"hi"), TypeError, "prompt"),
    ("None prompt", dict(prompt=None), TypeError, "prompt"),
    ("float ids", dict(prompt=[1.5, 2.0]), TypeError, "prompt"),
    ("2-D ids", dict(prompt=np.array([[1, 2]])), TypeError, "prompt"),
    ("empty ids", dict(prompt=[]), ValueError, "prompt"),
    ("id past the vocabulary", dict(prompt=[10**7]), ValueError, "token id"),
    ("negative id", dict(prompt=[-1, 5]), ValueError, "token id"),
    ("max_tokens 0", dict(max_tokens=0), ValueError, "max_tokens"),
    ("max_tokens -1", dict(max_tokens=-1), ValueError, "max_tokens"),
    ("max_tokens True", dict(max_tokens=True), TypeError, "max_tokens"),
    ("max_tokens 2.0", dict(max_tokens=2.0), TypeError, "max_tokens"),
    ("max_tokens None", dict(max_tokens=None), TypeError, "max_tokens"),
    ("γ -1", dict(drafter="ngram", num_draft_tokens=-1), ValueError, "num_draft_tokens"),
    ("huge γ", dict(drafter="ngram", num_draft_tokens=10**9), ValueError, "num_draft_tokens"),
    ("γ 2.5", dict(drafter="ngram", num_draft_tokens=2.5), TypeError, "num_draft_tokens"),
    ("γ True", dict(drafter="ngram", num_draft_tokens=True), TypeError, "num_draft_tokens"),
    ("γ 'fast'", dict(drafter="ngram", num_draft_tokens="fast"), ValueError, "num_draft_tokens"),
    ("sampling dict", dict(sampling={"temp": 0.7}), TypeError, "sampling"),
    ("drafter 5", dict(drafter=5), TypeError, "drafter"),
    ("unknown drafter", dict(drafter="nonsense"), ValueError, "drafter"),
    ("drafter option out of range", dict(drafter="ngram:max=0"), ValueError, "max"),
    ("seed -1", dict(seed=-1), ValueError, "seed"),
    ("seed 2**64", dict(seed=2**64), ValueError, "seed"),
    ("seed 1.5", dict(seed=1.5), ValueError, "seed"),
    ("typical threshold 2", dict(sampling=SamplingParams(temp=0.7), typical=(2, 0.3)), ValueError, "typical"),
    ("typical text", dict(typical="x"), TypeError, "typical"),
    ("stop 5", dict(stop=5), TypeError, "stop"),
    ("stop ['']", dict(stop=[""]), ValueError, "stop"),
    ("stop [b'x']", dict(stop=[b"x"]), TypeError, "stop"),
    ("stop_tokens 5", dict(stop_tokens=5), TypeError, "stop_tokens"),
    ("stop_tokens ['a']", dict(stop_tokens=["a"]), TypeError, "stop_tokens"),
    ("prefill_step_size 0", dict(prefill_step_size=0), ValueError, "prefill_step_size"),
    ("prefill_step_size -1", dict(prefill_step_size=-1), ValueError, "prefill_step_size"),
    ("prefill_step_size 2.5", dict(prefill_step_size=2.5), TypeError, "prefill_step_size"),
    ("prompt_cache text", dict(prompt_cache="cache"), TypeError, "prompt_cache"),
    ("prompt_cache dict", dict(prompt_cache={}), TypeError, "prompt_cache"),
    ("prompt_cache of None", dict(prompt_cache=[None, None]), TypeError, "prompt_cache"),
]

SAMPLING = [  # SamplingParams(**kwargs) is refused at construction, naming the field
    ("temp -1", dict(temp=-1), "temp"),
    ("temp nan", dict(temp=NAN), "temp"),
    ("temp inf", dict(temp=INF), "temp"),
    ("temp '0.7'", dict(temp="0.7"), "temp"),
    ("top_p 2", dict(top_p=2), "top_p"),
    ("top_p 0", dict(top_p=0), "top_p"),
    ("top_p nan", dict(top_p=NAN), "top_p"),
    ("top_k -3", dict(top_k=-3), "top_k"),
    ("top_k 2.5", dict(top_k=2.5), "top_k"),
    ("top_k True", dict(top_k=True), "top_k"),
    ("min_p 1.5", dict(min_p=1.5), "min_p"),
    ("min_p -0.1", dict(min_p=-0.1), "min_p"),
    ("min_p nan", dict(min_p=NAN), "min_p"),
    ("repetition_penalty inf", dict(repetition_penalty=INF), "repetition_penalty"),
    ("repetition_penalty 0", dict(repetition_penalty=0), "repetition_penalty"),
    ("repetition_penalty nan", dict(repetition_penalty=NAN), "repetition_penalty"),
    ("repetition_penalty text", dict(repetition_penalty="2"), "repetition_penalty"),
    ("repetition_context_size 0", dict(repetition_context_size=0), "repetition_context_size"),
    ("repetition_context_size 2.5", dict(repetition_context_size=2.5), "repetition_context_size"),
    ("logits_processors 5", dict(logits_processors=5), "logits_processors"),
]


@pytest.mark.parametrize("label, kwargs, error, names", REFUSED, ids=[c[0] for c in REFUSED])
def test_malformed_generate_arguments_are_refused_naming_the_argument(
    target, tokenizer, label, kwargs, error, names
):
    kwargs = {"prompt": PROMPT, "max_tokens": 4, **kwargs}
    prompt = kwargs.pop("prompt")
    with pytest.raises(error, match=names):
        generate(target, tokenizer, prompt, **kwargs)
    with pytest.raises(error, match=names):  # the stream refuses before its first event
        next(stream_generate(target, tokenizer, prompt, **kwargs))


@pytest.mark.parametrize("label, kwargs, names", SAMPLING, ids=[c[0] for c in SAMPLING])
def test_absurd_sampling_values_are_refused_naming_the_field(label, kwargs, names):
    with pytest.raises((TypeError, ValueError), match=names):
        SamplingParams(**kwargs)


def test_a_cache_of_another_model_is_refused(target, tokenizer, other):
    for cache in (PromptCache(other), make_prompt_cache(other)):
        with pytest.raises(ValueError, match="prompt_cache"):
            generate(target, tokenizer, PROMPT, max_tokens=4, prompt_cache=cache)


def test_odd_but_meaningful_input_gives_the_correct_output(target, tokenizer):
    """Accepted cases are checked against plain greedy decoding: never garbage."""
    reference = plain_greedy(target, PROMPT, 6)
    same = dict(max_tokens=6, stop_tokens=set())
    assert generate(target, tokenizer, np.array(PROMPT, dtype=np.int64), **same).tokens == reference
    assert generate(target, tokenizer, mx.array(PROMPT), **same).tokens == reference
    assert generate(target, tokenizer, tuple(PROMPT), **same).tokens == reference
    assert (
        generate(target, tokenizer, PROMPT, drafter="ngram", num_draft_tokens=64, **same).tokens == reference
    )
    assert generate(target, tokenizer, PROMPT, prefill_step_size=1, **same).tokens == reference
    assert generate(target, tokenizer, PROMPT, stop=(), **same).tokens == reference
    assert generate(target, tokenizer, PROMPT, stop_tokens=[], max_tokens=6).tokens == reference
    assert generate(target, tokenizer, PROMPT, seed=2**64 - 1, **same).tokens == reference
    assert (
        generate(target, tokenizer, PROMPT, sampling=SamplingParams(temp=0.0, top_k=1), **same).tokens
        == reference
    )
    text = generate(target, tokenizer, PROMPT, **same).text
    first = text[:1]
    if first:
        assert (
            generate(target, tokenizer, PROMPT, stop=first, **same).text == ""
        )  # one stop string, not chars


@pytest.mark.parametrize(
    "spec, error, names",
    [
        (5, TypeError, "spec"),
        ("nonsense", ValueError, "drafter"),
        ("eagle:depth=0", ValueError, "depth"),
        ("ngram:min=5,max=2", ValueError, "min"),
    ],
)
def test_make_drafter_refuses_malformed_specs(target, tokenizer, spec, error, names):
    with pytest.raises(error, match=names):
        make_drafter(spec, target, tokenizer)


@pytest.mark.parametrize(
    "args, error, names",
    [
        ((5,), TypeError, "model"),
        (("",), ValueError, "model"),
        (("/no/such/model",), (ValueError, FileNotFoundError), "no/such"),
        (("default",), ValueError, "dtype"),
    ],
)
def test_load_refuses_malformed_specs(args, error, names):
    kwargs = {"dtype": "float8"} if args == ("default",) else {}
    with pytest.raises(error, match=names):
        load(*args, **kwargs)
