"""The runner: rows verified together are each verified exactly as alone; continuous batching; prefill chunks.

Exactness in a batch rests on two facts, each tested here on tiny float32 models: (1) a row's logits in the
batched verify forward equal the logits it gets alone (masks, RoPE positions and padding), and its cache after
the per-row commit holds what a single-row cache would; (2) each row's acceptance rule is the single-request
rule on those logits, and no row is ever cut short by another. End to end: greedy answers from a batch equal
``generate``'s, and (slow) sampled answers at T 0.8 follow the target's exact distribution by a chi-square
test that rejects the known batch bug (a row cut at the batch's shortest acceptance and given a fresh target
sample there).
"""

from __future__ import annotations

import threading
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from conftest import byte_tokenizer, tiny_llama
from mlxspec import generate
from mlxspec.core.cache import PromptCache, prefill
from mlxspec.core.sampling import SamplingParams
from mlxspec.core.tree import Tree
from mlxspec.drafters import Draft, make_drafter
from mlxspec.engine.batch import Batch, Row, batch_tree_attention
from mlxspec.engine.generate import make_verifier
from mlxspec.engine.output import Committed
from mlxspec.engine.runner import Done, Failed, Request, Runner, Setup
from mlxspec.pacing import make_pacer

GREEDY = SamplingParams()
PROMPTS = ["abcabcabcabc the cat the cat the cat", "hello hello hello world", "xyzxyzxyz 123123123 xyz", "q"]


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(seed=1, sharpen=3.0), byte_tokenizer()


def _row(model, tokenizer, ids, drafter, sampling=GREEDY, gamma=4, max_tokens=40, seed=0):
    store = PromptCache(model)
    prefill(model, store.layers, ids[:-1])
    store.add(ids[:-1], None)
    drafter.prefill(ids)
    pacer = make_pacer(gamma, model, drafter)
    return Row(
        list(ids), drafter, pacer, sampling, make_verifier(sampling), set(), None, max_tokens, store, seed
    )


def test_a_rows_batched_verify_logits_are_its_logits_alone(pair):
    """Chains, a tree and an empty draft of different lengths, over prompts of different lengths."""
    model, tokenizer = pair
    ids = [tokenizer.encode(p) for p in PROMPTS[:3]]
    drafts = [Draft.chain([5, 6, 7]), Draft(mx.array([8, 9, 10, 11], dtype=mx.int32), Tree((-1, -1, 0, 1))),
              Draft.empty()]
    batch = Batch(model)
    for prompt in ids:
        batch.add(_row(model, tokenizer, prompt, make_drafter("none")))
    width = 5
    tokens = mx.stack([mx.concatenate([mx.array(p[-1:]), d.tokens, mx.zeros((width - 1 - d.size,), mx.int32)])
                       for p, d in zip(ids, drafts)])
    with batch_tree_attention(model, batch.layers, [d.tree for d in drafts], width):
        batched = model(tokens, cache=batch.layers)  # [B, T, V]
    for b, (prompt, draft) in enumerate(zip(ids, drafts)):
        alone = PromptCache(model)
        prefill(model, alone.layers, prompt[:-1])
        from mlxspec.core.cache import tree_attention

        with tree_attention(model, alone.layers, draft.tree):
            single = model(tokens[b : b + 1, : draft.size + 1], cache=alone.layers)[0]
        np.testing.assert_allclose(
            np.array(batched[b, : draft.size + 1]), np.array(single), atol=2e-4, rtol=1e-4
        )


