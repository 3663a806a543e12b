"""DFlash block drafters against z-lab/dflash's own code (``dflash/model.py``: ``DFlashDraftModel``,
``dflash_generate``).

The fixtures are z-lab's ``DFlashDraftModel`` (two Qwen3 layers, block size 4, mask token 250, target
layers [1, 5]) saved with ``save_pretrained`` in both config layouts mlxspec reads: ``dflash`` (what
transformers 4.x writes: ``block_size`` and ``rope_theta`` at the top, base 10000) and ``dflash_layout2``
(``block_size`` inside ``dflash_config``, ``rope_parameters.rope_theta`` 1e6, as later z-lab configs).
The reference ran ``dflash_generate`` greedily on the tiny llama for six rounds and recorded every
round's block logits [B, V] and the output; mlxspec replays the same rounds (drafter prefill, propose,
target verify, commit) and must give the same logits, drafts and output.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxspec.core.cache import speculative_cache
from mlxspec.drafters.dflash import DFlashDrafter
from mlxspec.heads.dflash import load_dflash
from mlxspec.core.taps import HiddenTap
from parity import FIXTURES, GREEDY, assert_close, greedy_round, reference, target


def replay_blocks(drafter, model, ref, name: str) -> None:
    """Greedy block rounds as the reference's loop runs them, comparing each round's block logits."""
    prompt = reference("llama")["ids"].tolist()
    calls, block_logits = [], drafter.block_logits

    def recording(anchor, position):
        out = block_logits(anchor, position)
        calls.append(out[1])
        return out

    drafter.block_logits = recording
    cache, tap = speculative_cache(model), HiddenTap(model, drafter.feature_layers)
    logits = model(mx.array([prompt]), cache=cache)[0]
    history = prompt + [int(mx.argmax(logits[-1]))]
    drafter.prefill(history, tap.features()[0])
    rounds = sorted(k for k in ref if k.startswith("block_logits_"))
    for r, key in enumerate(rounds):
        draft = drafter.propose(history, drafter.max_draft_tokens, GREEDY)
        assert_close(np.array(calls[r]), ref[key], f"{name}: block logits of round {r}")
        drafts = np.array(draft.tokens).tolist()
        assert drafts == np.argmax(ref[key][1:], axis=-1).tolist(), f"{name}: round {r} drafts differ"
        history = greedy_round(model, cache, drafter, tap, history, drafts)
    ref_out = ref["output_ids"].tolist()
    assert history[: len(ref_out)] == ref_out, f"{name}: greedy output differs from dflash_generate's"


@pytest.mark.parametrize("name", ["dflash", "dflash_layout2"])
def test_parity_dflash(name):
    ref = reference(name)
    model = target("llama")
    net = load_dflash(FIXTURES / name, model)
    assert net.config.block_size == 4 and net.config.mask_token_id == 250
    assert net.config.rope_theta == (10000.0 if name == "dflash" else 1e6)
    replay_blocks(DFlashDrafter(net, model), model, ref, name)
