"""Losslessness end to end: speculative sampling from a tiny model is distributed as plain sampling.

The exact joint distribution of the first two generated tokens is enumerated with
the target and an independent NumPy reference of mlx-lm's warp (filters, then
temperature; repetition penalty on the exact prefix), then compared with samples
from the engine by a chi-square test at the 0.999 level. The same test rejects a
broken verifier, so it has the power to catch one.
"""

from __future__ import annotations

import sys
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from conftest import tiny_llama
from mlxspec.drafters import DraftProfile
from mlxspec.pacing import AcceptanceEstimate, Auto, Costs
from mlxspec.drafters import Draft, Drafter, make_drafter
from mlxspec.engine.generate import speculative_rounds
from mlxspec.core.sampling import SamplingParams, warp
from stats import chi_square

V = 8
PROMPT = [1, 2, 3, 1, 2]  # "1 2" repeats, so the n-gram drafter always proposes
N_SAMPLES = 1200
#: The sweep over drafters and settings, its broken control and test_registry's per-drafter run: at 800 a
#: verifier without the residual is still rejected with probability 0.99998 (draft: computed from the broken
#: rule's exact joint) and with noncentrality ~176 (n-gram: 264 measured at 1,200, scaled).
SWEEP_SAMPLES = 800


@pytest.fixture(scope="module")
def models():
    return tiny_llama(seed=0, vocab_size=V, sharpen=3.0), tiny_llama(seed=7, vocab_size=V, sharpen=3.0)


def reference_probs(logits: np.ndarray, prefix: list[int], params: SamplingParams) -> np.ndarray:
    """NumPy re-statement of mlx-lm's sampler: penalty, top-p, min-p, top-k, then temperature."""
    logits = logits.astype(np.float64).copy()
    if params.repetition_penalty:
        for t in set(prefix[-params.repetition_context_size :]):
            logits[t] = (
                logits[t] * params.repetition_penalty
                if logits[t] < 0
                else logits[t] / params.repetition_penalty
            )
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    keep = np.ones(V, dtype=bool)
    if params.top_p < 1:
        order = np.argsort(-probs)
        mass_above = np.cumsum(probs[order]) - probs[order]
        keep[order[mass_above >= params.top_p]] = False
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()
    if params.top_k:
        ranked = np.argsort(-np.where(keep, probs, -1))
        keep[ranked[params.top_k :]] = False
    tempered = np.where(keep, probs ** (1 / params.temp), 0.0)
    return tempered / tempered.sum()


def exact_joint(model, params: SamplingParams, length: int = 2) -> dict:
    """P(first ``length`` generated tokens) for every sequence of ids, enumerated."""
    def next_probs(prefix):
        logits = model(mx.array(prefix)[None])[0, -1]
        return reference_probs(np.array(logits), prefix, params)

    joint = {(): 1.0}
    for _ in range(length):
        joint = {seq + (t,): p * pt for seq, p in joint.items() if p > 0
                 for t, pt in enumerate(next_probs(PROMPT + list(seq)))}
    return joint


def sample_joint(model, drafter, params: SamplingParams, n: int = N_SAMPLES, gamma=lambda: 3,
                 length: int = 2, max_tokens: int = 2) -> Counter:
    """Counts of the first ``length`` tokens over ``n`` generations of ``max_tokens`` tokens."""
    mx.random.seed(1234)
    counts = Counter()
    for _ in range(n):
        tokens = []
        rounds = speculative_rounds(model, PROMPT, drafter, num_draft_tokens=gamma(), max_tokens=max_tokens,
                                    sampling=params, stop_tokens=set())
        for round_ in rounds:
            tokens += round_.tokens
        counts[tuple(tokens[:length])] += 1
    return counts


def _drafter(kind, models):
    target, draft = models
    spec = "ngram:min=1" if kind == "ngram" else kind  # short random prompts recur only in 1-token matches
    return make_drafter(
        spec, target=target, tokenizer=list(range(V)), draft_model=draft if kind == "draft" else None
    )


SETTINGS = {
    "temp1": SamplingParams(temp=1.0),
    "temp0.7-top_k3": SamplingParams(temp=0.7, top_k=3),
    "top_p0.8": SamplingParams(temp=1.0, top_p=0.8),
    "min_p0.1": SamplingParams(temp=1.3, min_p=0.1),
    "repetition1.5": SamplingParams(temp=1.0, repetition_penalty=1.5),
}
#: Temperature 1 alone is in test_registry, for every drafter (the same models, prompt and seed: the same
#: samples).
CASES = [("draft", name) for name in SETTINGS if name != "temp1"] + [("ngram", "top_p0.8")]