@pytest.mark.parametrize("spec", ["ngram:min=1", "suffix:min_prob=0"])
def test_after_rounds_each_rows_cache_holds_what_its_own_would(pair, spec):
    """Per-row commits (rolls, tree gathers, shifts) leave each row's keys as a fresh prefill of its
    tokens."""
    model, tokenizer = pair
    base = make_drafter(spec, model, tokenizer)
    batch = Batch(model)
    rows = [_row(model, tokenizer, tokenizer.encode(p), base.fork(), max_tokens=60) for p in PROMPTS]
    for row in rows:
        batch.add(row)
    drafted = 0
    for _ in range(12):
        drafted += sum(r.stats.num_drafted for r in batch.round())
    assert drafted > 0
    for row in list(rows):
        batch.remove(row)
        fresh = PromptCache(model)
        prefill(model, fresh.layers, row.history[:-1])
        for kept, want in zip(row.store.layers, fresh.layers):
            assert kept.offset == want.offset == len(row.history) - 1
            np.testing.assert_allclose(np.array(kept.keys[..., : kept.offset, :]),
                                       np.array(want.keys[..., : want.offset, :]), atol=2e-4, rtol=1e-4)


def _near_tie(model, prompt, got, want):
    """Where a batched greedy answer differs from the single one, the target's two best logits there must be
    within float32 rounding of each other (batched kernels round differently); returns their gap."""
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    logits = np.array(model(mx.array(prompt + want[:i])[None])[0, -1], dtype=np.float64)
    top = np.sort(logits)[-2:]
    return top[1] - top[0]


def _runner(model, tokenizer, make, *, max_batch=4, prefill_chunk=512, gamma=4):
    """A started runner generating with the drafter ``make()`` builds (on the runner thread, as a server
    loads)."""
    runner = Runner(max_batch=max_batch, prefill_chunk=prefill_chunk)
    runner.start()
    runner.call(lambda: runner.use(Setup(model, tokenizer, make(), gamma)))
    return runner


class Collect:
    """A request's sink: its committed tokens, records and end."""

    def __init__(self):
        self.tokens, self.records, self.done = [], [], threading.Event()

    def __call__(self, item):
        self.records.append(item)
        if isinstance(item, Committed):
            self.tokens += [event.token for event in item.events]
        else:
            self.done.set()

    @property
    def end(self):
        return self.records[-1]


def _drafter(spec, model, tokenizer):
    if spec == "draft":
        return make_drafter(
            "draft", model, tokenizer, draft_model=tiny_llama(seed=3), draft_tokenizer=tokenizer
        )
    if spec == "eagle":
        from test_eagle import random_head
        from mlxspec.drafters.eagle import EagleDrafter

        return EagleDrafter(random_head(1), model, depth=4, top_k=4, total_tokens=16)
    return make_drafter(spec, model, tokenizer)


@pytest.mark.parametrize("spec", ["ngram:min=1", "suffix", "draft", "eagle", "none"])
def test_a_batch_of_four_answers_as_generate_does(pair, spec):
    model, tokenizer = pair
    ids = [tokenizer.encode(p) for p in PROMPTS]
    want = [generate(model, tokenizer, p, drafter=_drafter(spec, model, tokenizer), num_draft_tokens=4,
                     max_tokens=40, stop_tokens=set()).tokens for p in ids]
    runner = _runner(model, tokenizer, lambda: _drafter(spec, model, tokenizer))
    try:
        assert runner.batched
        sinks = [Collect() for _ in ids]
        for prompt, sink in zip(ids, sinks):
            runner.submit(Request(prompt, 40, SamplingParams(), None, (), sink))
        for sink in sinks:
            assert sink.done.wait(120)
    finally:
        assert runner.close()
    rounds = [r.round for s in sinks for r in s.records if isinstance(r, Committed)]
    assert max(r.rows for r in rounds) == 4
    assert sum(r.num_drafted for r in rounds) > 0 or spec == "none"  # plain decoding batches too
    for prompt, sink, tokens in zip(ids, sinks, want):
        assert isinstance(sink.end, Done) and sink.end.finish_reason == "length"
        if sink.tokens != tokens:
            assert _near_tie(model, prompt, sink.tokens, tokens) < 1e-4


