"""The suffix drafter: frequency-scored trees, the process-wide store shared across calls, its
eviction bound, the per-request opt-out, a corpus, and cost-based sizing. Greedy identity and
losslessness run for it in ``test_registry`` like for every registered drafter."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import byte_tokenizer, tiny_llama
from mlxspec import generate, make_drafter
from mlxspec.pacing import Costs, make_pacer
from mlxspec.drafters import DrafterSpec, parse_specs
from mlxspec.drafters.suffix import SuffixDrafter, continuation_tree, longest_match
from mlxspec.drafters.suffix_store import StoreStats, SuffixStore, global_store_stats
from mlxspec.core.sampling import SamplingParams
from test_generate import plain_greedy

STORE = np.array([1, 2, 3, 4, -1, 1, 2, 3, 5, -1, 1, 2, 6], dtype=np.int32)


def test_longest_match_finds_every_occurrence_of_the_longest_suffix():
    length, ends = longest_match(STORE, np.array([8, 1, 2], dtype=np.int32))
    assert length == 2 and ends.tolist() == [1, 6, 11]
    length, ends = longest_match(STORE, np.array([2, 3], dtype=np.int32))
    assert length == 2 and ends.tolist() == [2, 7]
    assert longest_match(STORE, np.array([7], dtype=np.int32))[0] == 0
    assert longest_match(STORE, np.array([6], dtype=np.int32))[0] == 0  # its only occurrence ends the store


def test_continuation_tree_scores_paths_by_frequency_best_first():
    _, ends = longest_match(STORE, np.array([8, 1, 2], dtype=np.int32))
    tree = continuation_tree(STORE, ends, 2, depth=4, min_prob=0.0)
    # continuations [3, 4], [3, 5], [6]: "3" follows 2 of 3 occurrences, the rest 1 of 3 each
    assert tree.tokens == [3, 6, 4, 5] and tree.parents == [-1, -1, 0, 0]
    assert np.allclose(tree.scores, [2 / 3, 1 / 3, 1 / 3, 1 / 3]) and tree.match_length == 2
    assert continuation_tree(STORE, ends, 2, depth=4, min_prob=0.5).tokens == [3]
    assert continuation_tree(STORE, ends, 2, depth=1, min_prob=0.0).tokens == [3, 6]  # depth bounds the path
    assert continuation_tree(STORE, ends, 2, depth=4, min_prob=0.0, max_nodes=2).tokens == [3, 6]


def test_the_drafter_proposes_a_tree_sized_by_the_match():
    history = [9, 9, 1, 2, 3, 4, 0, 1, 2, 3, 5, 0, 1, 2, 6, 0, 7, 1, 2]
    drafter = SuffixDrafter(None, depth=4, nodes=16, factor=2.0, min_prob=0.0)
    draft = drafter.propose(history, 4, SamplingParams())
    # "1 2" (match length 2) was followed by 3 4 0 1, 3 5 0 1 and 6 0 7 1; factor 2 keeps 4 nodes
    assert draft.logprobs is None and draft.tree.parents == (-1, -1, 0, 0)
    assert draft.tokens.tolist() == [3, 6, 4, 5]
    narrow = SuffixDrafter(None, depth=4, factor=0.5, min_prob=0.0).propose(history, 4, SamplingParams())
    assert narrow.tokens.tolist() == [3]  # ceil(0.5 * match length 2) = 1 node
    assert SuffixDrafter(None).propose(history, 0, SamplingParams()).size == 0


def test_the_store_evicts_its_oldest_documents_beyond_its_bound():
    store = SuffixStore(max_tokens=100)
    for i in range(5):
        store.add([i] * 30)
    stats = store.stats()
    assert stats.tokens == 90 and stats.documents == 3 and stats.evicted_documents == 2
    assert set(store.searchable().tolist()) == {2, 3, 4, -1}  # documents 0 and 1 are gone
    assert 0 < stats.bytes <= 8 * 100
    owner = SuffixDrafter(store)
    owner.prefill([7] * 10)
    store.append(owner.document, [8] * 500)  # an open document stops growing at the bound
    assert store.stats().tokens == 100 and store.stats().documents == 1
    store.resize(40)  # the bound holds even against the one open document
    assert store.stats() == StoreStats(0, 0, 40, 0, 6)
    owner.propose([7] * 10 + [8] * 20, 4, SamplingParams())
    assert store.stats().tokens == 0
    with pytest.raises(ValueError, match="--suffix-store-tokens must be >= 1"):
        store.resize(0)


PROMPT = [10, 20, 30, 40, 50, 60, 70, 80]


def test_a_repeated_request_drafts_most_of_its_answer_from_the_global_store():
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    run = dict(num_draft_tokens=8, max_tokens=48, stop_tokens=set())
    spec = "suffix:min_prob=0.0"
    first = generate(target, tokenizer, PROMPT,
                     drafter=make_drafter(spec, target, tokenizer, target_name="share"), **run)
    second = generate(target, tokenizer, PROMPT,
                      drafter=make_drafter(spec, target, tokenizer, target_name="share"), **run)
    alone = generate(target, tokenizer, PROMPT, **run,
                     drafter=make_drafter(spec + ",shared=false", target, tokenizer, target_name="share"))
    assert first.tokens == second.tokens == alone.tokens == plain_greedy(target, PROMPT, 48)
    assert second.stats.accepted >= 0.8 * len(second.tokens), second.stats
    assert second.stats.accepted > first.stats.accepted + 10 and second.stats.rounds < first.stats.rounds
    # the opt-out sees this request only, like the first call
    assert alone.stats.accepted == first.stats.accepted
    stats = global_store_stats()[(264, "share")]
    assert stats.documents == 2 and stats.tokens >= 2 * 48  # the opted-out request left nothing behind


def test_a_corpus_is_drafted_from_and_read_once(tmp_path):
    target, tokenizer = tiny_llama(seed=0), byte_tokenizer()
    text = "def area(radius):\n    return 3.14159 * radius ** 2\n"
    (tmp_path / "geometry.py").write_text(text)
    (tmp_path / ".hidden").write_text("not read")
    spec = f"suffix:corpus={tmp_path},min_prob=0.0,factor=4"
    drafter = make_drafter(spec, target, tokenizer, target_name="corpus")
    history = tokenizer.encode("print(area(r)) # def area(radius):\n    return", add_special_tokens=False)
    draft = drafter.propose(history, 8, SamplingParams())
    assert tokenizer.decode(draft.tokens.tolist()) == " 3.14159"
    before = global_store_stats()[(264, "corpus")].tokens
    make_drafter(spec, target, tokenizer, target_name="corpus")
    assert global_store_stats()[(264, "corpus")].tokens == before == len(tokenizer.encode(text))
    with pytest.raises(ValueError, match="does not exist"):
        make_drafter(f"suffix:corpus={tmp_path / 'nope'}", target, tokenizer)


def test_auto_nodes_follow_the_plans_budget():
    """``nodes="auto"``: each round's tree is cut to the plan's node budget, priced on
    the measured verify cost."""
    flat = Costs([0.1] * 16)  # verifying more costs nothing: keep every candidate
    steep = Costs([0.1 * k for k in range(1, 17)])  # each token costs a step: no tree can beat a plain step
    history = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3, 4, 5, 6]
    drafter = SuffixDrafter(None, nodes="auto", min_prob=0.0)
    assert drafter.profile.budget and make_pacer(8, None, drafter, costs=steep).priced_out
    plan = make_pacer(8, None, drafter, costs=flat).plan()
    assert drafter.propose(history, 8, SamplingParams(), plan).size == 12
    # 12 = ceil(factor 2 x match length 6): the match still caps the tree
    assert drafter.propose(history, 8, SamplingParams()).size == 12  # no plan: the drafter's own cap


def test_options_are_validated_and_named_by_key():
    assert str(DrafterSpec.parse("suffix:depth=4,shared=false")) == "suffix:depth=4,shared=False"
    for text, message in [("suffix:depth=0", "'suffix:depth=0': depth must be >= 1"),
                          ("suffix:nodes=0", ": nodes"), ("suffix:factor=0", ": factor must be > 0"),
                          ("suffix:min_prob=1", r": min_prob must be in \[0, 1\)"),
                          ("suffix:shared=maybe", ": shared takes true or false"),
                          ("suffix:corpus=x,shared=no", ": corpus goes into the shared store"),
                          ("suffix:nodes=many", ": nodes: expected an integer or 'auto'")]:
        with pytest.raises(ValueError, match=message):
            parse_specs(text)


def reference_searchable(store: SuffixStore, exclude):
    """What the store searched before issue 46: every closed document joined afresh in id order, then the open
    ones (read after ``searchable``, which closes the documents whose writers moved on)."""
    from mlxspec.drafters.suffix_store import _join

    closed = [doc for d, doc in store._docs.items() if d not in store._owners]
    open_docs = [store._docs[d] for d in store._owners if d != exclude]
    joined = _join(closed)
    return _join([joined, *open_docs]) if open_docs else joined


@pytest.mark.parametrize("seed", range(6))
def test_the_incremental_store_searches_exactly_what_joining_afresh_did(seed):
    """Random documents written by several drafters in turns, corpus files, drafters dropped, a small
    bound (so eviction runs): every search sees the same array as joining every closed document afresh, so
    every draft is the same."""
    rng = np.random.default_rng(seed)
    store = SuffixStore(max_tokens=int(rng.integers(60, 400)))
    real = store.searchable
    checked = []

    def checking(exclude=None):
        got = real(exclude)
        np.testing.assert_array_equal(got, reference_searchable(store, exclude))
        checked.append(got.size)
        return got

    store.searchable = checking
    drafters = [SuffixDrafter(store, depth=4, min_prob=0.0) for _ in range(3)]
    histories = [[] for _ in drafters]
    for _ in range(300):
        i = int(rng.integers(len(drafters)))
        action = rng.random()
        if action < 0.2 or not histories[i]:  # a new request
            histories[i] = rng.integers(0, 6, size=int(rng.integers(1, 20))).tolist()
            drafters[i].prefill(histories[i])
        elif action < 0.25:
            store.add(rng.integers(0, 6, size=int(rng.integers(0, 30))).tolist())
        elif action < 0.28:  # a drafter dropped: its document closes
            drafters[i] = SuffixDrafter(store, depth=4, min_prob=0.0)
            histories[i] = []
        else:
            draft = drafters[i].propose(histories[i], 4, SamplingParams())
            kept = int(rng.integers(0, draft.size + 1))
            path = draft.tree.walk([0] * (draft.size + 1))[:kept] if draft.size else []
            histories[i] += [draft.tokens.tolist()[n - 1] for n in path] + [int(rng.integers(0, 6))]
            drafters[i].commit(len(histories[i]), [n - 1 for n in path])
    assert len(checked) > 100 and max(checked) > 50 and store.evicted_documents > 0


def test_a_finished_document_is_joined_once_not_every_request():
    """Sequential requests (a chat, a server): each search copies only the document that closed since the last
    one; before, every first search of a request joined every closed document again (quadratic work)."""
    store = SuffixStore(max_tokens=10_000)
    drafter = SuffixDrafter(store, depth=4)
    added = 0
    for request in range(200):
        prompt = [request % 7, 1, 2, 3]
        drafter.prefill(prompt)  # closes the last request's document
        history = prompt + [4, 5, 6]
        drafter.propose(history, 4, SamplingParams())
        drafter.propose(history + [7], 4, SamplingParams())
        added += (len(prompt) + 4) + 1 if request else 0  # the previous document and its separator
    assert store.tokens_joined == added  # every closed document copied in exactly once
    small = SuffixStore(max_tokens=300)  # at the bound: eviction moves the start, nothing is joined again
    drafter = SuffixDrafter(small, depth=4)
    for request in range(200):
        drafter.prefill([request % 7, 1, 2, 3])
        drafter.propose([request % 7, 1, 2, 3, 4, 5, 6], 4, SamplingParams())
    assert small.tokens_joined == 199 * (7 + 1) and small.evicted_documents > 150
    stats = small.stats()  # 4 bytes a held token, at most 8 a joined one (separators included): doubling
    assert stats.bytes <= 4 * stats.tokens + 8 * (stats.tokens + stats.documents)
