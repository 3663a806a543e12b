"""DSpark drafters against deepseek-ai/DeepSpec's own code (``deepspec/modeling/dspark/qwen3``,
``deepspec/eval/dspark``).

The fixture is DeepSpec's ``Qwen3DSparkModel`` for a tiny Hugging Face Qwen3 target (two layers, four
proposals a block, Markov rank 8, a confidence head that reads the Markov features), configured by
its ``build_draft_config`` and saved as its checkpoint manager saves it (``save_pretrained``: the DSpark
fields at the top of ``config.json``, and its own copies of the target's embedding and LM head). The
reference ran its evaluator's propose/update steps in its ``generate_decoding_sample`` loop, greedily,
and recorded each round's drafts and confidence logits and the output; mlxspec replays the rounds.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxspec.core.cache import speculative_cache
from mlxspec.drafters.dspark import DSparkDrafter
from mlxspec.heads.dspark import load_dspark
from mlxspec.core.taps import HiddenTap
from parity import FIXTURES, GREEDY, assert_close, greedy_round, reference, target


def test_parity_dspark():
    ref = reference("dspark")
    model = target("qwen3")
    net = load_dspark(FIXTURES / "dspark", model)
    drafter = DSparkDrafter(net, model)
    assert drafter.max_draft_tokens == int(ref["proposals"])
    prompt = reference("qwen3")["ids"].tolist()
    cache, tap = speculative_cache(model), HiddenTap(model, drafter.feature_layers)
    logits = model(mx.array([prompt]), cache=cache)[0]
    history = prompt + [int(mx.argmax(logits[-1]))]
    drafter.prefill(history, tap.features()[0])
    rounds = sorted(k for k in ref if k.startswith("drafts_"))
    for r in range(len(rounds)):
        draft = drafter.propose(history, drafter.max_draft_tokens, GREEDY)
        drafts = np.array(draft.tokens).tolist()
        assert drafts == ref[f"drafts_{r}"].tolist(), f"round {r}: drafts differ from DeepSpec's"
        # survival is the running product of the confidence head's sigmoid(logit)
        expected = np.cumprod(1 / (1 + np.exp(-ref[f"confidence_logits_{r}"].astype(np.float64))))
        assert_close(np.array(draft.survival), expected, f"round {r}: confidence")
        history = greedy_round(model, cache, drafter, tap, history, drafts)
    assert history[: len(ref["output_ids"])] == ref["output_ids"].tolist(), (
        "greedy output differs from DeepSpec's"
    )
