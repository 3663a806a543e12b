"""``mlxspec verify``: its statistics, that it PASSes exact speculation and FAILs broken or lossy rules
(batched and through the engine's loop), greedy comparison, and the command line."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from conftest import tiny_llama
from mlxspec import pacing as gamma
from mlxspec.commands.cli import main
from mlxspec.drafters import DraftProfile
from mlxspec.pacing import Auto, Costs
from mlxspec.drafters import make_drafter
from mlxspec.core.sampling import SamplingParams
from mlxspec.bench.verify_check import batchable, chi2_sf, g_statistic, holm, run_check

V = 8
PROMPTS = [("repeats", [1, 2, 3, 1, 2]), ("other", [5, 4, 6, 5, 4])]


@pytest.fixture(scope="module")
def models():
    return tiny_llama(seed=0, vocab_size=V, sharpen=3.0), tiny_llama(seed=7, vocab_size=V, sharpen=3.0)


def test_chi2_sf_matches_tabulated_quantiles():
    for statistic, df, p in [(3.841, 1, 0.05), (9.210, 2, 0.01), (11.345, 3, 0.01), (124.342, 100, 0.05),
                             (0.0158, 1, 0.90), (1.0, 4, 0.9098)]:
        assert chi2_sf(statistic, df) == pytest.approx(p, rel=2e-3)
    assert chi2_sf(float("inf"), 3) == 0.0 and chi2_sf(5.0, 0) == 1.0


def test_g_statistic_pools_rare_cells_and_refuses_impossible_tokens():
    probs = np.array([0.5, 0.3, 0.15, 0.04, 0.01, 0.0])
    g, df = g_statistic(Counter({0: 50, 1: 30, 2: 15, 3: 4, 4: 1}), probs)
    assert g == pytest.approx(0.0, abs=1e-9) and df == 3  # tokens 3 and 4 (expected 4 and 1) are one cell
    g, _ = g_statistic(Counter({0: 80, 1: 10, 2: 10}), probs)
    assert g > 30
    assert g_statistic(Counter({5: 1, 0: 99}), probs)[0] == float("inf")


def test_holm_adjusts_step_down():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


@pytest.mark.slow  # statistical
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_exact_speculation_passes_and_a_broken_rule_fails(models, kind):
    target, draft = models
    # min=1: on random text only 1-token matches recur, and the broken rule needs many drafts to show
    drafter = make_drafter("ngram:min=1" if kind == "ngram" else kind, target, list(range(V)),
                           draft_model=draft if kind == "draft" else None)
    assert batchable(drafter) == (kind == "ngram")  # the draft model runs through the engine's loop
    run = dict(num_tokens=3, num_samples=600 if kind == "draft" else 1500, num_draft_tokens=3)
    prompts = PROMPTS[:1] if kind == "draft" else PROMPTS  # the engine's loop is ~10x slower per sample
    sampling = SamplingParams(temp=1.0)
    good = run_check(target, prompts, drafter, sampling, **run)
    assert good.passed and all(c.prefixes_tested >= 3 and c.drafted > 0 for c in good.checks), good
    bad = run_check(target, prompts, drafter, sampling, self_test=True, **run)
    assert not bad.passed and min(c.adjusted_p for c in bad.checks) < 1e-6, bad


@pytest.mark.slow  # statistical
def test_batched_and_engine_samples_pass_alike_with_filters(models):
    target, _ = models
    sampling = SamplingParams(temp=0.8, top_k=4, repetition_penalty=1.3)
    drafter = make_drafter("ngram:min=1")
    for batch in (True, False):
        report = run_check(target, PROMPTS[:1], drafter, sampling, num_tokens=2, num_samples=800, batch=batch)
        assert report.passed and report.checks[0].drafted > 0, report


@pytest.mark.slow  # statistical
def test_gamma_auto_is_checked_through_the_engine_with_rounds_the_drafts_confidence_ends(models):
    """``num_draft_tokens`` a γ policy (what ``generate`` runs by default): the samples go through the
    engine's loop, the policy learns across them, the draft model's rounds end on its own confidence and vary
    in length; the exact rule PASSes, the broken one FAILs."""
    target, draft = models
    drafter = make_drafter("draft", target, list(range(V)), draft_model=draft)
    sizes = Counter()
    propose = drafter.propose

    def counted(history, num_draft_tokens, sampling, plan=None):
        proposal = propose(history, num_draft_tokens, sampling, plan)
        sizes[proposal.size] += 1
        return proposal

    drafter.propose = counted
    costs = Costs([1.0 + 0.1 * (k - 1) for k in range(1, 17)], draft_s=0.05)  # drafting pays; a round ends
    sampling = SamplingParams(temp=1.0)                                      # where survival < 0.15
    good = run_check(target, PROMPTS[:1], drafter, sampling, num_tokens=3, num_samples=600,
                     num_draft_tokens=Auto(costs, DraftProfile(confidence=True)))
    assert good.passed and good.checks[0].drafted > 150 and good.checks[0].prefixes_tested >= 3, good
    assert len([n for n in sizes if n > 0]) >= 2, sizes  # rounds of different lengths were checked
    # the broken rule keeps few drafts, so under these costs γ auto soon falls back to plain decoding and the
    # check loses its power (docs: use an integer γ for --self-test); a flat verify curve that never falls
    # back keeps drafting
    flat = Auto(Costs([1.0] * 16, draft_s=0.0), DraftProfile(confidence=True))
    bad = run_check(target, PROMPTS[:1], drafter, sampling, num_tokens=3, num_samples=600, self_test=True,
                    num_draft_tokens=flat)
    assert not bad.passed and bad.checks[0].adjusted_p < 1e-6, bad
    greedy = run_check(target, PROMPTS, drafter, SamplingParams(), num_tokens=30,
                       num_draft_tokens=Auto(costs, DraftProfile(confidence=True)))
    assert greedy.passed and all(c.drafted > 0 for c in greedy.checks), greedy


@pytest.mark.slow  # statistical
def test_lossy_typical_acceptance_fails(models):
    target, draft = models
    drafter = make_drafter("draft", target, list(range(V)), draft_model=draft)
    report = run_check(target, PROMPTS[:1], drafter, SamplingParams(temp=1.0), num_tokens=3, num_samples=600,
                       typical=(0.3, 0.3))
    assert not report.passed


def test_greedy_is_compared_token_for_token(models):
    target, _ = models
    drafter = make_drafter("ngram")
    assert run_check(target, PROMPTS, drafter, SamplingParams(), num_tokens=40).passed
    broken = run_check(target, PROMPTS, drafter, SamplingParams(), num_tokens=40, self_test=True)
    assert not broken.passed and all(c.mismatch_at is not None for c in broken.checks if not c.passed)


@pytest.mark.slow  # statistical
def test_the_command_prints_a_record_and_exits_by_verdict(tiny_model_dir, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("abab abab abab\n\n")
    base = ["verify", "--model", str(tiny_model_dir), "--drafter", "ngram", "--prompts", str(prompts),
            "--temp", "1", "--samples", "400", "--tokens", "2", "--no-chat-template"]
    assert main([*base, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["passed"] and record["drafter"] == "ngram" and len(record["prompts"]) == 1
    assert record["prompts"][0]["drafted"] > 0
    # the random model gives the n-gram's drafts almost no mass at --temp 1, so the greedy self-test shows
    # power
    # the broken rule was caught
    assert main([*base, "--temp", "0", "--max-tokens", "30", "--self-test"]) == 0
    out = capsys.readouterr().out
    assert "FAIL  differs at token" in out and "detected (FAIL)" in out
    # --num-draft-tokens auto: the policy generate runs (costs from this machine's cache; here a fixed curve)
    monkeypatch.setattr(
        gamma, "load_or_calibrate", lambda *a, **k: Costs([1.0 + 0.1 * (k - 1) for k in range(1, 17)])
    )
    assert main([*base, "--num-draft-tokens", "auto", "--samples", "300", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["passed"] and record["num_draft_tokens"] == "auto" and record["prompts"][0]["drafted"] > 0
    for flags, message in [(["--samples", "0"], "--samples must be >= 1"),
                           # unused at --temp 0: still said
                           (["--temp", "0", "--tokens", "-2"], "--tokens must be >= 1"),
                           (["--num-draft-tokens", "most"], "--num-draft-tokens"),
                           (["--prompts", str(tmp_path / "none.txt")], "is not a file")]:
        try:
            code = main([*base, *flags])
        except SystemExit as stop:  # refused while parsing
            code = stop.code
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and message in err, err


def test_prompts_are_read_from_a_file_a_pipe_or_standard_input(tmp_path, monkeypatch):
    import io
    import os
    import threading
    from types import SimpleNamespace

    from mlxspec.commands.verify import _prompts

    fifo = tmp_path / "prompts.fifo"  # what the shell's <(...) hands over
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("first\n\n second \n"))
    writer.start()
    assert _prompts(SimpleNamespace(prompts=str(fifo))) == ["first", "second"]
    writer.join()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"from stdin\n")))
    assert _prompts(SimpleNamespace(prompts="-")) == ["from stdin"]
    bom = tmp_path / "windows.txt"  # a byte-order mark and CRLF, as Windows editors write
    bom.write_bytes("\ufeffHello\r\nCount to five\r\n".encode())
    assert _prompts(SimpleNamespace(prompts=str(bom))) == ["Hello", "Count to five"]
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    for path, message in [(bad, "is not UTF-8 text (byte 3)"), (tmp_path, "is not a file"),
                          (tmp_path / "blank.txt", "is not a file"), ("", "--prompts is empty")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            _prompts(SimpleNamespace(prompts=str(path)))