@pytest.mark.slow  # statistical
@pytest.mark.parametrize("kind,setting", CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_first_two_tokens_follow_the_target(models, kind, setting):
    params = SETTINGS[setting]
    stat, critical = chi_square(sample_joint(models[0], _drafter(kind, models), params, n=SWEEP_SAMPLES),
                                exact_joint(models[0], params))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


def without_residual(rule):
    """The classic mistake: after a rejection, draw from p instead of the residual."""

    def broken(*args):
        choice, _ = rule(*args)
        return choice, mx.random.categorical(args[-1], axis=-1).astype(mx.int32)

    return broken


@pytest.mark.slow  # statistical
@pytest.mark.parametrize("kind,rule", [("draft", "verify_sampled"), ("ngram", "verify_deterministic")])
def test_the_same_test_rejects_a_verifier_without_residual(models, kind, rule, monkeypatch):
    engine = sys.modules["mlxspec.engine.generate"]
    monkeypatch.setattr(engine, rule, without_residual(getattr(engine, rule)))
    params = SETTINGS["temp1"]
    stat, critical = chi_square(sample_joint(models[0], _drafter(kind, models), params, n=SWEEP_SAMPLES),
                                exact_joint(models[0], params))
    assert stat > critical


@pytest.mark.slow  # statistical
def test_the_same_test_rejects_greedy_drafts_scored_as_sampled(models):
    """A draft model that drafts argmax q but reports the softmax q it did not sample from."""
    drafter = _drafter("draft", models)
    propose_greedy = drafter.propose

    def greedy_with_softmax_q(history, num_draft_tokens, sampling, plan=None):
        draft = propose_greedy(history, num_draft_tokens, SamplingParams())
        if draft.size == 0:
            return draft
        context = history + draft.tokens.tolist()[:-1]
        logits = models[1](mx.array(context)[None])[0, len(history) - 1 :]  # [K, V]
        return Draft.chain(draft.tokens, warp(logits, sampling))

    drafter.propose = greedy_with_softmax_q
    params = SETTINGS["temp1"]
    stat, critical = chi_square(sample_joint(models[0], drafter, params), exact_joint(models[0], params))
    assert stat > critical


class MissingDrafter(Drafter):
    """Proposes the target's least likely token, which top-k sampling never keeps."""

    name = "missing"

    def __init__(self, target):
        self.target = target

    def propose(self, history, num_draft_tokens, sampling, plan=None):
        if num_draft_tokens == 0:
            return Draft.empty()
        worst = int(mx.argmin(self.target(mx.array(history)[None])[0, -1]).item())
        return Draft.chain([worst] * num_draft_tokens)


MEMORY_BOUND = Costs([1.0 + 0.1 * (k - 1) for k in range(1, 17)])
# pipelined plain steps (γ = 0), and auto falling back after one miss (a weak prior): round 1 drafts,
# round 2 is plain
PLAIN_CASES = {
    "plain-repetition1.5": (lambda m: make_drafter("none", m, list(range(V))), lambda: 0, "repetition1.5"),
    "plain-temp0.7-top_k3": (lambda m: make_drafter("none", m, list(range(V))), lambda: 0, "temp0.7-top_k3"),
    "auto-missing-top_k3": (
        MissingDrafter,
        lambda: Auto(MEMORY_BOUND, estimate=AcceptanceEstimate(prior_weight=0.1)),
        "temp0.7-top_k3",
    ),
}


@pytest.mark.slow  # statistical
@pytest.mark.parametrize("case", list(PLAIN_CASES))
def test_plain_steps_and_fallback_follow_the_target(models, case):
    make, gamma, setting = PLAIN_CASES[case]
    params = SETTINGS[setting]
    stat, critical = chi_square(sample_joint(models[0], make(models[0]), params, gamma=gamma),
                                exact_joint(models[0], params))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"


@pytest.mark.slow  # statistical
def test_the_same_test_rejects_plain_steps_that_drop_the_filters(models, monkeypatch):
    engine = sys.modules["mlxspec.engine.plain_steps"]
    original = engine.sample  # the plain step's sampler, here without its top-k filter
    monkeypatch.setattr(
        engine, "sample", lambda logits, params: original(logits, SamplingParams(temp=params.temp))
    )
    params = SETTINGS["temp0.7-top_k3"]
    drafter = make_drafter("none", models[0], list(range(V)))
    stat, critical = chi_square(
        sample_joint(models[0], drafter, params, gamma=lambda: 0), exact_joint(models[0], params)
    )
    assert stat > critical


#: After two drafts a third pays only when their confidences multiply to more than 0.17 + 0.1: with the draft
#: model below, after a first token 6 (survival 0.30) but not after 1 or 7 (0.24, 0.18).
STOPPING = Costs(MEMORY_BOUND.verify_s, draft_s=0.17)


@pytest.mark.slow  # statistical
# settings under which the first round stops both ways
@pytest.mark.parametrize("setting", ["temp1", "min_p0.1"])
def test_rounds_ended_by_the_drafts_confidence_follow_the_target(models, setting):
    """γ auto with the draft model (``DraftProfile.confidence``): whether the first round drafts a third token
    depends on the first token drawn (through the draft's confidence at the second); the first three tokens
    are still distributed as the target's (docs/acceptance.md 3.3). Four are generated, so the first round may
    draft three."""
    params = SETTINGS[setting]
    drafter, sizes = _drafter("draft", models), Counter()
    propose = drafter.propose

    def counted(history, num_draft_tokens, sampling, plan=None):
        draft = propose(history, num_draft_tokens, sampling, plan)
        if len(history) == len(PROMPT):
            sizes[draft.size] += 1
        return draft

    drafter.propose = counted
    counts = sample_joint(
        models[0],
        drafter,
        params,
        gamma=lambda: Auto(STOPPING, DraftProfile(confidence=True)),
        length=3,
        max_tokens=4,
    )
    assert sizes[2] > 200 and sizes[3] > 200  # the first round's stop went both ways
    stat, critical = chi_square(counts, exact_joint(models[0], params, length=3))
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}"
