"""EAGLE-1/2 and EAGLE-3 heads against SafeAILab/EAGLE's own code (``eagle/model/cnets1.py``, ``cnets.py``).

The fixtures (tests/reference/make_fixtures.py) are heads built with the reference ``Model`` classes and
saved as its checkpoints are published (``pytorch_model.bin`` + ``config.json``), and the numbers the
reference computes from a tiny Hugging Face llama target: the draft logits over the prompt, and the
EAGLE-2 tree its ``topK_genrate`` builds (top-k 4, EAGLE depth 3 = mlxspec depth 4, 16 tokens) with the
draft logits of every expansion step. mlxspec must give the same logits (float32, 1e-4 relative), the
same tree node for node (tokens, ancestor masks, positions) and the same path scores.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxspec.drafters.eagle import EagleDrafter
from mlxspec.heads.eagle import load_eagle
from mlxspec.core.taps import output_head
from parity import FIXTURES, GREEDY, ancestor_mask, assert_close, features, match_rows, reference, target


def _record_logits(head) -> list:
    calls, logits = [], head.logits

    def recording(hidden, lm_head=None):
        out = logits(hidden, lm_head)
        calls.append(out)
        return out

    head.logits = recording
    return calls


def _check(name: str, layers_of=None):
    ref = reference(name)
    model = target("llama")
    head = load_eagle(FIXTURES / name, model)
    prompt = reference("llama")["ids"].tolist()
    root = int(ref["root"])
    assert root == int(np.argmax(np.array(model(mx.array([prompt]))[0, -1]))), (
        "the target's greedy root differs"
    )
    layers = head.config.resolved_aux_layers(len(model.model.layers)) if head.config.version == 3 else ()
    hidden = features(model, prompt, layers)
    # the draft over the prompt: feature j with token j + 1 (docs/heads.md 4.1)
    out = head(hidden[None], mx.array([prompt[1:] + [root]]), model.model.embed_tokens)
    assert_close(
        head.logits(out, output_head(model))[0], ref["seq_logits"], f"{name} draft logits over the prompt"
    )

    drafter = EagleDrafter(head, model, depth=int(ref["depth"]) + 1, top_k=int(ref["top_k"]),
                           total_tokens=int(ref["total_tokens"]))
    history = prompt + [root]
    drafter.prefill(history, hidden)
    calls = _record_logits(head)
    draft = drafter.propose(history, int(ref["depth"]) + 1, GREEDY)
    tokens = [root] + np.array(draft.tokens).tolist()
    assert tokens == ref["tree_tokens"].tolist(), f"{name}: the tree's tokens differ from EAGLE's"
    np.testing.assert_array_equal(
        ancestor_mask(draft.tree.parents), ref["tree_mask"], f"{name}: tree shape differs"
    )
    np.testing.assert_array_equal(draft.tree.depths, ref["tree_positions"])
    steps = sorted(k for k in ref if k.startswith("draft_logits_"))
    assert len(calls) == len(steps), f"{name}: {len(calls)} draft steps, EAGLE ran {len(steps)}"
    for d, key in enumerate(steps):
        match_rows(
            np.array(calls[d]).reshape(ref[key].shape), ref[key], f"{name} draft logits at depth {d + 1}"
        )
    return head


def test_parity_eagle3_reduced_vocab():
    """EAGLE-3 with a 64-token draft vocabulary (``d2t`` offsets, ``t2d`` mask): features are the inputs
    of layers 2, N/2, N − 3; the draft's RoPE base is 10000 (the target's is 50000)."""
    head = _check("eagle3")
    assert head.config.reduced_vocab and head.config.rope_theta == 10000.0


def test_parity_eagle3_full_vocab():
    """EAGLE-3 whose draft vocabulary is the target's (no ``d2t``/``t2d`` in the file, as EaModel drops
    them)."""
    head = _check("eagle3_full_vocab")
    assert not head.config.reduced_vocab


def test_parity_eagle1():
    """EAGLE-1/2 (``fc`` with bias over [embedding, feature], no input norm, the target's LM head)."""
    head = _check("eagle1")
    assert head.config.version == 1 and head.config.bias


def test_parity_speculators_eagle3():
    """The speculators / vLLM EAGLE-3 layout, against vllm-project/speculators' own ``Eagle3DraftModel``
    (0.9.0, transformers 5): ``layers.0.*`` for the midlayer, the layer's config nested in
    ``transformer_layer_config`` (RoPE base 70000 in ``rope_parameters``),
    ``eagle_aux_hidden_state_layer_ids`` counting layer outputs, saved with its ``save_pretrained``. The
    reference is its forward's draft logits over the prompt (one training-time-test step)."""
    ref = reference("speculators_eagle3")
    model = target("llama")
    head = load_eagle(FIXTURES / "speculators_eagle3", model)
    assert head.config.version == 3 and head.config.reduced_vocab
    N = len(model.model.layers)
    layers = head.config.resolved_aux_layers(N)
    assert list(layers) == [i + 1 for i in ref["aux_layer_outputs"].tolist()]
    prompt = reference("llama")["ids"].tolist()
    hidden = features(model, prompt, layers)
    out = head(hidden[None], mx.array([prompt[1:] + [int(ref["root"])]]), model.model.embed_tokens)
    assert_close(head.logits(out)[0], ref["seq_logits"], "speculators EAGLE-3 draft logits over the prompt")
