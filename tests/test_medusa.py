"""Medusa heads: trees of rank paths, checkpoint layouts, and lossless generation."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import byte_tokenizer, tiny_llama
from mlxspec import SamplingParams, generate
from mlxspec.pacing import Costs, Fixed, make_pacer
from mlxspec.drafters.medusa import MedusaDrafter
from mlxspec.heads.medusa import MedusaConfig, MedusaHeads, load_medusa, save_medusa
from mlxspec.core.taps import output_head
from mlxspec.core.tree import MC_SIM_7B_63, read_tree, tree_from_choices
from stats import chi_square

PROMPT = [10, 20, 30, 40, 10, 20, 30, 41, 50, 60]


def random_heads(num_heads=4, hidden=64, vocab=264, shared=False, seed=0, scale=0.3) -> MedusaHeads:
    heads = MedusaHeads(MedusaConfig(num_heads, hidden, vocab, shared_lm_head=shared))
    mx.random.seed(seed)
    heads.update({"heads": [[{"linear": {"weight": scale * mx.random.normal((hidden, hidden)),
                                         "bias": scale * mx.random.normal((hidden,))}}]
                            + ([] if shared else [{"weight": mx.random.normal((vocab, hidden))}])
                            for _ in range(num_heads)]})
    mx.eval(heads.parameters())
    return heads


def test_mc_sim_tree_shape():
    tree, heads, ranks = tree_from_choices(MC_SIM_7B_63, max_depth=4)
    assert tree.size == 63 and int(tree.depths.max()) == 4
    assert (tree.children[0] > 0).sum() == 10  # ten top-k guesses of head 0 at the root
    assert heads.tolist() == [len(p) - 1 for p in sorted(map(tuple, MC_SIM_7B_63), key=lambda p: (len(p), p))]
    assert tree_from_choices(MC_SIM_7B_63, max_depth=2)[0].size == sum(len(p) <= 2 for p in MC_SIM_7B_63)
    with pytest.raises(ValueError, match="no parent"):
        tree_from_choices([[0], [1, 0]], max_depth=4)


def test_read_tree_presets_and_files(tmp_path):
    assert read_tree("small_15") == MC_SIM_7B_63[:15]
    (tmp_path / "t.json").write_text(json.dumps([[0], [0, 0], [1]]))
    assert read_tree(str(tmp_path / "t.json")) == [[0], [0, 0], [1]]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="rank paths"):
        read_tree(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="unknown Medusa tree"):
        read_tree("no-such-tree")


@pytest.mark.parametrize("tree", ["mc_sim_7b_63", pytest.param("small_15", marks=pytest.mark.slow),
                                  pytest.param("chain_4", marks=pytest.mark.slow)])  # the sweep is slow
def test_greedy_medusa_equals_plain_greedy_over_300_tokens(tree):
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    plain = generate(target, tokenizer, PROMPT, drafter="none", max_tokens=300, stop_tokens=set())
    drafter = MedusaDrafter(random_heads(shared=True), output_head(target), read_tree(tree))
    spec = generate(
        target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=4, max_tokens=300, stop_tokens=set()
    )
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > 0


def test_untrained_heads_predict_the_next_token_exactly_like_the_lm_head():
    """A zero-initialised block is the identity, so every head starts as the base LM head."""
    target = tiny_llama(seed=0)
    heads = MedusaHeads(MedusaConfig(3, 64, 264, shared_lm_head=True))
    hidden = mx.random.normal((5, 64))
    logits = heads(hidden, output_head(target))
    assert logits.shape == (3, 5, 264)
    assert mx.allclose(logits[2], output_head(target)(hidden)).item()


@pytest.mark.slow  # statistical
def test_medusa_sampling_follows_the_target():
    from test_lossless import exact_joint, sample_joint

    target = tiny_llama(seed=0, vocab_size=8, sharpen=3.0)
    drafter = MedusaDrafter(random_heads(num_heads=2, vocab=8, seed=2, scale=1.0), output_head(target),
                            [[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    params = SamplingParams(temp=1.0, top_p=0.9)
    stat, critical = chi_square(sample_joint(target, drafter, params), exact_joint(target, params))
    assert stat < critical


# --- checkpoint layouts ------------------------------------------------------------------------


def _weights(heads: MedusaHeads) -> dict:
    from mlx.utils import tree_flatten

    return {k.removeprefix("heads."): v for k, v in tree_flatten(heads.parameters())}


def _same(a: MedusaHeads, b: MedusaHeads) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(mx.array_equal(wa[k], wb[k]).item() for k in wa)


@pytest.mark.parametrize("shared", [False, True], ids=["original", "shared-head"])
def test_save_and_load_published_layout(tmp_path, shared):
    heads = random_heads(num_heads=5, shared=shared)
    save_medusa(tmp_path, heads)
    keys = mx.load(str(tmp_path / "medusa_lm_head.safetensors")).keys()
    assert "4.0.linear.weight" in keys and ("4.1.weight" in keys) != shared
    # published configs under-count heads: the tensors decide
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    loaded = load_medusa(tmp_path, hidden_size=64, vocab_size=264)
    assert loaded.config.medusa_num_heads == 5 and loaded.config.shared_lm_head == shared
    assert _same(heads, loaded)


def test_load_vllm_layout(tmp_path):
    heads = random_heads(num_heads=3)
    w = _weights(heads)
    vllm = {}
    for k in range(3):
        vllm[f"blocks.{k}.layers.0.weight"] = w[f"{k}.0.linear.weight"]
        vllm[f"blocks.{k}.layers.0.bias"] = w[f"{k}.0.linear.bias"]
        vllm[f"lm_heads.{k}.weight"] = w[f"{k}.1.weight"]
    mx.save_safetensors(str(tmp_path / "model.safetensors"), vllm)
    assert _same(heads, load_medusa(tmp_path, hidden_size=64, vocab_size=264))


@pytest.mark.parametrize("hidden,vocab,message", [(32, 264, "hidden size 64 but the target has 32"),
                                                   (64, 300, "vocabulary 264 but the target has 300")])
def test_heads_that_do_not_fit_the_target_are_refused(tmp_path, hidden, vocab, message):
    save_medusa(tmp_path, random_heads())
    with pytest.raises(ValueError, match=message):
        load_medusa(tmp_path, hidden_size=hidden, vocab_size=vocab)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="medusa_lm_head.safetensors"):
        load_medusa(tmp_path, hidden_size=64, vocab_size=264)
    with pytest.raises(ValueError, match="no Medusa head tensors"):
        mx.save_safetensors(str(tmp_path / "medusa_lm_head.safetensors"), {"x": mx.zeros(3)})
        load_medusa(tmp_path, hidden_size=64, vocab_size=264)


def test_typical_acceptance_picks_the_deepest_typical_path():
    from mlxspec.core.tree import Tree
    from mlxspec.core.verify import verify_typical

    tree = Tree((-1, -1, 0, 0, 1))  # root -> {1, 2}; 1 -> {3, 4}; 2 -> {5}
    probs = [
        [.1, .6, .3, 1e-4], [.05, .05, .1, .8], [.4, .4, .1, .1], [.25] * 4, [.9, .05, .03, .02], [.25] * 4
    ]
    logits = mx.log(mx.array(probs))
    tokens = mx.array([9, 1, 2, 3, 0, 1], dtype=mx.int32)
    # node 4 (p = .05 < min(.09, .3 e^-H)) fails; paths 1-3 and 2-5 are both depth 2; 1-3 has more log p
    choice, _ = verify_typical(tokens, tree, logits, 1.0, 0.09, 0.3)
    assert tree.walk(choice.tolist()) == [1, 3]
    choice, _ = verify_typical(tokens, tree, logits, 1.0, 0.7, 2.0)  # cutoff 0.7 at the root: 0.6 fails
    assert tree.walk(choice.tolist()) == []


def test_typical_mode_runs_end_to_end_and_is_refused_with_bad_values():
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    drafter = MedusaDrafter(random_heads(shared=True), output_head(target), read_tree("small_15"))
    result = generate(target, tokenizer, PROMPT, drafter=drafter, max_tokens=40, stop_tokens=set(),
                      sampling=SamplingParams(temp=0.7), seed=0, typical=(0.09, 0.3))
    assert len(result.tokens) == 40 and result.stats.rounds <= 40
    with pytest.raises(ValueError, match="typical acceptance"):
        generate(target, tokenizer, PROMPT, drafter=drafter, typical=(0.0, 0.3))


def test_torch_pickle_heads_load_through_the_weights_only_reader():
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "medusa_lm_head.pt"
    heads = load_medusa(fixture, hidden_size=8, vocab_size=16)
    assert heads.config.medusa_num_heads == 3 and not heads.config.shared_lm_head
    expected = mx.load(str(fixture.with_suffix(".npz")))
    assert mx.allclose(heads.heads[1][0].linear.weight, expected["1.0.linear.weight"]).item()
    with pytest.raises(ValueError, match="refusing to load"):
        load_medusa(fixture.with_name("evil.pt"), hidden_size=8, vocab_size=16)


def test_the_default_tree_is_priced_by_the_machine():
    from mlxspec.drafters import DrafterSpec

    assert (
        DrafterSpec("medusa").options.tree == "auto"
        and str(DrafterSpec.parse("medusa:tree=auto")) == "medusa"
    )


def test_tree_budget_may_choose_plain_decoding():
    from mlxspec.pacing import TreeBudget

    scores = np.log(np.array([0.9, 0.6, 0.3, 0.2]))
    steep = TreeBudget(Costs([0.1 * k for k in range(1, 17)]), allow_plain=True)  # k tokens cost k steps
    assert steep.choose(scores, draft_s=0.001) == 0 and steep.pending is None
    assert (
        TreeBudget(Costs([0.1 * k for k in range(1, 17)]), allow_plain=False).choose(scores, draft_s=0.001)
        == 1
    )
    flat = TreeBudget(Costs([0.1] * 16), allow_plain=True)  # width costs nothing
    assert flat.choose(scores, draft_s=0.001) == 4
    assert flat.choose(scores[:0], draft_s=0.001) == 0


@pytest.mark.parametrize("machine", ["flat", "steep"])
def test_priced_tree_is_lossless_and_sized_by_the_verify_cost(machine):
    """Where 64 tokens cost what one does, the priced tree keeps many nodes; where k tokens cost k
    steps, it rests 16 rounds, then probes with at least one node (the costs may have been measured under
    load: never dropped for the session); greedy output is plain greedy's."""
    costs = {"flat": Costs([0.01] * 16), "steep": Costs([0.01 * k for k in range(1, 17)])}[machine]
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    plain = generate(target, tokenizer, PROMPT, drafter="none", max_tokens=80, stop_tokens=set())
    drafter = MedusaDrafter(random_heads(shared=True), output_head(target), MC_SIM_7B_63, priced=True)
    assert not drafter.lazy and drafter.profile.budget
    sizes, propose = [], drafter.propose
    drafter.propose = lambda *a: sizes.append((d := propose(*a)).size) or d
    pacer = make_pacer(4, target, drafter, costs=costs, learn=False)  # the costs as given: no wall-clock here
    spec = generate(
        target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=pacer, max_tokens=80, stop_tokens=set()
    )
    assert spec.tokens == plain.tokens
    if machine == "flat":
        assert max(sizes) > 15 and spec.stats.drafted > 0
    else:  # a probe after 16 rounds (1 node), then 2 rounds priced plain and a rest of 32, ...
        assert pacer.priced_out and sizes[0] == 1 and 0 < spec.stats.drafted < 5


