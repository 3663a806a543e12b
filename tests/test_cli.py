"""``mlxspec generate`` in-process: streamed text, stats block, JSON record, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import save_tiny_model, tiny_llama
from mlxspec.commands.cli import main


def run(capsys, *argv):
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_streams_text_then_stats(capsys, tiny_model_dir, tiny_draft_dir):
    code, out, err = run(capsys, "--model", str(tiny_model_dir), "--draft-model", str(tiny_draft_dir),
                         "--prompt", "hello", "--max-tokens", "24", "--num-draft-tokens", "3")
    assert code == 0
    assert out.strip()
    for label in ("Prompt:", "Generation: 24 tokens", "Drafter: draft, γ = 3", "α =", "τ =",
                  "Acceptance per draft position:", "Time: draft"):
        assert label in err
    assert "; rounds: " in err and "tokens/round" in err and "cycle" not in err  # the field's word is "round"


def test_json_record_has_every_stat(capsys, tiny_model_dir):
    code, out, err = run(
        capsys,
        "--model",
        str(tiny_model_dir),
        "--drafter",
        "ngram",
        "--prompt",
        "abcabcabc",
        "--max-tokens",
        "16",
        "--json",
        "--temp",
        "0.8",
        "--seed",
        "3",
    )
    assert code == 0 and err == ""
    record = json.loads(out)
    for key in ("text", "model", "alpha", "tau", "acceptance_per_position", "prompt_tps", "generation_tps",
                "rounds", "draft_s", "verify_s", "finish_reason"):
        assert key in record
    assert record["generation_tokens"] == 16 and record["drafter"] == "ngram"


def test_same_seed_same_text(capsys, tiny_model_dir, tiny_draft_dir):
    args = ["--model", str(tiny_model_dir), "--draft-model", str(tiny_draft_dir), "--prompt", "x",
            "--max-tokens", "20", "--temp", "1.0", "--seed", "11", "--json"]
    first = json.loads(run(capsys, *args)[1])["text"]
    assert json.loads(run(capsys, *args)[1])["text"] == first


def test_prompt_from_stdin(tiny_model_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxspec",
            "generate",
            "--model",
            str(tiny_model_dir),
            "--max-tokens",
            "5",
            "--json",
        ],
        input="hello from stdin",
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["prompt_tokens"] > len("hello from stdin")  # chat template applied


@pytest.mark.parametrize("flags,message", [
    (["--num-draft-tokens", "-1"], "--num-draft-tokens must be from 0 to 64"),
    # pacing.MAX_NUM_DRAFT_TOKENS
    (["--num-draft-tokens", "1000"], "--num-draft-tokens must be from 0 to 64"),
    (["--temp", "-1"], "temp must be >= 0"),
    (["--top-p", "0"], r"top_p must be in (0, 1]"),
    (["--top-p", "1.5"], r"top_p must be in (0, 1]"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--drafter", "draft"], "needs a draft model"),
    # not loaded: not silent
    (["--drafter", "ngram", "--draft-model", "/nonexistent"],
     "--draft-model is used by the draft drafter only, but the drafter is ngram"),
    (["--drafter", "none", "--draft-dtype", "float32"], "--draft-dtype is used by the draft drafter only"),
    (["--drafter", "none", "--num-draft-tokens", "4"],
     "--num-draft-tokens 4 is for a drafter, but the drafter is none"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
])
def test_bad_input_is_one_clear_line(capsys, tiny_model_dir, flags, message):
    argv = ["--model", str(tiny_model_dir), "--prompt", "hi", *flags]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("mlxspec: error: ") and err.count("\n") == 1
    assert message in err


def test_mismatched_draft_tokenizer_is_refused(capsys, tmp_path, tiny_model_dir):
    from conftest import byte_tokenizer

    other = byte_tokenizer()
    other._tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    draft_dir = save_tiny_model(tmp_path / "other", tiny_llama(seed=5), other)
    code, _, err = run(
        capsys, "--model", str(tiny_model_dir), "--draft-model", str(draft_dir), "--prompt", "hi"
    )
    assert code == 2 and "tokenizer differs" in err and err.count("\n") == 1


def test_help_lists_commands(capsys):
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out
    assert main(["nope"]) == 2


def test_help_names_every_training_method(capsys):
    from mlxspec.commands.train import METHODS

    assert main(["--help"]) == 0
    train_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  train "))
    names = {"mtp": "MTP", "dflash": "DFlash", "dspark": "DSpark", "eagle": "EAGLE", "medusa": "Medusa",
             "draft": "a draft model", "corpus": "a corpus", "measure": "measure drafters"}
    assert set(METHODS) <= set(names)  # a new method: name it here and in cli.SUBCOMMANDS
    assert [name for name in METHODS if names[name] not in train_line] == []


@pytest.mark.parametrize("command,fix", [
    ("foo", "choose one of generate, chat, train, verify, bench, convert, serve"),
    ("generte", "did you mean 'generate'?"),
    ("--model", "--model comes after a command, as in 'mlxspec generate --model ...'"),
])
def test_an_unknown_command_is_one_line_with_the_fix(capsys, command, fix):
    assert main([command, "--prompt", "hi"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("mlxspec: error: ") and err.count("\n") == 1
    assert fix in err and "run 'mlxspec --help'" in err


def test_ctrl_c_while_a_command_starts_is_one_line(capsys, monkeypatch):
    """Ctrl+C while the command's modules import (seconds: mlx-lm, transformers) exits 130, no traceback."""
    import importlib

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted)
    assert main(["serve", "--port", "1"]) == 130
    out, err = capsys.readouterr()
    assert out == "" and err == "mlxspec: interrupted (Ctrl+C) while starting\n"