def test_a_burst_fills_the_free_rows_before_the_queue_refuses(pair):
    """``queue_size`` counts the requests waiting beyond the free rows: a burst of ``max_batch + queue_size``
    requests sent at once is taken whole (before, requests not yet admitted between two rounds filled the
    queue and a burst met 503s with rows free), the next one is refused."""
    from mlxspec.engine.runner import QueueFull

    model, tokenizer = pair
    runner = Runner(max_batch=3, queue_size=2)
    runner.start()
    runner.call(lambda: runner.use(Setup(model, tokenizer, make_drafter("ngram:min=1"), 3)))
    sinks, busy, release = [Collect() for _ in range(5)], threading.Event(), threading.Event()
    # the runner thread busy (as in a round) while the burst arrives: nothing is admitted meanwhile
    holder = threading.Thread(target=runner.call, args=(lambda: busy.set() or release.wait(60),))
    holder.start()
    try:
        assert busy.wait(60)
        for sink in sinks:
            runner.submit(Request([1, 2, 3], 100_000, SamplingParams(), None, (), sink))
        with pytest.raises(QueueFull):
            runner.submit(Request([1, 2, 3], 100_000, SamplingParams(), None, (), Collect()))
        release.set()
        holder.join()
        runner.cancel_all()
        for sink in sinks:
            assert sink.done.wait(60)
    finally:
        assert runner.close()


def test_generations_join_and_leave_between_rounds(pair):
    """Continuous batching: later requests join a running batch; each answer is still its own greedy
    answer."""
    model, tokenizer = pair
    ids = [tokenizer.encode(p) for p in PROMPTS]
    lengths = [30, 8, 50, 20]
    want = [generate(model, tokenizer, p, drafter="ngram:min=1", num_draft_tokens=3, max_tokens=n,
                     stop_tokens=set()).tokens for p, n in zip(ids, lengths)]
    runner = _runner(model, tokenizer, lambda: make_drafter("ngram:min=1"), max_batch=3, gamma=3)
    sinks = [Collect() for _ in ids]
    try:
        runner.submit(Request(ids[0], lengths[0], SamplingParams(), None, (), sinks[0]))
        runner.submit(Request(ids[1], lengths[1], SamplingParams(), None, (), sinks[1]))
        assert sinks[1].done.wait(60)
        for i in (2, 3):
            runner.submit(Request(ids[i], lengths[i], SamplingParams(), None, (), sinks[i]))
        for sink in sinks:
            assert sink.done.wait(60)
    finally:
        assert runner.close()
    assert [s.tokens for s in sinks] == want
    assert any(r.round.rows == 3 for s in sinks for r in s.records if isinstance(r, Committed))
    totals = [s.end.stats for s in sinks]
    assert [t.generation_tokens for t in totals] == lengths


def test_a_long_prompt_is_prefilled_between_the_rounds_of_others_and_leaves_within_a_chunk(pair):
    model, tokenizer = pair
    short = tokenizer.encode(PROMPTS[0])
    long_prompt = list(np.random.default_rng(0).integers(3, 200, size=1500))
    runner = _runner(model, tokenizer, lambda: make_drafter("ngram:min=1"), prefill_chunk=32)
    quick, slow_one = Collect(), Collect()
    try:
        runner.submit(Request(long_prompt, 20, SamplingParams(), None, (), slow_one))
        runner.submit(Request(short, 24, SamplingParams(), None, (), quick))
        assert quick.done.wait(60)
        # the short answer streamed and ended while the long prompt was still being prefilled
        assert not any(isinstance(r, Committed) for r in slow_one.records)
        cancelled_at = runner.prefill_tokens
        request_cancel = next(iter(runner._running))
        request_cancel.cancelled.set()
        assert slow_one.done.wait(60)
    finally:
        assert runner.close()
    assert isinstance(slow_one.end, Done) and slow_one.end.finish_reason == "cancelled"
    assert runner.prefill_tokens - cancelled_at <= 32  # at most the chunk in flight
    assert runner.prefill_tokens < len(long_prompt) - 1