def test_tree_budget_knows_before_any_round_when_no_tree_can_pay():
    from mlxspec.pacing import TreeBudget

    steep = TreeBudget(Costs([0.1 * k for k in range(1, 17)]), allow_plain=True)  # k tokens cost k steps
    assert not steep.can_win(max_depth=4, draft_s=0.0)  # m nodes add at most m tokens for m more steps
    assert TreeBudget(Costs([0.1] * 16), allow_plain=True).can_win(max_depth=4, draft_s=0.05)
    two_rows = TreeBudget(Costs([0.1, 0.185] + [0.1 * k for k in range(3, 17)]), allow_plain=True)
    assert two_rows.can_win(max_depth=4, draft_s=0.0)  # 2 tokens in 1.85 steps
    assert not two_rows.can_win(max_depth=4, draft_s=0.1)  # ... unless the heads cost a step


def count_head_runs(drafter: MedusaDrafter) -> list:
    """Wrap the drafter's heads so that each run appends to the returned list."""
    calls, heads = [], drafter.heads

    class Counted:
        config = heads.config

        def __call__(self, *args):
            calls.append(1)
            return heads(*args)

    drafter.heads = Counted()
    return calls


@pytest.mark.parametrize("machine", ["flat", "steep"])
def test_a_tree_priced_as_plain_runs_no_heads(machine):
    """Where no tree can pay for its verify, the heads are not run for the first 16 rounds: plain steps."""
    costs = {"flat": Costs([0.01] * 16), "steep": Costs([0.01 * k for k in range(1, 17)])}[machine]
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    drafter = MedusaDrafter(random_heads(shared=True), output_head(target), MC_SIM_7B_63, priced=True)
    pacer = make_pacer(4, target, drafter, costs=costs, learn=False)
    assert pacer.priced_out == (machine == "steep")
    calls = count_head_runs(drafter)
    spec = generate(
        target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=pacer, max_tokens=16, stop_tokens=set()
    )
    assert (len(calls) == 0) == (machine == "steep") and (spec.stats.drafted == 0) == (machine == "steep")


