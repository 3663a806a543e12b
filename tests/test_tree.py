"""Tree drafts: structure, tree attention on real mlx-lm architectures, compaction, and tree rules."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gemma, llama, qwen2
from mlx_lm.models.cache import make_prompt_cache

from conftest import byte_tokenizer, tiny_llama
from mlxspec import SamplingParams, generate
from mlxspec.core.cache import cache_length, commit_path, tree_attention
from mlxspec.drafters import Draft, Drafter
from mlxspec.core.tree import Tree
from mlxspec.core.verify import verify_deterministic, verify_greedy, verify_sampled
from stats import chi_square

#        root
#       /  |  \
#      0   1   2          (depth 1)
#     / \      |
#    3   4     5          (depth 2)
#    |
#    6                    (depth 3)
TREE = Tree((-1, -1, -1, 0, 0, 2, 3))


def test_structure():
    assert TREE.depths.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert TREE.children[0].tolist() == [1, 2, 3] and TREE.children[1].tolist() == [4, 5, -1]
    assert TREE.ancestor_mask[7].tolist() == [True, True, False, False, True, False, False, True]
    assert TREE.path_to(7) == [0, 3, 6]
    assert TREE.walk([1, 5, 0, 0, 0, 0, 0, 0]) == [1, 5]
    assert not TREE.is_chain and Tree((-1, 0, 1)).is_chain
    with pytest.raises(ValueError, match="parents must precede"):
        Tree((-1, 2, 0))


def _tiny(kind: str):
    mx.random.seed(0)
    common = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97)
    if kind == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", **common))
    elif kind == "qwen2":
        model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **common))
    else:
        model = gemma.Model(gemma.ModelArgs(model_type="gemma", head_dim=16, **common))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def _last_logits(model, tokens: list[int]) -> mx.array:
    return model(mx.array(tokens)[None], cache=make_prompt_cache(model))[0, -1]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma"])
def test_tree_logits_equal_each_path_run_as_a_sequence(kind):
    model = _tiny(kind)
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 97, size=13).tolist()
    nodes = rng.integers(0, 97, size=TREE.size + 1).tolist()  # root first
    cache = make_prompt_cache(model)
    model(mx.array(prefix[:-1])[None], cache=cache)
    nodes[0] = prefix[-1]
    with tree_attention(model, cache, TREE):
        tree_logits = model(mx.array(nodes)[None], cache=cache)[0]
    for node in range(TREE.size + 1):
        path = [nodes[i + 1] for i in TREE.path_to(node)]
        expected = _last_logits(model, prefix + path)
        assert mx.allclose(tree_logits[node], expected, atol=1e-4).item(), f"node {node}"
    assert "make_mask" not in vars(cache[0])  # the hooks are gone after the block

    # compaction to the path root -> 0 -> 3 -> 6 leaves the cache of prefix + that path
    commit_path(cache, len(prefix) - 1, [0, 1, 4, 7])
    assert cache_length(cache) == len(prefix) + 3
    path_tokens = [nodes[1], nodes[4], nodes[7]]
    after = model(mx.array([5])[None], cache=cache)[0, -1]
    assert mx.allclose(after, _last_logits(model, prefix + path_tokens + [5]), atol=1e-4).item()


# --- tree rules on hand-made distributions -------------------------------------------------

V = 6
RNG = np.random.default_rng(3)
P_ROOT, P_A = RNG.dirichlet(np.full(V, 0.8), size=2).astype(np.float32)
Q_ROOT, Q_A = RNG.dirichlet(np.full(V, 0.8), size=2).astype(np.float32)
# root with 3 children; its first child "a" has 2 children: parents in draft numbering
SMALL = Tree((-1, -1, -1, 0, 0))


def _p_rows():
    """Target p at each root-first node: root, a, b, c, a1, a2 (only root and a matter)."""
    other = np.full(V, 1.0 / V, dtype=np.float32)
    return mx.log(mx.array(np.stack([P_ROOT, P_A, other, other, other, other])))


def _without_replacement(rng, q, k):
    """k distinct draws from q, and the adjusted q_j each was drawn from."""
    q = q.astype(np.float64).copy()
    tokens, rows = [], []
    for _ in range(k):
        row = q / q.sum()
        tokens.append(int(rng.choice(V, p=row)))
        rows.append(row)
        q[tokens[-1]] = 0
    return tokens, rows


def _walk_counts(n_trials, mode, seed=0):
    """First emitted token, and the second given that child "a" was accepted."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    p_log = _p_rows()
    first, second = Counter(), Counter()
    for _ in range(n_trials):
        if mode == "deterministic":
            # top-k children, as EAGLE-2 and Medusa draft them
            root_kids, a_kids, q_log = np.argsort(-P_ROOT)[:3].tolist(), np.argsort(-P_A)[:2].tolist(), None
        else:
            root_kids, root_rows = _without_replacement(rng, Q_ROOT, 3)
            a_kids, a_rows = _without_replacement(rng, Q_A, 2)
            rows = root_rows + a_rows
            if mode == "raw-q":  # the mistake: q_j not renormalised after earlier siblings
                rows = [Q_ROOT] * 3 + [Q_A] * 2
            q_log = mx.log(mx.array(np.array(rows, dtype=np.float32)))
        tokens = mx.array([0] + root_kids + a_kids, dtype=mx.int32)
        if q_log is None:
            choice, next_tokens = verify_deterministic(tokens, SMALL, p_log)
        else:
            choice, next_tokens = verify_sampled(tokens, SMALL, q_log, p_log)
        path, emitted = SMALL.walk(choice.tolist()), tokens.tolist()
        out = [emitted[n] for n in path] + [next_tokens.tolist()[path[-1] if path else 0]]
        first[out[0]] += 1
        if path and path[0] == 1:
            second[out[1]] += 1
    return first, second