def test_a_bad_request_is_refused_alone(pair):
    model, tokenizer = pair
    runner = _runner(model, tokenizer, lambda: make_drafter("ngram:min=1"))
    good, bad = Collect(), Collect()
    try:
        runner.submit(Request([1, 2, 999_999], 5, SamplingParams(), None, (), bad))
        runner.submit(Request(tokenizer.encode(PROMPTS[1]), 5, SamplingParams(), None, (), good))
        assert bad.done.wait(30) and good.done.wait(30)
    finally:
        assert runner.close()
    assert isinstance(bad.end, Failed) and bad.end.status == 400 and "999999" in bad.end.message
    assert isinstance(good.end, Done) and len(good.tokens) == 5


# --- exactness at temperature > 0 (statistical)
# ------------------------------------------------------------------

V = 8
T08 = SamplingParams(temp=0.8)
ROW_PROMPTS = [[1, 2, 3, 1, 2], [4, 5, 4, 5, 4], [7, 1, 7], [2, 2, 6, 2, 2, 6]]
ROW_KINDS = ["draft", "ngram", "draft", "ngram"]
SAMPLES = 500  # the broken controls fail at 800 by 2.2–4.7× their bound: at 500 with P ≥ 0.9998


@pytest.fixture(scope="module")
def small():
    return tiny_llama(seed=0, vocab_size=V, sharpen=3.0), tiny_llama(seed=7, vocab_size=V, sharpen=3.0)


def _exact_joint(model, prompt, params, length=2):
    from test_lossless import reference_probs

    joint = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, p in joint.items():
            logits = np.array(model(mx.array(prompt + list(seq))[None])[0, -1])
            for t, pt in enumerate(reference_probs(logits, prompt + list(seq), params)):
                if p * pt > 0:
                    nxt[seq + (t,)] = p * pt
        joint = nxt
    return joint


def _sample_rows(small, batch_type=Batch, n=SAMPLES):
    """Counts of each row's first two tokens over ``n`` batches of the four rows verified together."""
    target, draft = small
    bases = {"draft": make_drafter("draft", target, list(range(V)), draft_model=draft),
             "ngram": make_drafter("ngram:min=1", target, list(range(V)))}
    counts = [Counter() for _ in ROW_PROMPTS]
    for i in range(n):
        batch = batch_type(target)
        rows = [_row(target, None, p, bases[k].fork(), T08, gamma=3, max_tokens=2, seed=i * 7 + b)
                for b, (p, k) in enumerate(zip(ROW_PROMPTS, ROW_KINDS))]
        for row in rows:
            batch.add(row)
        out = {id(r): [] for r in rows}
        while batch.rows:
            for result in batch.round():
                out[id(result.row)] += result.tokens
                if result.finish_reason:
                    batch.remove(result.row)
        for b, row in enumerate(rows):
            counts[b][tuple(out[id(row)][:2])] += 1
    return counts


class CutAtTheShortest(Batch):
    """The known batch bug, for the control: every row is cut to the batch's shortest acceptance, and a row
    cut inside its accepted drafts takes a fresh sample from the target there (instead of its own accepted
    draft)."""

    def outcomes(self, drafts, judged, logits):
        results = super().outcomes(drafts, judged, logits)
        shortest = min(len(path) for path, _, _ in results)
        cut = []
        for b, (path, tokens, kinds) in enumerate(results):
            if len(path) > shortest:
                node = path[shortest - 1] if shortest else 0
                fresh = int(mx.random.categorical(logits[b, node] / T08.temp).item())
                path, tokens, kinds = (
                    path[:shortest],
                    tokens[:shortest] + [fresh],
                    kinds[:shortest] + ["target"],
                )
            cut.append((path, tokens, kinds))
        return cut


