"""γ auto ends a wait in a judgement of the plain stretch, not a probe (Drafter.judge, AutoGamma.observe,
docs/acceptance.md 3.4)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import byte_tokenizer, tiny_llama
from mlxspec import generate, stream_generate
from mlxspec.costmodel import AcceptanceEstimate, AutoGamma, Costs
from mlxspec.drafters.draft_model import DraftModelDrafter
from mlxspec.gamma import gamma_policy
from mlxspec.metrics import CycleStats, TokenEvent
from mlxspec.sampling import SamplingParams, warp

V = 264
#: A draft costing 0.3 of a memory-bound target step: γ 1 wins above α ≈ 0.45, loses below.
COSTS = Costs([1.0 + 0.1 * (k - 1) for k in range(1, 17)], draft_s=0.3)
HISTORY = [5, 9, 17, 33, 2, 71, 5, 9, 17, 40, 41, 42, 5, 9, 17, 33, 100, 101]


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(seed=7, vocab_size=V, sharpen=3.0)


def teacher_forced_logq(model, history, start, params, ids=None):
    """log q(history[i] | history[:i]) for i >= start from one uncached forward over the whole history."""
    logits = model(mx.array(history[:-1])[None])[0].astype(mx.float32)  # row i predicts history[i + 1]
    if ids is not None:
        allowed = np.zeros(V, dtype=bool)
        allowed[ids] = True
        allowed[np.array(history[:start])] = True
        logits = mx.where(mx.array(allowed), logits, -mx.inf)
    rows = logits[start - 1 :]
    tokens = np.array(history[start:])
    if params.greedy:
        return np.where(np.array(mx.argmax(rows, axis=-1)) == tokens, 0.0, -np.inf)
    return np.array(warp(rows, params))[np.arange(len(tokens)), tokens]


@pytest.mark.parametrize("params", [SamplingParams(temp=0.0), SamplingParams(temp=0.8, top_p=0.9)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("ids", [None, np.array([0, 5, 9, 17, 33, 100])], ids=["whole", "draft-vocab"])
def test_the_draft_model_judges_each_plain_token_as_a_fresh_forward_would(draft, params, ids):
    prompt, start = HISTORY[:6], 9
    drafter = DraftModelDrafter(draft, V, V, vocab_ids=ids)
    drafter.prefill(prompt)
    drafter.propose(prompt, 2, params)
    drafter.commit(7, [0])  # kept one draft and the target's next token: 7 committed (whatever they were)
    judged = np.array(drafter.judge(HISTORY, start, params))
    expected = teacher_forced_logq(draft, HISTORY, start, params, ids)
    assert judged.shape == (len(HISTORY) - start,)
    np.testing.assert_allclose(judged, expected, atol=2e-4)
    if params.greedy:
        assert 0 < np.isfinite(judged).sum() < len(judged)  # some kept, some not: the check can fail
    # it leaves the drafter where a catch-up would: the next draft is a fresh drafter's
    fresh = DraftModelDrafter(draft, V, V, vocab_ids=ids)
    fresh.prefill(HISTORY)
    greedy = SamplingParams(temp=0.0)
    assert drafter.propose(HISTORY, 4, greedy).tokens.tolist() == fresh.propose(HISTORY, 4, greedy).tokens.tolist()


def test_it_refuses_to_judge_with_logits_processors_or_what_it_already_read(draft):
    drafter = DraftModelDrafter(draft, V, V)
    drafter.prefill(HISTORY[:10])
    assert drafter.judge(HISTORY, 12, SamplingParams(temp=0.0, repetition_penalty=1.3)) is None
    assert drafter.judge(HISTORY, 5, SamplingParams(temp=0.0)) is None  # position 4 is cached already
    assert drafter.judge(HISTORY, 12, SamplingParams(temp=0.0)) is not None


def wait_out(auto: AutoGamma) -> int:
    """Plain rounds until the policy asks for a judgement, that one included (it must, within its longest wait)."""
    for n in range(1, auto.max_wait + 2):
        if auto.choose_gamma() == 0 and auto.judging:
            return n
        auto.update(CycleStats(0, auto.gamma, 0, 1, 0.0, 0.0, auto.gamma))
    raise AssertionError("no judgement")


def fall_back(auto: AutoGamma) -> int:
    """Rounds of drafts that keep nothing, until the policy falls back; then its plain rounds up to the
    judgement that ends the wait (the wait, the judging round, and the round that chose to fall back when
    the choice did rather than a miss)."""
    while (gamma := auto.choose_gamma()) > 0:
        auto.update(CycleStats(0, gamma, 0, 1, 0.0, 0.0, gamma))
    return 1 + wait_out(auto)


def test_a_wait_ends_in_a_judgement_that_decides_the_next_round():
    auto = AutoGamma(COSTS, probe_every=8, judges=True, stop_early=True)
    assert fall_back(auto) in (9, 10) and not auto.probing  # a wait of 8, then a plain round that judges
    auto.observe([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0])  # kept 10 of 12: drafting pays
    assert not auto.judging and auto.choose_gamma() > 0
    assert fall_back(auto) in (9, 10)  # the good judgement reset the back-off
    auto.observe([0.0] * 8 + [0.25] * 8)  # teacher-forced acceptance far under break-even: wait twice as long
    assert auto.choose_gamma() == 0 and 1 + wait_out(auto) in (17, 18)
    auto.observe(None)  # the drafter could not judge: the next round probes instead
    assert auto.choose_gamma() > 0 and auto.probing


def test_a_drafter_that_cannot_judge_still_probes():
    auto = AutoGamma(COSTS, probe_every=8, stop_early=True)
    while (gamma := auto.choose_gamma()) > 0:  # misses until it falls back (that choice's round is plain)
        auto.update(CycleStats(0, gamma, 0, 1, 0.0, 0.0, gamma))
    choices = [auto.choose_gamma() for _ in range(9)]
    assert choices[:8] == [0] * 8 and choices[8] > 0 and auto.probing and not auto.judging


def test_judged_tokens_weigh_as_rounds_drafted_from_each():
    estimate = AcceptanceEstimate(window=1e9)  # no forgetting: exact counts
    auto = AutoGamma(COSTS, max_gamma=3, estimate=estimate, judges=True)
    auto.observe([1.0, 1.0, 0.5, 0.0])
    # rounds from each token: kept depths (1, 1, 0.5), (1, 0.5, 0), (0.5, 0), (0,)
    assert estimate.drafted == pytest.approx([4.0, 3.0, 2.0]) and estimate.kept == pytest.approx([2.5, 1.5, 0.5])
    assert estimate.rounds == 4


def test_in_the_loop_a_judgement_brings_a_good_draft_back_and_the_output_stays_the_targets():
    """The target drafts for itself (every draft kept) but the policy starts in the wait a missed probe left it
    in: the round that ends the wait judges the plain stretch, and from the next one it drafts again."""
    model, tokenizer = tiny_llama(seed=0, vocab_size=V, sharpen=4.0), byte_tokenizer()
    prompt = [40, 41, 42, 43]
    plain = generate(model, tokenizer, prompt, drafter="none", max_tokens=48).tokens
    for params in (SamplingParams(temp=0.0), SamplingParams(temp=0.9)):
        auto = AutoGamma(COSTS, probe_every=6, judges=True, stop_early=True)
        while (gamma := auto.choose_gamma()) > 0:  # misses until it falls back: a wait of 6
            auto.update(CycleStats(0, gamma, 0, 1, 0.0, 0.0, gamma))
        before = auto.estimate.rounds
        events = list(stream_generate(model, tokenizer, prompt, drafter=DraftModelDrafter(model, V, V),
                                      max_tokens=48, num_draft_tokens=auto, sampling=params, seed=3))
        rounds = [e for e in events if isinstance(e, CycleStats)]
        gammas = [r.gamma for r in rounds]
        assert gammas[:7] == [0] * 7  # the wait, and the round that ends it in a judgement
        assert all(g > 0 for g in gammas[7:11]) and all(r.num_accepted == r.num_drafted for r in rounds[7:11])
        drafting = sum(r.num_drafted > 0 for r in rounds)
        assert auto.estimate.rounds == before + 6 + drafting  # the 6 tokens of the wait were judged
        assert [len(r.judged) for r in rounds if r.judged] == [6] and rounds[6].judged  # the round that ends it
        stats = events[-1]
        assert (stats.judgements, stats.judged_tokens) == (1, 6)
        assert stats.judged_acceptance == pytest.approx(sum(rounds[6].judged) / 6)
        if params.greedy:  # the target drafting for itself: every judged token would have been kept
            assert [e.token for e in events if isinstance(e, TokenEvent)] == plain and rounds[6].judged == (1.0,) * 6
        assert stats.to_dict()["judged_acceptance"] == stats.judged_acceptance


def test_a_draft_model_slower_than_its_target_is_priced_plain_and_never_runs(draft):
    """γ auto with a draft model that could not win even if every draft were kept (a 4-bit draft on a CPU) runs
    plain decoding and says so, as for a tree drafter; the draft model does not even read the prompt."""
    target, tokenizer = tiny_llama(seed=0, vocab_size=V), byte_tokenizer()
    drafter = DraftModelDrafter(draft, V, V)
    assert isinstance(gamma_policy("auto", target, drafter, costs=Costs(COSTS.verify_s, draft_s=0.1)), AutoGamma)
    policy = gamma_policy("auto", target, drafter, costs=Costs(COSTS.verify_s, draft_s=2.0))
    assert policy.priced_plain
    ran = []
    drafter.prefill = drafter.propose = drafter.judge = lambda *a, **k: ran.append(a)
    result = generate(target, tokenizer, HISTORY, drafter=drafter, num_draft_tokens=policy, max_tokens=12)
    assert ran == [] and result.stats.priced_plain and result.stats.drafted == 0
    assert result.tokens == generate(target, tokenizer, HISTORY, drafter="none", max_tokens=12).tokens