def test_heads_rest_while_the_budget_keeps_pricing_rounds_as_plain():
    """A perfect tree could pay on this curve (so the heads are not ruled out at load), but these heads are
    never sure enough for any node to pay: after 2 rounds priced as plain the heads rest 16 rounds, then
    a probe verifies one node (the costs may be off, issue 50) and each probe that keeps nothing doubles the
    rest (a round with no tree then costs a plain step, not the heads too); a kept node resets it. The
    output stays plain greedy's."""
    # 2 tokens in 1.85 steps: only a sure node pays
    costs = Costs([0.1, 0.185] + [0.1 * k for k in range(3, 17)])
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    drafter = MedusaDrafter(
        random_heads(shared=True, scale=0.01), output_head(target), MC_SIM_7B_63, priced=True
    )
    pacer = make_pacer(4, target, drafter, costs=costs, learn=False)
    assert isinstance(pacer, Fixed) and not pacer.priced_out
    calls = count_head_runs(drafter)
    plain = generate(target, tokenizer, PROMPT, drafter="none", max_tokens=60, stop_tokens=set())
    spec = generate(
        target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=pacer, max_tokens=60, stop_tokens=set()
    )
    assert spec.tokens == plain.tokens and spec.stats.drafted == 2  # the two probes' one node each
    assert len(calls) == 4  # rounds 0, 1; the probe after a rest of 16 (round 18); after 32 more (round 51)