@pytest.mark.slow  # statistical
def test_rows_verified_together_follow_the_target_at_temperature(small):
    counts = _sample_rows(small)
    for prompt, observed in zip(ROW_PROMPTS, counts):
        from stats import chi_square

        stat, critical = chi_square(observed, _exact_joint(small[0], prompt, T08))
        assert stat < critical, f"row {prompt}: chi-square {stat:.1f} >= {critical:.1f}"


@pytest.mark.slow  # statistical
def test_the_same_test_rejects_rows_cut_at_the_batchs_shortest_acceptance(small):
    from stats import chi_square

    counts = _sample_rows(small, CutAtTheShortest)
    stats = [chi_square(observed, _exact_joint(small[0], prompt, T08))
             for prompt, observed in zip(ROW_PROMPTS, counts)]
    assert any(stat > critical for stat, critical in stats), stats


def test_an_answer_cut_inside_a_character_ends_on_the_last_whole_one():
    """A ``max_tokens`` cut after the first byte of "é" drops the incomplete byte (no trailing U+FFFD) in the
    events, hence in the server's text, the stream and ``result.text`` alike."""
    from mlxspec.core.metrics import GenerationStats, RoundStats
    from mlxspec.engine.output import Output

    tokenizer = byte_tokenizer()
    a, e_first = tokenizer.encode("aé", add_special_tokens=False)[:2]

    def text(finish_reason):
        output = Output(tokenizer, GenerationStats(), set(), (), None, False)
        events = output.round(
            [a, e_first], ["target", "target"], RoundStats(0, 0, 0, 2, 0.0, 0.0), finish_reason
        )
        return "".join(event.text for event in events)

    assert text("length") == "a"
    assert text(None) == "a"  # still streaming: the byte waits for the rest of its character


def test_batch_generate_answers_each_prompt_as_generate_does(pair):
    from mlxspec import batch_generate

    model, tokenizer = pair
    results = batch_generate(
        model, tokenizer, PROMPTS, drafter="ngram:min=1", num_draft_tokens=3, max_tokens=24, max_batch=3
    )
    for prompt, result in zip(PROMPTS, results):
        alone = generate(model, tokenizer, prompt, drafter="ngram:min=1", num_draft_tokens=3, max_tokens=24)
        assert (result.tokens, result.text) == (alone.tokens, alone.text)
        assert result.stats.generation_tokens == len(result.tokens)
    with pytest.raises(ValueError, match="prompt 1: .*999999"):
        batch_generate(model, tokenizer, ["ok", [1, 999_999]], max_tokens=2)
    with pytest.raises(ValueError, match="^max_batch must be >= 1, got 0$"):  # the API's name, not the flag's
        batch_generate(model, tokenizer, ["ok"], max_tokens=2, max_batch=0)


def test_batch_generate_checks_its_arguments_as_generate_does(pair):
    """Each bad argument is refused in one line naming it (and the prompt's index) before anything runs; a
    stop string is one string, as generate takes it (a tester's trial: ``stop="Paris"`` stopped at the
    first 'a')."""
    from mlxspec import batch_generate

    model, tokenizer = pair
    refused = [
        (dict(prompts="hello"), TypeError, "^prompts must be a list of prompts .* got str$"),
        (dict(prompts=["ok", b"hi"]), TypeError, r"^prompt 1 must be text \(str\) or a list of token ids"),
        (dict(prompts=[[1.5, 2.0]]), TypeError, "^prompt 0 must be text"),
        (dict(prompts=["ok", None]), TypeError, "^prompt 1 must be text .* got NoneType$"),
        (dict(prompts=["ok", ""]), ValueError, "^prompt 1: the prompt is empty"),
        (dict(max_tokens=0), ValueError, "^max_tokens must be >= 1, got 0$"),
        (dict(max_batch=2.5), TypeError, "^max_batch must be an integer, got 2.5$"),
        (dict(max_batch=True), TypeError, "^max_batch must be an integer, got True$"),
        (dict(seed="a"), ValueError, "^seed must be an integer"),
        (dict(sampling={"temp": 0}), TypeError, "^sampling must be a SamplingParams"),
        (dict(stop=5), TypeError, "^stop must be text"),
    ]
    for bad, error, message in refused:
        kwargs = {"prompts": ["ok", [1, 2, 3]], "max_tokens": 2, **bad}
        with pytest.raises(error, match=message):
            batch_generate(model, tokenizer, kwargs.pop("prompts"), **kwargs)
    prompt = PROMPTS[0]
    text = generate(model, tokenizer, prompt, max_tokens=40).text
    # a two-character stop whose second character occurs alone earlier: the string stops later than its
    # characters would
    k = next(k for k in range(1, len(text) - 1) if text[k : k + 2].isascii() and text[k + 1] in text[:k]
             and text[k : k + 2] not in text[: k + 1])
    stop = text[k : k + 2]
    got = batch_generate(model, tokenizer, [prompt], max_tokens=40, stop=stop)[0].text
    assert got == generate(model, tokenizer, prompt, max_tokens=40, stop=stop).text == text[:k]


