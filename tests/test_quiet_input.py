"""Input that used to be accepted without a word (issue 46, item 4): one validation of the typical acceptance
for generate and verify, a drafter spec key and its own flag that disagree, an infinite repetition penalty,
``verify --tokens`` past what the test can use."""

from __future__ import annotations

import math

import pytest

from mlxspec import SamplingParams, generate
from mlxspec.engine.arguments import check_typical
from mlxspec.bench.verify_check import MAX_TOKENS, run_check
from test_bad_input import one_line_error


@pytest.mark.parametrize("command", ["generate", "verify"])
@pytest.mark.parametrize("threshold, alpha", [("2", "0.3"), ("0", "0.3"), ("0.09", "0"), ("nan", "0.3"),
                                              ("0.09", "inf")])
def test_typical_acceptance_out_of_range_is_refused_by_generate_and_verify(capsys, tiny_model_dir, command,
                                                                           threshold, alpha):
    """``verify --typical-threshold 2`` used to run (generate refused it): one check
    serves both, before loading."""
    prompt = ["--prompt", "hi"] if command == "generate" else []
    one_line_error(capsys, [command, "--model", str(tiny_model_dir), *prompt, "--temp", "0.7",
                            "--typical-threshold", threshold, "--typical-alpha", alpha],
                   "typical acceptance needs 0 < --typical-threshold <= 1 and --typical-alpha > 0 (finite)")


def test_the_api_refuses_the_same_typical_values(target, tokenizer):
    for bad in [(2, 0.3), (0.09, 0), (float("nan"), 0.3), (0.1, float("inf")), (0.1,), "ab", 0.1]:
        with pytest.raises((ValueError, TypeError), match="typical"):
            generate(target, tokenizer, [5, 6], max_tokens=2, sampling=SamplingParams(temp=0.7), typical=bad)
    assert check_typical(None) is None and check_typical((0.09, 0.3)) == (0.09, 0.3)


@pytest.mark.parametrize("command", ["generate", "verify", "chat"])
def test_a_spec_key_and_its_flag_that_disagree_are_refused_naming_both(capsys, tiny_model_dir, command):
    """``--drafter eagle:depth=4 --eagle-depth 5`` used to run at depth 5 without a word."""
    base = [command, "--model", str(tiny_model_dir)] + (["--prompt", "hi"] if command != "chat" else [])
    one_line_error(capsys, [*base, "--drafter", "eagle:depth=4", "--eagle-depth", "5"],
                   "--drafter eagle:depth=4 and --eagle-depth 5 both set the eagle drafter's depth; keep one")
    one_line_error(capsys, [*base, "--drafter", "ngram:max=3", "--ngram-max", "4"],
                   "--drafter ngram:max=3 and --ngram-max 4 both set the ngram drafter's max; keep one")


def test_a_spec_key_and_its_flag_that_agree_or_set_different_keys_are_taken(tiny_model_dir):
    from mlxspec.commands.common import drafter_spec_from_args
    from mlxspec.commands.generate import setup_arg_parser

    parse = setup_arg_parser().parse_args
    spec = drafter_spec_from_args(parse(["--drafter", "eagle:depth=4", "--eagle-depth", "4"]))
    assert spec.options.depth == 4
    spec = drafter_spec_from_args(parse(["--drafter", "eagle:depth=4", "--eagle-top-k", "2"]))
    assert (spec.options.depth, spec.options.top_k) == (4, 2)
    spec = drafter_spec_from_args(parse(["--drafter", "eagle", "--eagle-depth", "3"]))
    assert spec.options.depth == 3


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_an_infinite_repetition_penalty_is_refused(capsys, tiny_model_dir, value):
    one_line_error(capsys, ["generate", "--model", str(tiny_model_dir), "--prompt", "hi",
                            f"--repetition-penalty={value}"],
                   "repetition_penalty must be > 0 and finite")
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=float(value))


def test_verify_tokens_past_the_bound_are_refused_before_loading(capsys, tiny_model_dir, target):
    """``verify --tokens 100000`` used to start 2,000 samples of 100,000 tokens (days) with no word."""
    one_line_error(capsys, ["verify", "--model", str(tiny_model_dir), "--temp", "0.7", "--tokens", "100000"],
                   f"--tokens must be at most {MAX_TOKENS}")
    with pytest.raises(ValueError, match=f"--tokens must be at most {MAX_TOKENS}"):
        run_check(target, [("x", [5, 6])], None, SamplingParams(temp=0.7), num_tokens=MAX_TOKENS + 1)
    assert MAX_TOKENS >= 3 and math.isfinite(MAX_TOKENS)


def test_bench_refuses_a_drafters_spec_and_a_flag_that_disagree(capsys, monkeypatch):
    import mlxspec.commands.bench as bench

    monkeypatch.setattr(bench, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    one_line_error(capsys, ["bench", "--drafters", "eagle:depth=4,none",
                            "--eagle-depth", "5", "--blas", "keep", "--prompt", "hi"],
                   "--drafters eagle:depth=4 and --eagle-depth 5 both set the eagle drafter's depth; "
                   "keep one")
