"""Draft-model rows drafted together (``engine.batch_draft``): each drafts what its drafter would alone.

Tiny float32 models. Round after round of a batch (rows of different lengths, greedy and sampled, a repetition
penalty, γ auto's confidence stop, a draft vocabulary), each row's draft (tokens, q, survival) equals a lone
fork's for the same history and the same random stream, and its draft cache holds what a fresh prefill of its
tokens would; greedy answers of the runner equal ``generate``'s with rows joining later; (slow) sampled
answers at T 0.8 follow the target by chi-square, and the same test still rejects the known batch bug.
"""

from __future__ import annotations

import copy
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from conftest import byte_tokenizer, tiny_llama
from mlxspec import generate
from mlxspec.core.cache import PromptCache, prefill
from mlxspec.core.sampling import SamplingParams
from mlxspec.drafters import Plan, make_drafter
from mlxspec.drafters.draft_model import DraftModelDrafter
from mlxspec.engine.batch import Batch, Row
from mlxspec.engine.batch_draft import DraftRows
from mlxspec.engine.generate import make_verifier
from mlxspec.engine.output import Committed
from mlxspec.engine.runner import Request
from mlxspec.pacing import Fixed
from test_runner import (ROW_PROMPTS, SAMPLES, T08, V, Collect, CutAtTheShortest, _exact_joint, _near_tie,
                         _runner)

GREEDY = SamplingParams()
PROMPTS = ["abcabcabcabc the cat the cat the cat", "hello hello hello world", "xyzxyzxyz 123123123 xyz", "q"]


class KeepAbove(Fixed):
    """γ with a confidence stop (as γ auto plans it): draft token k + 1 only while the survival exceeds
    ``bar`` × 0.6^(k - 1)."""

    def __init__(self, gamma: int, bar: float):
        super().__init__(gamma)
        self._plan = Plan(gamma, keep_above=tuple(bar * 0.6**i for i in range(gamma - 1)))


class EveryOther(Fixed):
    """γ every other round, plain between: the row sits out rounds the others draft (its draft cache gets only
    padding), then feeds 2 committed tokens where the others feed 1."""

    def __init__(self, gamma: int):
        super().__init__(gamma)
        self._rounds = 0

    def plan(self) -> Plan:
        self._rounds += 1
        return self._plan if self._rounds % 2 else Plan(0)


@pytest.fixture(scope="module")
def models():
    return tiny_llama(seed=1, sharpen=3.0), tiny_llama(seed=3, sharpen=2.0), byte_tokenizer()


def _row(target, ids, drafter, sampling, pacer, max_tokens=200, seed=0):
    store = PromptCache(target)
    prefill(target, store.layers, ids[:-1])
    store.add(ids[:-1], None)
    drafter.prefill(ids)
    verifier = make_verifier(sampling)
    return Row(list(ids), drafter, pacer, sampling, verifier, set(), None, max_tokens, store, seed)


SETTINGS = {
    "greedy": [(GREEDY, Fixed(4))] * 3 + [(GREEDY, EveryOther(3))],
    "sampled": [(SamplingParams(temp=0.8), Fixed(4)), (SamplingParams(temp=1.0, top_p=0.9), Fixed(3)),
                (SamplingParams(temp=0.8, repetition_penalty=1.3), EveryOther(4)), (GREEDY, Fixed(2))],
    "confidence stop": [(SamplingParams(temp=0.8), KeepAbove(5, 0.5)), (GREEDY, KeepAbove(4, 0.7)),
                        (SamplingParams(temp=0.6), KeepAbove(5, 0.2)), (SamplingParams(temp=0.8), Fixed(3))],
}


def _base(models, vocab):
    target, draft, tokenizer = models
    if not vocab:
        return make_drafter("draft", target, tokenizer, draft_model=draft, draft_tokenizer=tokenizer)
    return DraftModelDrafter(draft, 264, 264, vocab_ids=list(range(3, 120)))