def test_the_batch_gate_decodes_plainly_where_drafts_cannot_pay_and_looks_again_later():
    from mlxspec.drafters import DraftProfile, Plan
    from mlxspec.pacing import AcceptanceEstimate, Auto, BatchGate, Costs
    from mlxspec.pacing.policies import FIRST_WAIT

    def pacers(verify_s, alpha, n=4):
        estimate = AcceptanceEstimate(kept=[100 * alpha] * 4, reached=[100.0] * 4)
        return [Auto(Costs(verify_s), DraftProfile(), estimate=estimate) for _ in range(n)]

    plans = [Plan(4)] * 4
    memory_bound = [0.1 + 0.002 * k for k in range(16)]  # a wide forward costs about one step
    compute_bound = [0.1 * (k + 1) for k in range(16)]  # every token costs a step (a busy GPU, a large batch)
    gate = BatchGate()
    assert gate.admit(pacers(memory_bound, 0.8), plans) == plans
    assert gate.admit(pacers(compute_bound, 0.5), plans) == [Plan(0)] * 4
    waited = [gate.admit(pacers(compute_bound, 0.5), plans) for _ in range(FIRST_WAIT)]
    assert waited[:-1] == [[Plan(0)] * 4] * (FIRST_WAIT - 1)
    assert waited[-1] == [Plan(1)] * 4  # then one probe, at the cap that loses least
    assert gate.admit(pacers(compute_bound, 0.5), plans) == [Plan(0)] * 4 and gate.wait == 2 * FIRST_WAIT
    # one row: its own pacer decides
    assert BatchGate().admit(pacers(compute_bound, 0.5, n=1), plans[:1]) == plans[:1]


