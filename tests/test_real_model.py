"""The real default model (SmolLM2-135M-Instruct GGUF): what a tiny random model cannot prove.

These load the model from the user cache (fetched once on first use) and run in CI
through the README's test command.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from mlxspec import generate, load, make_drafter

pytestmark = pytest.mark.real_model

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog near the river bank. Every morning, the farmer walks "
    "his two dogs along the winding path that leads to the old mill, where the water wheel still turns "
    "slowly in the current."
)


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


@pytest.fixture(scope="module")
def quantized():
    return load("default")


@pytest.fixture(scope="module")
def float32():
    return load("default", dtype="float32")


def mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    return [token for token, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


@pytest.mark.parametrize("which,n", [("float32", 64), ("quantized", 24)])
def test_plain_decoding_matches_mlx_lm_generate(request, which, n):
    model, tokenizer = request.getfixturevalue(which)
    prompt = chat(tokenizer, "Write a short poem about the sea.")
    ours = generate(model, tokenizer, prompt, drafter="none", max_tokens=n, stop_tokens=set()).tokens
    assert ours == mlx_lm_greedy(model, prompt, n)


def test_ngram_repeats_a_paragraph_losslessly_with_long_accepts(float32):
    model, tokenizer = float32
    prompt = chat(tokenizer, f"Repeat this paragraph exactly: {PARAGRAPH}")
    plain = generate(model, tokenizer, prompt, drafter="none", max_tokens=48)
    spec = generate(model, tokenizer, prompt, drafter="ngram", num_draft_tokens=6, max_tokens=48)
    assert spec.tokens == plain.tokens
    assert spec.stats.tau > 2.0


def test_quantized_draft_for_float32_target_is_greedy_exact(float32, quantized):
    (target, tokenizer), (draft_model, draft_tokenizer) = float32, quantized
    drafter = make_drafter("draft", target=target, tokenizer=tokenizer, draft_model=draft_model,
                           draft_tokenizer=draft_tokenizer)
    prompt = chat(tokenizer, "Name three colours of the rainbow.")
    plain = generate(target, tokenizer, prompt, drafter="none", max_tokens=40)
    spec = generate(target, tokenizer, prompt, drafter=drafter, num_draft_tokens=4, max_tokens=40)
    assert spec.tokens == plain.tokens
    assert spec.stats.alpha > 0.6  # the same weights, 4-bit: most drafts survive


def test_the_shipped_eagle_head_is_greedy_exact_and_accepts(float32):
    from mlxspec.loading.assets import shipped
    from mlxspec.drafters.eagle import EagleDrafter
    from mlxspec.heads.eagle import load_eagle

    model, tokenizer = float32
    head = load_eagle(shipped("eagle", "SmolLM2-135M-Instruct"), model)
    prompt = chat(tokenizer, "Explain in a few sentences why the sky is blue.")
    plain = generate(model, tokenizer, prompt, drafter="none", max_tokens=48, stop_tokens=set())
    taus = []
    for ngram in (None, 0):  # the shipped tree (chain + n-gram branch), then the head alone
        drafter = EagleDrafter(head, model, ngram=ngram)
        spec = generate(model, tokenizer, prompt, drafter=drafter,
                        num_draft_tokens=drafter.depth, max_tokens=48, stop_tokens=set())
        assert spec.tokens == plain.tokens
        taus.append(spec.stats.tau)
    # a head that did not fit the target (wrong layers, d2t read as absolute ids) accepts ~nothing: τ ≈ 1
    assert taus[1] > 1.1 and taus[0] >= taus[1], taus
