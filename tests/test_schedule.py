"""Confidence-scheduled verification (``--num-draft-tokens scheduled``): the choice,
and that it stays exact."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from conftest import byte_tokenizer, tiny_llama
from mlxspec import generate, make_drafter
from mlxspec.pacing import Costs
from mlxspec.drafters import Draft
from mlxspec.drafters.eagle import EagleDrafter
from mlxspec.drafters.medusa import MedusaDrafter
from mlxspec.pacing import make_pacer
from mlxspec.engine.generate import speculative_rounds
from mlxspec.core.sampling import SamplingParams
from mlxspec.pacing.scheduled import (Scheduled, SurvivalCalibration, best_count, closed_survival,
                                      stopping_length)
from mlxspec.core.taps import output_head
from mlxspec.core.tree import Tree
from stats import chi_square
from test_eagle import random_head
from test_lossless import PROMPT as SHORT_PROMPT, V, exact_joint
from test_medusa import random_heads

PROMPT = [10, 20, 30, 40, 10, 20, 30, 41, 50, 60]


def linear_costs(step_ms: float, draft_ms: float = 0.0) -> Costs:
    """T_verify(k) = 10 ms + step_ms · (k − 1)."""
    return Costs([0.010 + step_ms / 1000 * k for k in range(16)], draft_ms / 1000)


def test_best_count_is_the_brute_force_argmax():
    rng = np.random.default_rng(0)
    for step in (0.0, 2.0, 5.0, 20.0):
        costs = linear_costs(step, draft_ms=3.0)
        values = np.sort(rng.uniform(0, 1, 12))[::-1]
        rates = [(1 + values[:m].sum()) / (0.003 + costs.verify(m + 1)) for m in range(13)]
        assert best_count(values, costs, 0.003) == int(np.argmax(rates))
    assert best_count(np.full(6, 0.9), linear_costs(0.0), 0.0) == 6  # free verification: everything
    assert best_count(np.full(6, 0.9), linear_costs(20.0), 0.0) == 0  # 3x a step per token: nothing


def test_stopping_length_stops_where_tokens_per_second_stop_growing():
    assert stopping_length(np.full(8, 0.95) ** np.arange(1, 9), linear_costs(0.5), 0.0) == 8
    assert stopping_length(np.array([0.9, 0.8, 0.05, 0.01]), linear_costs(4.0), 0.0) == 2
    assert stopping_length(np.array([0.1, 0.01]), linear_costs(4.0), 0.0) == 0


def test_closed_survival_keeps_parents_and_earlier_siblings_ahead():
    tree = Tree((-1, -1, 0, 0, 1))  # root children 0, 1; node 0 has 2, 3; node 1 has 4
    value = closed_survival(np.array([0.5, 0.9, 0.7, 0.8, 0.95]), tree)
    assert value.tolist() == [0.5, 0.5, 0.5, 0.5, 0.5]
    value = closed_survival(np.array([0.9, 0.6, 0.5, 0.7, 0.2]), tree)
    assert value.tolist() == [0.9, 0.6, 0.5, 0.5, 0.2]


def test_select_renumbers_the_kept_nodes_and_refuses_orphans():
    tree = Tree((-1, -1, 0, 0, 1))
    draft = Draft(mx.array([5, 6, 7, 8, 9], dtype=mx.int32), tree, mx.log(mx.full((5, 4), 0.25)),
                  mx.array([0.9, 0.5, 0.8, 0.7, 0.4]))
    sub = draft.select([0, 1, 3])
    assert sub.tree.parents == (-1, -1, 0) and sub.tokens.tolist() == [5, 6, 8]
    assert sub.logprobs.shape == (3, 4) and np.allclose(np.array(sub.survival), [0.9, 0.5, 0.7])
    assert draft.select([]).size == 0
    with pytest.raises(ValueError, match="without its parent"):
        draft.select([0, 4])


def test_calibration_follows_observed_survival():
    calibration = SurvivalCalibration()
    for _ in range(200):  # the drafter says 0.9 for depth 1; half of those nodes survive
        calibration.observe(np.array([0.9, 0.9]), np.array([1, 1]), np.array([True, False]))
    assert abs(calibration.calibrate(np.array([0.9]), np.array([1]))[0] - 0.5) < 0.05
    assert calibration.calibrate(np.array([0.3]), np.array([1]))[0] == pytest.approx(0.3)  # no data: trusted
    assert calibration.totals["bins"][9] == [400, pytest.approx(360.0), 200]
    # prior 0.5 a level
    assert calibration.calibrate(np.array([np.nan]), np.array([2]))[0] == pytest.approx(0.25)


def test_scheduled_needs_a_drafter_that_reports_survival():
    target = tiny_llama(seed=0)
    with pytest.raises(ValueError, match="the ngram drafter does not: use 'auto' or an integer"):
        make_pacer("scheduled", target, make_drafter("ngram"), costs=linear_costs(1.0))
    drafter = make_drafter("draft", target=target, tokenizer=byte_tokenizer(), draft_model=tiny_llama(seed=3))
    policy = make_pacer("scheduled", target, drafter, costs=linear_costs(1.0))
    assert isinstance(policy, Scheduled) and policy.max_gamma == 8
    assert make_pacer(policy, target, drafter) is policy
    with pytest.raises(ValueError, match="'scheduled'"):
        make_pacer("sheduled", target, drafter)


def noisy_copy(model_seed: int = 0, sharpen: float = 4.0, scale: float = 0.3):
    """The target with noise on its LM head: a draft model that agrees often, not always."""
    model = tiny_llama(seed=model_seed, sharpen=sharpen)
    mx.random.seed(5)
    model.lm_head.weight = model.lm_head.weight + scale * mx.random.normal(model.lm_head.weight.shape)
    mx.eval(model.parameters())
    return model


def _drafter(kind, target):
    if kind == "draft":
        return make_drafter("draft", target=target, tokenizer=byte_tokenizer(), draft_model=noisy_copy())
    if kind == "eagle-tree":
        return EagleDrafter(random_head(1), target, depth=4, top_k=3, total_tokens=12)
    return MedusaDrafter(random_heads(), output_head(target))


@pytest.mark.parametrize("kind,step_ms", [("draft", 1.5), ("eagle-tree", 0.2), ("medusa", 1.5)])
def test_scheduled_greedy_equals_plain_greedy_over_300_tokens(kind, step_ms):
    """(A random EAGLE head is never right, so its trees are verified whole or not at all.)"""
    target, tokenizer = tiny_llama(seed=0, sharpen=4.0), byte_tokenizer()
    plain = generate(target, tokenizer, PROMPT, drafter="none", max_tokens=300, stop_tokens=set())
    drafter = _drafter(kind, target)
    policy = Scheduled(linear_costs(step_ms), max_gamma=drafter.profile.max_depth or 6, probe_every=4)
    verified = []
    schedule = policy.schedule
    policy.schedule = lambda draft: verified.append((draft.size, (kept := schedule(draft)).size)) or kept
    spec = generate(target, tokenizer, PROMPT, drafter=drafter, num_draft_tokens=policy, max_tokens=300,
                    stop_tokens=set())
    assert spec.tokens == plain.tokens
    assert any(0 < kept < size for size, kept in verified) or kind == "eagle-tree"  # the schedule cut drafts
    assert any(size == kept > 0 for size, kept in verified)  # and verified whole ones


def _sample(target, drafter, policy, params, n=1500) -> Counter:
    """First two tokens after SHORT_PROMPT, n times, the policy learning across samples."""
    mx.random.seed(99)
    counts = Counter()
    for _ in range(n):
        tokens = []
        for round_ in speculative_rounds(target, SHORT_PROMPT, drafter, num_draft_tokens=policy, max_tokens=3,
                                         sampling=params, stop_tokens=set()):
            tokens += round_.tokens
        counts[tuple(tokens[:2])] += 1
    return counts


@pytest.fixture(scope="module")
def lossless_models():
    return tiny_llama(seed=0, vocab_size=V, sharpen=3.0), tiny_llama(seed=7, vocab_size=V, sharpen=3.0)


def _scheduled_draft(models, own_token: bool):
    target, draft = models
    drafter = make_drafter("draft", target=target, tokenizer=list(range(V)), draft_model=draft)
    if own_token:  # the mistake: a position's survival read from q of the token drawn there
        propose = drafter.propose

        def with_own_token_survival(history, num_draft_tokens, sampling, plan=None):
            d = propose(history, num_draft_tokens, sampling)
            if d.size:
                own = mx.take_along_axis(d.logprobs, d.tokens[:, None], axis=-1)[:, 0]
                d.survival = mx.exp(mx.cumsum(own))
            return d

        drafter.propose = with_own_token_survival
    return drafter, Scheduled(linear_costs(1.0), max_gamma=2, probe_every=0)


@pytest.mark.slow  # statistical
def test_scheduled_sampling_follows_the_target(lossless_models):
    params = SamplingParams(temp=1.0)
    drafter, policy = _scheduled_draft(lossless_models, own_token=False)
    lengths = Counter()
    schedule = policy.schedule
    policy.schedule = lambda draft: (kept := schedule(draft), lengths.update([kept.size]))[0]
    stat, critical = chi_square(_sample(lossless_models[0], drafter, policy, params),
                                exact_joint(lossless_models[0], params))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"
    # drafts verified whole and cut (a round with no room left for a draft is a plain step, never scheduled)
    assert min(lengths[1], lengths[2]) > 0


@pytest.mark.slow  # statistical
def test_the_same_test_rejects_survival_that_reads_its_own_token(lossless_models):
    params = SamplingParams(temp=1.0)
    drafter, policy = _scheduled_draft(lossless_models, own_token=True)
    stat, critical = chi_square(_sample(lossless_models[0], drafter, policy, params),
                                exact_joint(lossless_models[0], params))
    assert stat > critical


def test_reliability_data_pools_the_scheduled_runs():
    from mlxspec.bench.runs import RunRecord
    from mlxspec.bench.summary import reliability_data

    calibration = SurvivalCalibration()
    calibration.observe(np.array([0.95, 0.42, np.nan]), np.array([1, 2, 3]), np.array([True, False, False]))
    runs = [RunRecord("s", "p", "k", 0.0, 0, 4, 0.1, 4, 0.2, calibration=calibration.totals)
            for _ in range(2)]
    runs.append(RunRecord("fixed", "p", "k", 0.0, 0, 4, 0.1, 4, 0.2))
    data = reliability_data(runs)
    assert list(data) == ["s"]  # the n-gram-style node without a prediction is not plotted
    assert data["s"]["bins"][9] == [2, pytest.approx(1.9), 2]
    assert data["s"]["bins"][4] == [2, pytest.approx(0.84), 0]
    assert data["s"]["depths"] == [[2, pytest.approx(1.9), 2], [2, pytest.approx(0.84), 0]]


def test_cli_refuses_scheduled_without_survival_and_names_the_policy(tiny_model_dir, capsys):
    from mlxspec.commands.cli import main
    from mlxspec.commands.generate import format_stats
    from mlxspec.core.metrics import GenerationStats

    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--drafter", "ngram",
                 "--num-draft-tokens", "scheduled", "--max-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the ngram drafter does not: use 'auto' or an integer" in err[0]
    stats = GenerationStats(drafter="draft", num_draft_tokens=8, gamma_rounds=[1, 0, 3])
    assert "γ = scheduled (mean 1.5, at most 8); fell back to plain decoding in 1 of 4 rounds" in \
        format_stats(stats, policy="scheduled")