@pytest.mark.parametrize("vocab", [False, True], ids=["whole vocabulary", "draft vocabulary"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_each_row_drafts_what_its_drafter_alone_would(models, setting, vocab):
    """Every round, each row's draft equals a lone fork's prefilled with the row's history, drawn from the
    row's own stream: tokens equal, q and survival to float32 rounding; afterwards each row's draft cache
    holds a fresh prefill of its tokens (the per-row trims and padding drops)."""
    target, _, tokenizer = models
    base = _base(models, vocab)
    batch = Batch(target)
    rows = [_row(target, tokenizer.encode(p), base.fork(), sampling, copy.deepcopy(pacer), seed=b)
            for b, (p, (sampling, pacer)) in enumerate(zip(PROMPTS, SETTINGS[setting]))]
    for row in rows[:3]:
        batch.add(row)
    seen = []
    propose = batch.draft_rows.propose
    batch.draft_rows.propose = lambda rows, plans: seen.append((plans, propose(rows, plans))) or seen[-1][1]
    drafted = 0
    for r in range(10):
        if r == 3:
            batch.add(rows[3])  # joins later, with its own prefilled cache
        before = [(list(row.history), copy.deepcopy(row._random)) for row in batch.rows]
        members = list(batch.rows)
        batch.round()
        plans, together = seen[-1]
        assert sorted(together) == [b for b, plan in enumerate(plans) if plan.gamma]
        for b, draft in together.items():
            history, stream = before[b]
            alone = base.fork()
            alone.prefill(history)
            mx.random.seed(int(stream.integers(2**63)))
            want = alone.propose(history, plans[b].gamma, members[b].sampling, plans[b])
            drafted += draft.size
            assert draft.tokens.tolist() == want.tokens.tolist(), (r, b)
            np.testing.assert_allclose(np.array(draft.survival), np.array(want.survival),
                                       rtol=1e-4, atol=1e-5)
            if want.logprobs is None:
                assert draft.logprobs is None
            else:
                got, ref = np.array(draft.logprobs), np.array(want.logprobs)
                assert np.array_equal(np.isinf(got), np.isinf(ref))
                np.testing.assert_allclose(got[np.isfinite(ref)], ref[np.isfinite(ref)], rtol=1e-4, atol=1e-4)
    assert drafted > 20 and batch.draft_rows.forwards > 10
    if setting == "confidence stop":  # the stop cut some rows short of their γ, and drafting once all stopped
        assert any(draft.size < plans[b].gamma for plans, together in seen for b, draft in together.items())
        assert batch.draft_rows.forwards < 10 * 5  # a feed and 4 more forwards per round to reach γ 5
    _assert_caches_hold_their_tokens(batch, base)


def _assert_caches_hold_their_tokens(batch, base):
    draft_rows = batch.draft_rows
    for row in list(batch.rows):
        i = draft_rows._index(row.drafter)
        keys = [np.array(layer.keys[i, :, : layer._idx]) for layer in draft_rows.layers]
        # what its commits kept (the roll of what they dropped is pending)
        length = row.drafter.cache[0].offset
        assert 0 < length == len(row.drafter._tokens)
        fresh = base.fork()
        fresh.prefill(row.drafter._tokens + [0])
        for got, want in zip(keys, fresh.cache):
            want = np.array(want.keys[0, :, : want.offset])
            end = got.shape[1] - draft_rows.rows[i].dropped
            np.testing.assert_allclose(got[:, end - length : end], want, rtol=1e-4, atol=2e-4)
        assert row.drafter._tokens == row.history[:length]


def test_greedy_answers_equal_generates_with_rows_joining_later(models):
    """A runner of 4 rows on the draft model: rows of different lengths, two joining a running batch; every
    answer is generate's (or differs only at a float32 near-tie), and the rows drafted together."""
    target, draft, tokenizer = models
    ids = [tokenizer.encode(p) for p in PROMPTS]
    lengths = [40, 12, 50, 30]

    def make():
        return make_drafter("draft", target, tokenizer, draft_model=draft, draft_tokenizer=tokenizer)

    want = [generate(target, tokenizer, p, drafter=make(), num_draft_tokens=3, max_tokens=n,
                     stop_tokens=set()).tokens for p, n in zip(ids, lengths)]
    runner = _runner(target, tokenizer, make, gamma=3)
    sinks = [Collect() for _ in ids]
    try:
        runner.submit(Request(ids[0], lengths[0], GREEDY, None, (), sinks[0]))
        runner.submit(Request(ids[1], lengths[1], GREEDY, None, (), sinks[1]))
        assert sinks[1].done.wait(60)
        for i in (2, 3):
            runner.submit(Request(ids[i], lengths[i], GREEDY, None, (), sinks[i]))
        for sink in sinks:
            assert sink.done.wait(60)
        forwards = runner.call(lambda: runner._batch.draft_rows.forwards)
    finally:
        assert runner.close()
    rounds = [r.round for s in sinks for r in s.records if isinstance(r, Committed)]
    drafted = sum(r.num_drafted for r in rounds)
    assert max(r.rows for r in rounds) == 3 and drafted > 0
    assert forwards < drafted  # rows shared the draft forwards (one by one: one forward per drafted token)
    for prompt, sink, tokens, n in zip(ids, sinks, want, lengths):
        assert len(sink.tokens) == n
        if sink.tokens != tokens:
            assert _near_tie(target, prompt, sink.tokens, tokens) < 1e-4


def test_rows_draft_one_by_one_when_disabled(models, monkeypatch):
    """The switch the benchmark uses: with ``DraftRows.enabled`` off, no row drafts in the batch's draft
    cache."""
    target, _, tokenizer = models
    monkeypatch.setattr(DraftRows, "enabled", False)
    base = _base(models, False)
    batch = Batch(target)
    for b, p in enumerate(PROMPTS[:2]):
        batch.add(_row(target, tokenizer.encode(p), base.fork(), GREEDY, Fixed(3), seed=b))
    drafted = sum(r.stats.num_drafted for _ in range(3) for r in batch.round())
    assert drafted > 0 and batch.draft_rows.forwards == 0 and batch.draft_rows.layers is None


def test_the_batch_gate_prices_rows_drafting_together_as_one_batched_draft():
    """Four rows of γ 4 whose drafting costs a step per token each: one by one that cannot pay at batch 4,
    drafted together (one forward per token for all, priced on the memory-bound curve) it does."""
    from mlxspec.drafters import DraftProfile
    from mlxspec.pacing import AcceptanceEstimate, Auto, BatchGate, Costs

    costs = Costs([0.1 + 0.002 * k for k in range(16)], draft_s=0.03)
    estimate = AcceptanceEstimate(kept=[80.0] * 4, reached=[100.0] * 4)
    pacers = [Auto(costs, DraftProfile(), estimate=estimate) for _ in range(4)]
    plans = [Plan(4)] * 4
    assert BatchGate().admit(pacers, plans) == [Plan(0)] * 4
    # together it pays, best capped at 2 (each draft step costs 0.03 s × the batch's share)
    assert BatchGate().admit(pacers, plans, [True] * 4) == [Plan(2)] * 4
    assert BatchGate().admit(pacers, plans, [True, True, False, False]) == [Plan(0)] * 4


# --- exactness at temperature > 0 (statistical) ----------------------------------------------------------

ROW_PACERS = [lambda: Fixed(3), lambda: KeepAbove(3, 0.6), lambda: Fixed(2), lambda: KeepAbove(3, 0.3)]


@pytest.fixture(scope="module")
def small():
    return tiny_llama(seed=0, vocab_size=V, sharpen=3.0), tiny_llama(seed=7, vocab_size=V, sharpen=3.0)


def _sample_rows(small, batch_type=Batch, n=SAMPLES):
    """Counts of each row's first two tokens over ``n`` batches of four draft-model rows drafted together."""
    target, draft = small
    base = make_drafter("draft", target, list(range(V)), draft_model=draft)
    counts = [Counter() for _ in ROW_PROMPTS]
    for i in range(n):
        batch = batch_type(target)
        rows = [_row(target, p, base.fork(), T08, pacer(), max_tokens=2, seed=i * 7 + b)
                for b, (p, pacer) in enumerate(zip(ROW_PROMPTS, ROW_PACERS))]
        for row in rows:
            batch.add(row)
        out = {id(r): [] for r in rows}
        while batch.rows:
            for result in batch.round():
                out[id(result.row)] += result.tokens
                if result.finish_reason:
                    batch.remove(result.row)
        assert batch.draft_rows.forwards > 0
        for b, row in enumerate(rows):
            counts[b][tuple(out[id(row)][:2])] += 1
    return counts


@pytest.mark.slow  # statistical
def test_draft_model_rows_drafted_together_follow_the_target_at_temperature(small):
    from stats import chi_square

    for prompt, observed in zip(ROW_PROMPTS, _sample_rows(small)):
        stat, critical = chi_square(observed, _exact_joint(small[0], prompt, T08))
        assert stat < critical, f"row {prompt}: chi-square {stat:.1f} >= {critical:.1f}"


@pytest.mark.slow  # statistical
def test_the_same_test_rejects_draft_model_rows_cut_at_the_batchs_shortest_acceptance(small):
    from stats import chi_square

    stats = [chi_square(observed, _exact_joint(small[0], prompt, T08))
             for prompt, observed in zip(ROW_PROMPTS, _sample_rows(small, CutAtTheShortest))]
    assert any(stat > critical for stat, critical in stats), stats