def test_the_command_starts_without_importing_mlx():
    """The ``mlxspec`` command imports MLX and mlx-lm only inside the subcommand's import, which turns Ctrl+C
    into one line: ``import mlxspec`` itself is light (its public names load on first use)."""
    code = (
        "import sys, mlxspec.commands.cli, mlxspec; print(sorted(m for m in ('mlx', 'mlx.core', 'mlx_lm', "
        "'transformers') if m in sys.modules)); from mlxspec import load, generate, SamplingParams; "
        "print(callable(generate), 'mlx.core' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["[]", "True True"]


def test_version(capsys):
    from importlib.metadata import version

    for flag in ("--version", "-V"):
        assert main([flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"mlxspec {version('mlxspec')} (mlx ") and out.count("\n") == 1


def test_medusa_from_the_command_line(capsys, tmp_path, tiny_model_dir):
    from test_medusa import random_heads

    from mlxspec.heads.medusa import save_medusa

    save_medusa(tmp_path / "heads", random_heads(shared=True))
    base = ["--model", str(tiny_model_dir), "--prompt", "hello", "--max-tokens", "12", "--drafter", "medusa"]
    code, out, err = run(
        capsys, *base, "--medusa-heads", str(tmp_path / "heads"), "--medusa-tree", "small_15", "--json"
    )
    assert code == 0 and json.loads(out)["drafter"] == "medusa"
    code, _, err = run(capsys, *base, "--medusa-heads", str(tmp_path / "heads"), "--temp", "0.7",
                       "--typical-threshold", "0.09", "--typical-alpha", "0.3")
    assert code == 0 and "LOSSY" in err
    code, _, err = run(capsys, *base)
    assert code == 2 and "no Medusa heads ship for" in err and err.count("\n") == 1
    code, _, err = run(
        capsys, *base, "--medusa-heads", str(tmp_path / "heads"), "--typical-threshold", "0.09"
    )
    assert code == 2 and "needs both --typical-threshold and --typical-alpha" in err
    code, _, err = run(capsys, *base, "--medusa-heads", str(tmp_path / "heads"), "--medusa-tree", "nope")
    assert code == 2 and "unknown Medusa tree" in err


@pytest.mark.parametrize("flags,message", [
    (["--temp", "abc"], "argument --temp: invalid float value: 'abc'"),
    (["--seed", "-5"], "argument --seed: must be in [0, 2**64), got -5"),
    (["--dtype", "int8"], "argument --dtype: invalid choice"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_flag_parsing_errors_are_one_line_too(capsys, flags, message):
    with pytest.raises(SystemExit) as stop:
        main(["generate", "--prompt", "hi", *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert err.startswith("mlxspec: error: ") and message in err and "mlxspec generate --help" in err


def test_a_bad_draft_model_is_named_as_such(capsys, tiny_model_dir):
    code, _, err = run(
        capsys, "--model", str(tiny_model_dir), "--draft-model", "/nope/draft", "--prompt", "hi"
    )
    assert code == 2 and err.startswith("mlxspec: error: draft model: ") and "/nope/draft" in err


def test_tree_stats_name_the_tree_and_explain_alpha(capsys, tiny_model_dir, tmp_path, monkeypatch):
    import mlxspec.pacing as gamma
    from mlxspec.pacing import Costs
    from mlxspec.heads.eagle import save_eagle
    from mlxspec.heads.medusa import save_medusa
    from test_eagle import random_head
    from test_medusa import random_heads

    # γ auto prices the tree (pacing.make_pacer): on costs where drafting pays it keeps the tree's depth
    monkeypatch.setattr(
        gamma, "load_or_calibrate", lambda *a, **k: Costs([0.01 + 0.0001 * k for k in range(16)])
    )
    save_medusa(tmp_path / "medusa", random_heads(shared=True))
    save_eagle(random_head(1), tmp_path / "eagle")
    base = ["--model", str(tiny_model_dir), "--prompt", "abcabcabc", "--max-tokens", "8"]
    code, _, err = run(
        capsys, *base, "--drafter", "medusa:tree=small_15", "--medusa-heads", str(tmp_path / "medusa")
    )
    assert code == 0, err
    # picked each round
    assert "Drafter: medusa, tree small_15 (15 nodes, depth 3); depth γ = auto (mean " in err
    assert "Acceptance per depth:" in err and "(a tree: α = accepted / all drafted nodes" in err
    code, _, err = run(capsys, *base, "--drafter", "eagle:depth=3,top_k=1,ngram=4", "--eagle-heads",
                       str(tmp_path / "eagle"))
    assert code == 0, err
    assert "Drafter: eagle, depth-3 chain + a 4-token n-gram branch;" in err
    code, _, err = run(capsys, *base, "--drafter", "eagle:depth=3,top_k=1,ngram=4", "--eagle-heads",
                       str(tmp_path / "eagle"), "--num-draft-tokens", "2")  # a fixed γ below the tree's depth
    assert (
        code == 0 and "Drafter: eagle, depth-3 chain + a 4-token n-gram branch, cut to depth 2 by γ;" in err
    )
    code, _, err = run(capsys, *base, "--drafter", "ngram", "--num-draft-tokens", "3")
    # the lookup found nothing: no γ (issue 50)
    assert "Drafter: ngram, drafted 0;" in err and "(a tree" not in err
    assert "Acceptance per draft position: -" in err and "α = –" in err


def test_a_medusa_tree_priced_as_plain_says_so(capsys, tiny_model_dir, tmp_path, monkeypatch):
    import mlxspec.pacing as pacing
    from mlxspec.heads.medusa import save_medusa
    from test_medusa import random_heads

    save_medusa(tmp_path / "medusa", random_heads(shared=True))
    steep = pacing.Costs([0.01 * k for k in range(1, 17)])  # k tokens cost k steps: no tree can pay
    monkeypatch.setattr(pacing, "load_or_calibrate", lambda *a, **k: steep)
    code, _, err = run(capsys, "--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "4",
                       "--drafter", "medusa", "--medusa-heads", str(tmp_path / "medusa"))
    assert code == 0, err
    # it rests 16 rounds before a probe (issue 50)
    assert ("Drafter: medusa, tree mc_sim_7b_63 (63 nodes, depth 4, the nodes this machine's verify cost "
            "pays for, each round); drafted 0; rounds: 4" in err)
    assert "(a tree" not in err


def test_a_tree_that_drafted_nothing_says_so():
    """A tree pruned to nothing every round (Medusa's ``auto`` tree on a machine where no node pays) says
    so."""
    from types import SimpleNamespace

    from mlxspec.commands.generate import format_stats
    from mlxspec.core.metrics import GenerationStats

    tree = SimpleNamespace(
        makes_trees=True,
        profile=SimpleNamespace(max_depth=4, plain=False),
        vocab_summary=lambda: None,
        describe=lambda: "tree mc_sim_7b_63 (63 nodes, depth 4)",
    )
    stats = GenerationStats(drafter="medusa", num_draft_tokens=4, rounds=64, generation_tokens=64)
    assert "Drafter: medusa, tree mc_sim_7b_63 (63 nodes, depth 4); drafted 0; rounds: 64" in \
        format_stats(stats, tree)
    stats.drafted = 3
    assert "drafted 0" not in format_stats(stats, tree)


def test_every_help_is_plain_text_from_a_capital():
    """What --help prints is read by people: a description that starts a sentence, no RST ``markup``."""
    import argparse
    import importlib

    from mlxspec.commands.cli import SUBCOMMANDS

    def parsers(parser, name):
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    yield from parsers(child, f"{name} {sub}")

    for command, (module, _) in SUBCOMMANDS.items():
        for name, parser in parsers(importlib.import_module(module).setup_arg_parser(), command):
            assert parser.description and parser.description[0].isupper(), name
            assert "``" not in parser.format_help(), name


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_while_loading_or_measuring_says_so_in_one_line(capsys, tiny_model_dir, monkeypatch, as_json):
    from mlxspec.commands import generate as command

    real_load = command.load_models

    def interrupted_load(*args, **kwargs):
        raise KeyboardInterrupt  # as a Ctrl+C while the weights are read

    def interrupted_measure(num_draft_tokens, model, drafter, *, costs=None, on_measure=None):
        on_measure("the verify cost")
        raise KeyboardInterrupt  # as a Ctrl+C during the measurement

    argv = [
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "hello",
        "--no-chat-template",
        *(["--json"] if as_json else []),
    ]
    monkeypatch.setattr(command, "load_models", interrupted_load)
    code, out, err = run(capsys, *argv)
    assert (code, out) == (130, "")
    assert err == "mlxspec: interrupted (Ctrl+C) while loading the models; nothing was generated\n"
    monkeypatch.setattr(command, "load_models", real_load)
    monkeypatch.setattr(command, "make_pacer", interrupted_measure)
    code, out, err = run(capsys, *argv)
    assert (code, out) == (130, "")
    assert err.splitlines()[-1] == (
        "mlxspec: interrupted (Ctrl+C) while measuring the verify cost on this machine; nothing was generated"
    )
    assert len(err.splitlines()) == (1 if as_json else 2)  # without --json, the measuring note first


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_mid_answer_ends_the_line_and_says_how_far_it_got(
    capsys, tiny_model_dir, monkeypatch, as_json
):
    from mlxspec.commands import generate as command
    from mlxspec.core.metrics import TokenEvent

    real = command.stream_generate

    def interrupted_after_five(*args, **kwargs):
        seen = 0
        for event in real(*args, **kwargs):
            yield event
            seen += isinstance(event, TokenEvent)
            if seen == 5:
                raise KeyboardInterrupt  # as a Ctrl+C during the next round

    monkeypatch.setattr(command, "stream_generate", interrupted_after_five)
    code, out, err = run(capsys, "--model", str(tiny_model_dir), "--prompt", "hello", "--max-tokens", "20",
                         "--drafter", "none", "--no-chat-template", *(["--json"] if as_json else []))
    assert code == 130 and err.count("\n") == 1
    assert err.startswith("mlxspec: interrupted (Ctrl+C) after 5 generated tokens; ")
    if as_json:
        assert out == "" and "--json prints no record" in err
    else:
        assert out.endswith("\n") and out.strip() and "the partial answer is on standard output" in err


def test_a_quantized_target_on_the_cpu_gets_a_note_to_dequantize(capsys, tmp_path, tiny_model_dir):
    """MLX's CPU backend has no fast quantized kernels: ``generate`` says so once, and not for a float
    target."""
    import json as json_module

    import mlx.nn as nn

    from conftest import byte_tokenizer, save_tiny_model, tiny_llama

    model = tiny_llama(seed=0)
    nn.quantize(model, group_size=32, bits=4)
    folder = save_tiny_model(tmp_path / "q4", model, byte_tokenizer())
    config = json_module.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json_module.dumps(config))
    note = "the target is quantized and MLX runs on the CPU here"
    cases = ((folder, [], 1), (folder, ["--dtype", "float32"], 0), (tiny_model_dir, [], 0))
    for path, dtype, expected in cases:
        assert (
            main(["generate", "--model", str(path), "--prompt", "hi", "-m", "2", "--drafter", "none", *dtype])
            == 0
        )
        assert capsys.readouterr().err.count(note) == expected, (path, dtype)


def test_progress_bars_go_to_a_terminal_stderr_only(monkeypatch, capsys):
    import io

    from mlxspec.runtime import progress

    assert not progress.shows_progress()  # stderr captured (a pipe, a log, pytest, the chat app): no bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setattr("sys.__stderr__", terminal)
    assert progress.shows_progress()
    with progress.progress_bar(3, "mlxspec: measuring the verify cost", "forward", delay_s=0) as bar:
        bar.update(3)
    assert "mlxspec: measuring the verify cost" in terminal.getvalue()
    assert capsys.readouterr().out == ""  # never on stdout, which carries the answer or the JSON


def test_blas_is_named():
    from mlxspec.runtime.machine import blas_in_use

    assert blas_in_use()["name"] in (
        "OpenBLAS",
        "reference BLAS",
        "Accelerate",
        "Intel MKL",
        "BLIS",
        "unknown",
    )


def test_the_tests_run_on_openblas_where_it_is_installed():
    """tests/conftest.py loads it before MLX: an import of MLX ahead of it would leave the slow reference
    BLAS."""
    from conftest import OPENBLAS
    from mlxspec.runtime.machine import blas_in_use

    assert not OPENBLAS or blas_in_use()["name"] == "OpenBLAS", f"MLX uses {blas_in_use()}, not {OPENBLAS}"


def test_a_recurrent_target_under_default_settings_decodes_plainly_in_one_line(tmp_path, capsys, monkeypatch):
    """Its state cannot be rewound: said in one line before any cost measurement, then plain decoding (it used
    to end in a traceback from the verify-cost measurement); asked for by name, the drafter is refused in one
    line."""
    from conftest import byte_tokenizer
    from test_reliability import tiny_mamba

    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    folder = save_tiny_model(tmp_path / "mamba", tiny_mamba(), byte_tokenizer())
    assert main(["generate", "--model", str(folder), "--prompt", "abcabc", "--max-tokens", "6"]) == 0
    err = capsys.readouterr().err
    assert (
        "Traceback" not in err
        and "cannot be rewound" in err
        and "Drafter: none" in err
        and "measuring" not in err
    )
    assert main(["generate", "--model", str(folder), "--prompt", "abc", "--drafter", "ngram"]) == 2
    assert "cannot be rewound" in capsys.readouterr().err


def test_a_prompt_longer_than_the_context_is_refused_before_any_cost_measurement(
    tmp_path, capsys, monkeypatch, tiny_model_dir
):
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "ab" * 2100, "--no-chat-template"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "context is 4096" in err and "measuring" not in err, err
