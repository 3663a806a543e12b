"""MTP layers in the DeepSeek-V3 layout against the most authoritative runnable forward there is.

DeepSeek's own inference code (deepseek-ai/DeepSeek-V3 ``inference/model.py``) has no MTP forward, so the
fixture (tests/reference/make_fixtures.py) follows vLLM's ``DeepSeekMultiTokenPredictorLayer.forward``
(SGLang's ``deepseek_nextn`` does the same) with transformers' own ``DeepseekV3DecoderLayer`` as the block,
on a tiny transformers ``DeepseekV3ForCausalLM`` (MLA attention, routed and shared experts) whose
checkpoint carries one MTP layer as DeepSeek publishes it (``model.layers.{N}.*`` beside the main
weights). mlxspec loads the target folder through mlx-lm and the MTP layer through ``load_mtp``, and
must give the reference's target logits, MTP logits at every position and the two-token chain.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxspec.drafters.mtp import MTPDrafter
from mlxspec.heads.mtp import load_mtp
from mlxspec.core.taps import output_head
from parity import FIXTURES, GREEDY, assert_close, features, reference, target


def test_parity_mtp_deepseek():
    ref = reference("mtp_deepseek")
    model = target("mtp_deepseek")
    prompt = ref["target_ids"].tolist()
    assert_close(np.array(model(mx.array([prompt]))[0]), ref["target_logits"], "DeepSeek-V3 target logits")
    stack = load_mtp(FIXTURES / "mtp_deepseek", model)
    assert stack.config.layout == "deepseek" and stack.config.num_modules == 1
    root = int(ref["root"])
    hidden = features(model, prompt)  # [L, H], the target's last hidden states after its final norm
    module = stack.first
    out = module(hidden[None], mx.array([prompt[1:] + [root]]), model.model.embed_tokens)
    assert_close(
        np.array(module.logits(out, output_head(model))[0]), ref["depth1_logits"], "MTP logits (depth 1)"
    )

    drafter = MTPDrafter(stack, model, depth=2)
    history = prompt + [root]
    drafter.prefill(history, hidden)
    calls, logits = [], module.logits
    module.logits = lambda out, lm_head: calls.append(logits(out, lm_head)) or calls[-1]
    draft = drafter.propose(history, 2, GREEDY)
    assert np.array(draft.tokens).tolist() == ref["drafts"].tolist(), (
        "the MTP chain differs from the reference"
    )
    assert_close(np.array(calls[1])[0], ref["depth2_logits"], "MTP logits at chain depth 2")


def test_parity_mtp_qwen():
    """The Qwen3.5 / Qwen3-Next layout (``mtp.*``) on a tiny transformers ``Qwen3NextForCausalLM`` (Gated
    DeltaNet and gated attention layers, zero-centred norms). Qwen ships no MTP forward; the reference is
    vLLM's ``Qwen3NextMultiTokenPredictor.forward`` with transformers' own decoder layer and norms. Such
    targets cannot be drafted for (their recurrent state does not rewind), so this checks the target and
    the module's logits only."""
    ref = reference("mtp_qwen")
    model = target("mtp_qwen")
    prompt = ref["target_ids"].tolist()
    assert_close(np.array(model(mx.array([prompt]))[0]), ref["target_logits"], "Qwen3-Next target logits")
    stack = load_mtp(FIXTURES / "mtp_qwen", model)
    assert stack.config.layout == "qwen"
    hidden = features(model, prompt)
    module = stack.first
    out = module(hidden[None], mx.array([prompt[1:] + [int(ref["root"])]]), model.model.embed_tokens)
    assert_close(np.array(module.logits(out, output_head(model))[0]), ref["depth1_logits"], "Qwen MTP logits")