def _matches_p(first, second) -> bool:
    ok = [chi_square(counts, dict(enumerate(p.tolist()))) for counts, p in ((first, P_ROOT), (second, P_A))]
    return all(stat < critical for stat, critical in ok)


@pytest.mark.slow  # statistical
@pytest.mark.parametrize("mode", ["deterministic", "without-replacement"])
def test_tree_walk_emits_p(mode):
    assert _matches_p(*_walk_counts(5000, mode))


@pytest.mark.slow  # statistical
def test_raw_q_without_renormalisation_fails_the_same_test():
    assert not _matches_p(*_walk_counts(5000, "raw-q"))


def test_greedy_tree_follows_argmax():
    logits = mx.array(np.eye(V, dtype=np.float32)[[3, 2, 0, 0, 0, 0]])  # argmax: root 3, node a 2
    tokens = mx.array([0, 1, 3, 3, 2, 2], dtype=mx.int32)  # root kids 1, 3, 3; a's kids 2, 2
    choice, _ = verify_greedy(tokens, SMALL, logits)
    assert SMALL.walk(choice.tolist()) == [2]  # the first child equal to the argmax
    tokens = mx.array([0, 3, 1, 4, 5, 2], dtype=mx.int32)
    assert SMALL.walk(verify_greedy(tokens, SMALL, logits)[0].tolist()) == [1, 5]


# --- end to end with a tree drafter ----------------------------------------------------------


class RandomTreeDrafter(Drafter):
    """Deterministic top-k-like trees: at each level the first child is the oracle's greedy
    token (when known), the others are random, so both branches get exercised."""

    name = "random-tree"
    makes_trees = True

    def __init__(self, oracle: list[int], prompt_len: int, seed: int):
        self.oracle, self.prompt_len = oracle, prompt_len
        self.rng = np.random.default_rng(seed)

    def propose(self, history, num_draft_tokens, sampling, plan=None):
        if num_draft_tokens < 1:
            return Draft.empty()
        at = len(history) - self.prompt_len
        guess = self.oracle[at] if at < len(self.oracle) else int(self.rng.integers(0, 264))
        tokens = [guess, *self.rng.integers(0, 264, 2).tolist()]
        if num_draft_tokens == 1:
            return Draft(mx.array(tokens, dtype=mx.int32), Tree((-1, -1, -1)))
        tokens += [self.oracle[at + 1] if at + 1 < len(self.oracle) else 0, int(self.rng.integers(0, 264))]
        return Draft(mx.array(tokens, dtype=mx.int32), Tree((-1, -1, -1, 0, 0)))


PROMPT = [10, 20, 30, 40, 10, 20, 30]


def test_greedy_with_trees_equals_plain_greedy():
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    plain = generate(target, tokenizer, PROMPT, drafter="none", max_tokens=120, stop_tokens=set())
    spec = generate(target, tokenizer, PROMPT, drafter=RandomTreeDrafter(plain.tokens, len(PROMPT), 0),
                    num_draft_tokens=4, max_tokens=120, stop_tokens=set())
    assert spec.tokens == plain.tokens
    assert spec.stats.tau > 2.5  # the oracle branch is followed through the tree


@pytest.mark.slow  # statistical
def test_sampling_with_trees_follows_the_target():
    from test_lossless import exact_joint, sample_joint

    target = tiny_llama(seed=0, vocab_size=8, sharpen=3.0)
    drafter = RandomTreeDrafter([], 0, seed=1)
    drafter.propose = _small_vocab(drafter.propose)
    params = SamplingParams(temp=1.0)
    stat, critical = chi_square(sample_joint(target, drafter, params), exact_joint(target, params))
    assert stat < critical


def _small_vocab(propose):
    def wrapped(history, num_draft_tokens, sampling, plan=None):
        draft = propose(history, num_draft_tokens, sampling)
        return Draft(draft.tokens % 8, draft.tree) if draft.size else draft

    return wrapped
