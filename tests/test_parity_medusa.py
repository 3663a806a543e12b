"""Medusa-1 heads against FasterDecoding/Medusa's own code (``medusa/model/medusa_model.py``, ``utils.py``).

The fixture's five heads are the reference's ``ResBlock`` + per-head LM head modules, saved both ways the
reference writes them: ``medusa_lm_head.pt`` (``torch.save`` of the state dict, what
``MedusaModel.from_pretrained`` reads; here through mlxspec's weights-only pickle reader) and
``medusa_lm_head.safetensors`` (``train_legacy.py``). Its ``config.json`` says 2 heads, as the published
``medusa-vicuna-7b-v1.3`` does while its file holds 5. The reference numbers: each head's logits on the
tiny llama's final hidden states, and the 63-node ``mc_sim_7b_63`` tree that ``generate_candidates``
fills at temperature 0 (``generate_medusa_buffers``' mask and positions).
"""

from __future__ import annotations

import numpy as np
import pytest

from mlxspec.drafters.medusa import MedusaDrafter
from mlxspec.heads.medusa import load_medusa
from mlxspec.core.taps import output_head
from parity import FIXTURES, GREEDY, ancestor_mask, assert_close, features, reference, target


@pytest.mark.parametrize("file", ["medusa_lm_head.pt", "medusa_lm_head.safetensors"])
def test_parity_medusa(file):
    ref = reference("medusa")
    model = target("llama")
    heads = load_medusa(FIXTURES / "medusa" / file, hidden_size=model.args.hidden_size,
                        vocab_size=model.args.vocab_size)
    assert heads.config.medusa_num_heads == 5  # counted from the tensors, not the config's 2
    prompt = reference("llama")["ids"].tolist()
    hidden = features(model, prompt)  # [L, H], after the final norm
    assert_close(
        np.array(heads(hidden, output_head(model))), ref["medusa_logits"], f"{file}: Medusa head logits"
    )

    root = int(ref["tree_tokens"][0])
    drafter = MedusaDrafter(heads, output_head(model))  # mc_sim_7b_63, as the reference
    history = prompt + [root]
    drafter.prefill(history, hidden)
    draft = drafter.propose(history, 5, GREEDY)
    assert [root] + np.array(draft.tokens).tolist() == ref["tree_tokens"].tolist(), (
        f"{file}: tree tokens differ"
    )
    np.testing.assert_array_equal(ancestor_mask(draft.tree.parents), ref["tree_mask"])
    np.testing.assert_array_equal(draft.tree.depths, ref["tree_positions"])