def test_the_batch_gate_prices_the_measured_cost_of_rows_times_tokens():
    """One row's curve is memory-bound (16 tokens cost little more than 1), but 4 rows × 5 tokens cost 4.2
    plain steps on the measured batch curve: the gate follows the batch curve, not one row's curve at Σ
    tokens; and a batch whose widest row asks for 8 is capped where the rate is best (at α 0.7, 3)."""
    from mlxspec.drafters import DraftProfile, Plan
    from mlxspec.pacing import AcceptanceEstimate, Auto, BatchGate, Costs
    from mlxspec.pacing.costs import ROWS_GRID, ROWS_WIDTHS

    one_row = [0.1 + 0.002 * k for k in range(16)]
    # a batch as memory-bound as one row; and one where 4 rows × 5 tokens cost 4.2 steps
    cheap = [[0.1 * (1 + 0.01 * r * k) for k in ROWS_WIDTHS] for r in ROWS_GRID]
    steep = [[0.1 * (1 + 0.2 * r * (k - 1)) for k in ROWS_WIDTHS] for r in ROWS_GRID]
    estimate = AcceptanceEstimate(kept=[70.0] * 8, reached=[100.0] * 8)

    def pacers(rows_s):
        return [Auto(Costs(one_row, rows_s=rows_s), DraftProfile(), estimate=estimate) for _ in range(4)]

    assert Costs(one_row, rows_s=steep).verify_rows(4, 5) == pytest.approx(0.1 * (1 + 0.2 * 4 * 4))
    assert Costs(one_row, rows_s=steep).verify_rows(3, 1) == pytest.approx(0.1)  # between grid rows
    # unmeasured: one row over R·k tokens
    assert Costs(one_row).verify_rows(4, 5) == Costs(one_row).verify(20)
    plans = [Plan(4)] * 4
    assert BatchGate().admit(pacers(cheap), plans) == plans
    assert BatchGate().admit(pacers(steep), plans) == [Plan(0)] * 4
    assert BatchGate().admit(pacers(None), plans) == plans  # one row's curve at 20 tokens: it would pay
    ragged = [Plan(8), Plan(1), Plan(1), Plan(1)]
    assert BatchGate().admit(pacers(cheap), ragged) == [Plan(3), Plan(1), Plan(1), Plan(1)]
    assert Costs(one_row, rows_s=cheap).verify_rows(4, 9) > Costs(one_row, rows_s=cheap).verify_rows(4, 3)


def test_the_batch_gate_caps_gamma_where_the_whole_batch_is_fastest():
    """Each row's own pacer asks for γ 15 (one row's curve is flat), but 4 rows × 16 tokens cost 5.8 plain
    steps: uncapped that loses to plain batched decoding (19.4 tokens per 0.58 s against 4 per 0.1 s), capped
    at 3 it wins (11.8 per 0.196 s), so the batch drafts 3 deep instead of decoding plainly."""
    from mlxspec.drafters import DraftProfile, Plan
    from mlxspec.pacing import AcceptanceEstimate, Auto, BatchGate, Costs
    from mlxspec.pacing.costs import ROWS_GRID, ROWS_WIDTHS

    curve = [[0.1 * (1 + 0.08 * r * (k - 1)) for k in ROWS_WIDTHS] for r in ROWS_GRID]
    costs = Costs([0.1 + 0.001 * k for k in range(16)], rows_s=curve)
    estimate = AcceptanceEstimate(kept=[80.0] * 16, reached=[100.0] * 16)
    pacers = [Auto(costs, DraftProfile(), estimate=estimate) for _ in range(4)]
    assert costs.verify_rows(4, 16) == pytest.approx(0.58) and costs.verify_rows(4, 4) == pytest.approx(0.196)
    assert BatchGate().admit(pacers, [Plan(15)] * 4) == [Plan(3)] * 4
    assert BatchGate().admit(pacers, [Plan(2)] * 4) == [Plan(2)] * 4  # a shallower plan is never deepened


def test_a_round_verified_beside_other_rows_teaches_the_learned_costs_nothing():
    """A batch's round times the whole batch's forward, not one row's: γ auto's costs learn only from rows
    alone."""
    from mlxspec.core.metrics import RoundStats
    from mlxspec.pacing import Costs, LearnedCosts

    def learned(rows):
        costs = LearnedCosts(Costs([0.1 * (1 + 0.05 * k) for k in range(16)], draft_s=0.02))
        for index in range(1, 6):  # slow rounds: ten times what the cache predicts
            costs.observe(RoundStats(index, 0, 0, 1, 0.0, 1.0, rows=rows))
            costs.observe(RoundStats(index, 4, 2, 3, 0.5, 2.0, depth=4, gamma=4, rows=rows))
        return costs.verify(5), costs.draft(4)

    alone, beside = learned(1), learned(4)
    untouched = LearnedCosts(Costs([0.1 * (1 + 0.05 * k) for k in range(16)], draft_s=0.02))
    assert beside == (untouched.verify(5), untouched.draft(4))
    assert alone[0] > 2 * beside[0]  # the same rounds alone do teach it
