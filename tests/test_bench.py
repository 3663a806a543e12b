"""``mlxspec bench``: end to end on tiny models (every JSON field, sane numbers), systems,
paired speedups, mlx-lm round bookkeeping, and the fast-BLAS re-run."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from mlxspec.bench.runs import BASELINE, CONTROL, RunRecord, make_systems, rounds_from_flags
from mlxspec.bench.summary import summarize
from mlxspec.commands.cli import main
from mlxspec.commands import bench as bench_command
from mlxspec.pacing import Costs

RUN_FIELDS = {"system", "prompt_id", "kind", "temp", "seed", "prompt_tokens", "prompt_s", "generation_tokens",
              "generation_s", "generation_tps", "prompt_tps", "rounds", "draft_s", "verify_s", "gamma_rounds",
              "calibration", "peak_memory_gb", "finish_reason", "output_sha"}
ROW_FIELDS = {"system", "family", "gamma", "kind", "temp", "pairs", "speedup", "speedup_min", "speedup_max",
              "predicted_speedup", "generation_tps", "prompt_tps", "alpha", "alpha_mle", "tau",
              "acceptance_per_position", "tau_histogram", "round_draft_ms",
              "round_verify_ms", "round_other_ms",
              "peak_memory_gb", "same_output", "mean_gamma", "plain_fallback", "best", "note"}


@pytest.fixture(scope="module")
def bench_result(tmp_path_factory, tiny_model_dir, tiny_draft_dir):
    folder = tmp_path_factory.mktemp("bench")
    prompts = folder / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Copy: red green blue red green blue red green",
                                   "kind": "grounded"})
                       + "\n" + json.dumps({"prompt": "Tell me something.", "kind": "open"}) + "\n")
    argv = ["bench", "--model", str(tiny_model_dir), "--draft-model", str(tiny_draft_dir),
            "--prompts", str(prompts),
            "--num-draft-tokens", "auto,2", "--temps", "0,0.7", "--max-tokens", "24",
            "--output", str(folder / "bench.json"), "--blas", "keep"]
    mp = pytest.MonkeyPatch()
    mp.setenv("MLXSPEC_CACHE", str(folder / "cache"))
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            code = main(argv)
    finally:
        mp.undo()
    return code, json.loads((folder / "bench.json").read_text()), stdout.getvalue()


def test_bench_end_to_end_json(bench_result, capsys):
    code, result, _ = bench_result
    assert code == 0
    for key in ("command", "machine", "models", "dtypes", "settings", "prompt_source", "prompt_ids", "costs",
                "systems", "runs", "summary", "elapsed_s"):
        assert key in result
    assert result["machine"]["blas"]["name"] and result["machine"]["versions"]["mlx_lm"]
    assert set(result["costs"]) == {"draft", "ngram"} and len(result["costs"]["draft"]["verify_s"]) == 16
    names = [s["name"] for s in result["systems"]]
    assert names == [BASELINE, CONTROL, "mlx-lm spec γ=2", "mlxspec draft γ=auto", "mlxspec draft γ=2",
                     "mlxspec ngram γ=auto", "mlxspec ngram γ=2", "mlxspec none"]
    assert len(result["runs"]) == len(names) * 2 * 2  # systems × prompts × temperatures
    for run in result["runs"]:
        assert set(run) == RUN_FIELDS
        assert 1 <= run["generation_tokens"] <= 24 and run["generation_s"] > 0 and run["prompt_s"] > 0
        assert run["finish_reason"] in ("stop", "length") and len(run["output_sha"]) == 12
        assert all(0 <= kept <= drafted for drafted, kept in run["rounds"])


def test_bench_summary_is_sane(bench_result):
    rows = bench_result[1]["summary"]
    assert len(rows) == 8 * 2 * 2  # systems × kinds × temperatures
    for row in rows:
        assert set(row) == ROW_FIELDS and row["pairs"] == 1
        if row["system"] == BASELINE:
            assert row["speedup"] == 1.0 and row["predicted_speedup"] == 1.0
        if row["system"] == CONTROL:
            # plain vs itself: one pair of millisecond runs on a busy 2-core machine swings by up to 100x,
            # so check the ratio is the paired one, the right way round, not that it is near 1
            def tps(system):
                return next(r["generation_tps"] for r in bench_result[1]["runs"] if r["system"] == system
                            and r["kind"] == row["kind"] and r["temp"] == row["temp"])  # noqa: B023
            assert row["speedup"] == pytest.approx(tps(CONTROL) / tps(BASELINE), rel=1e-6)
        if row["alpha"] is not None:
            assert 0 <= row["alpha"] <= 1 and row["tau"] >= 1 and row["predicted_speedup"] > 0
            assert all(0 <= a <= 1 for a in row["acceptance_per_position"])
        if row["temp"] == 0:
            assert row["same_output"] == 1.0  # float32: every lossless system reproduces greedy decoding
        if row["gamma"] == "auto":
            assert row["mean_gamma"] is not None and 0 <= row["plain_fallback"] <= 1
    grounded_ngram = [r for r in rows if r["system"] == "mlxspec ngram γ=2" and r["kind"] == "grounded"]
    assert any(r["alpha"] for r in grounded_ngram)  # a repetitive prompt gives the n-gram drafter hits


def test_bench_prints_header_and_tables(bench_result):
    stdout = bench_result[2]
    for line in ("mlxspec bench", "BLAS: ", "costs (draft): T_verify(1, 2, 4, 8, 16) = ", "target: ",
                 "| kind | temp | system | tok/s | speedup (min–max) | predicted |", "wrote "):
        assert line in stdout
    # one fixed γ: the best-γ table would repeat the full one, so only the full one is printed
    assert "Best fixed γ" not in stdout and stdout.count("Every system") == 1
    assert "| mlxspec ngram γ=2 * |" in stdout and "mlxspec ngram γ=auto" in stdout
    assert stdout.count("| grounded | 0.7 | mlxspec draft γ=2") == 1
    assert stdout.count("Verdict (") == 4  # one per kind × temperature, after the tables
    assert stdout.rindex("Verdict (") > stdout.rindex("Every system")


def test_make_systems():
    systems = make_systems(["ngram", "none"], ["auto", 1, 4], has_draft_model=False, control=False)
    assert [s.name for s in systems] == [BASELINE, "mlxspec ngram γ=auto", "mlxspec ngram γ=1",
                                         "mlxspec ngram γ=4", "mlxspec none"]
    with pytest.raises(ValueError, match="needs --draft-model"):
        make_systems(["draft"], [2], has_draft_model=False)
    with pytest.raises(ValueError, match="integer >= 1"):
        make_systems(["ngram"], [0], has_draft_model=False)


def test_rounds_from_mlx_lm_flags():
    # γ = 3: round 1 kept 2 (+ its target token), round 2 kept 0, round 3 kept 3 and was cut by the stop
    flags = [True, True, False, False, True, True, True]
    assert rounds_from_flags(flags, 3) == [[3, 2], [3, 0], [3, 3]]


def test_speedup_is_the_median_of_paired_ratios():
    def run(system, prompt, tps, sha="x"):
        return RunRecord(system, prompt, "open", 0.0, 0, 10, 1.0, int(tps), 1.0,
                         rounds=[[2, 1]] if system != BASELINE
                         else [], output_sha=sha)

    runs = [run(BASELINE, "p1", 10), run(BASELINE, "p2", 20), run(BASELINE, "p3", 40),
            run("mlxspec ngram γ=2", "p1", 30), run("mlxspec ngram γ=2", "p2", 20, "y"),
            run("mlxspec ngram γ=2", "p3", 60)]
    systems = make_systems(["ngram"], [2], has_draft_model=False, control=False)
    costs = {"ngram": Costs([1.0 + 0.1 * k for k in range(16)])}
    rows = {r.system: r for r in summarize(runs, systems, costs)}
    row = rows["mlxspec ngram γ=2"]
    assert row.speedup == 1.5 and (row.speedup_min, row.speedup_max) == (1.0, 3.0)  # ratios 3, 1, 1.5
    assert row.same_output == pytest.approx(2 / 3) and row.best
    assert row.alpha == 0.5 and row.tau == 2.0
    assert row.predicted_speedup == pytest.approx(costs["ngram"].speedup(2, 0.5))


@pytest.mark.parametrize("command", ["bench", "generate", "chat", "verify"])
def test_reruns_with_openblas_when_the_reference_blas_is_loaded(monkeypatch, command, capsys):
    """From the command line (cli.main() reading sys.argv) only; a call from Python never re-executes."""
    from mlxspec.commands import common

    calls = []
    monkeypatch.delenv(common.REEXEC_ENV, raising=False)
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setattr(common, "blas_in_use", lambda: {"name": "reference BLAS"})
    monkeypatch.setattr(common, "find_fast_blas", lambda: "/opt/libblas.so.3")

    def execve(exe, argv, env):
        calls.append((argv, env))
        raise SystemExit(0)  # as the real one, which never returns

    monkeypatch.setattr("os.execve", execve)
    flags = ["--max-tokens", "-1"]  # the re-run would report it; this process must not get that far
    monkeypatch.setattr("sys.argv", ["mlxspec", command, *flags, "--blas", "keep"])
    assert main() == 2 and calls == []
    monkeypatch.setattr("sys.argv", ["mlxspec", command, *flags])
    with pytest.raises(SystemExit):
        main()
    argv, env = calls[0]
    assert argv[1:] == ["-m", "mlxspec", command, *flags]
    assert env["LD_PRELOAD"].startswith("/opt/libblas.so.3") and env[common.REEXEC_ENV] == "1"
    assert main([command, *flags]) == 2 and len(calls) == 1  # called from Python: runs as is
    monkeypatch.setattr(common, "find_fast_blas", lambda: None)
    monkeypatch.setattr("sys.argv", ["mlxspec", command, *flags])
    capsys.readouterr()
    assert main() == 2 and len(calls) == 1
    assert "apt-get install libopenblas0-pthread" in capsys.readouterr().err


def test_the_rerun_line_is_a_shell_command(monkeypatch, capsys):
    """bench prints the command it re-runs with OpenBLAS: pasted into a shell, it runs the same thing."""
    import shlex
    import sys

    from mlxspec.commands import common

    monkeypatch.delenv(common.REEXEC_ENV, raising=False)
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setattr(common, "blas_in_use", lambda: {"name": "reference BLAS"})
    monkeypatch.setattr(common, "find_fast_blas", lambda: "/opt/open blas/libblas.so.3")

    def execve(exe, argv, env):
        raise SystemExit(0)

    monkeypatch.setattr("os.execve", execve)
    flags = ["--prompt", "What's 2 + 2? Say \"four\".", "--model", "my model"]
    monkeypatch.setattr("sys.argv", ["mlxspec", "bench", *flags])
    with pytest.raises(SystemExit):
        main()
    line = capsys.readouterr().err.strip()
    assert line.startswith("mlxspec bench: re-running with a fast BLAS (--blas keep to skip): LD_PRELOAD=")
    words = shlex.split(line.split(" (--blas keep to skip): ", 1)[1])
    assert words == ["LD_PRELOAD=/opt/open blas/libblas.so.3", sys.executable, "-m",
                     "mlxspec", "bench", *flags]


def test_a_prompt_over_the_context_is_refused_before_the_first_run(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    """Every prompt's length is checked before the first run (issue 50: a prompt over the context
    ran the mlx-lm baseline for minutes, then failed): one line naming the prompt and the
    context, exit 2, nothing run."""
    import mlxspec.commands.bench as command

    ran = []
    monkeypatch.setattr(command, "iter_runs", lambda *a, **k: ran.append(a) or iter(()))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hi.", "kind": "open"}) + "\n"
                       + json.dumps({"prompt": "ab" * 2100, "kind": "open", "id": "long"}) + "\n")
    assert main(["bench", "--model", str(tiny_model_dir), "--drafters", "ngram", "--prompts", str(prompts),
                 "--max-tokens", "4", "--blas", "keep", "--output", str(tmp_path / "out.json")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mlxspec: error")]
    assert ran == [] and errors == ["mlxspec: error: prompt long: the prompt has 4219 tokens but the model's "
                                    "context is 4096; shorten the prompt"]


def test_bad_flags_are_one_line_errors(capsys):
    assert main(["bench", "--num-draft-tokens", "0,2", "--blas", "keep"]) == 2
    assert "--num-draft-tokens takes 'auto', 'scheduled' and integers >= 1" in capsys.readouterr().err
    assert main(["bench", "--temps", "-1", "--blas", "keep"]) == 2
    assert "--temps must be numbers >= 0" in capsys.readouterr().err


def test_tables_can_be_recomputed_from_the_json(bench_result, tmp_path, capsys):
    source = tmp_path / "raw.json"
    source.write_text(json.dumps(bench_result[1]))
    assert main(["bench", "--from-json", str(source), "--output", str(tmp_path / "again.json"), "--blas",
                 "keep"]) == 0
    assert "| kind | temp | system |" in capsys.readouterr().out
    assert json.loads((tmp_path / "again.json").read_text())["summary"] == bench_result[1]["summary"]


def test_bench_times_head_drafters_from_specs(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """``--drafters`` takes drafter specs, Medusa and EAGLE included (heads shipped for the tiny target)."""
    from mlxspec.heads.eagle import save_eagle
    from mlxspec.heads.medusa import save_medusa
    from test_eagle import random_head
    from test_medusa import random_heads

    from conftest import tiny_llama
    from mlxspec.loading.identity import write_card

    save_medusa(tmp_path / "models" / "medusa" / tiny_model_dir.name, random_heads(shared=True))
    save_eagle(random_head(1), tmp_path / "models" / "eagle" / tiny_model_dir.name)
    for kind in ("medusa", "eagle"):
        write_card(tmp_path / "models" / kind / tiny_model_dir.name, tiny_llama(seed=0))
    monkeypatch.setenv("MLXSPEC_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Copy: red green blue red green blue",
                                   "kind": "grounded"}) + "\n")
    code = main(["bench", "--model", str(tiny_model_dir), "--drafters",
                 "eagle,medusa:tree=small_15,ngram,none",
                 "--prompts", str(prompts), "--num-draft-tokens", "auto,scheduled,2", "--temps", "0",
                 "--max-tokens", "8", "--no-control", "--output", str(tmp_path / "bench.json"), "--blas",
                 "keep"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "skipping mlxspec ngram γ=scheduled: the drafter reports no survival estimates" in err
    result = json.loads((tmp_path / "bench.json").read_text())
    assert [s["name"] for s in result["systems"]] == [
        BASELINE, "mlxspec eagle γ=auto", "mlxspec eagle γ=scheduled", "mlxspec eagle γ=2",
        "mlxspec medusa:tree=small_15 γ=auto", "mlxspec medusa:tree=small_15 γ=scheduled",
        "mlxspec medusa:tree=small_15 γ=2", "mlxspec ngram γ=auto", "mlxspec ngram γ=2", "mlxspec none"]
    runs = {r["system"]: r for r in result["runs"]}
    calibration = runs["mlxspec medusa:tree=small_15 γ=scheduled"]["calibration"]
    assert sum(n for n, _, _ in calibration["bins"]) == sum(n for n, _, _ in calibration["depths"]) > 0
    assert runs["mlxspec eagle γ=2"]["calibration"] is None
    assert all(run["generation_tokens"] == 8 for run in runs.values())
    assert len({run["output_sha"] for run in runs.values()}) == 1  # float32 greedy: every system agrees
    assert sum(d for d, _ in runs["mlxspec eagle γ=2"]["rounds"]) > 0
    assert main(["bench", "--drafters", "eagle:depth=0", "--blas", "keep"]) == 2
    assert "drafter spec 'eagle:depth=0': depth must be >= 1" in capsys.readouterr().err


def _ship_heads(root, tiny_model_dir):
    """Random Medusa heads and an EAGLE head 'shipped' for the tiny target under ``root``/models."""
    from mlxspec.heads.eagle import save_eagle
    from mlxspec.heads.medusa import save_medusa
    from test_eagle import random_head
    from test_medusa import random_heads

    from conftest import tiny_llama
    from mlxspec.loading.identity import write_card

    save_medusa(root / "models" / "medusa" / tiny_model_dir.name, random_heads(shared=True))
    save_eagle(random_head(1), root / "models" / "eagle" / tiny_model_dir.name)
    for kind in ("medusa", "eagle"):
        write_card(root / "models" / kind / tiny_model_dir.name, tiny_llama(seed=0, sharpen=4.0))
    return root / "models"


def test_bench_prompt_times_every_drafter_that_can_run_and_ends_with_a_verdict(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    monkeypatch.setenv("MLXSPEC_MODELS", str(_ship_heads(tmp_path, tiny_model_dir)))
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    output = tmp_path / "bench.json"
    code = main(["bench", "--model", str(tiny_model_dir), "--prompt", "Copy: red green blue red green blue",
                 "--num-draft-tokens", "2,3", "--repeats", "2", "--max-tokens", "8", "--output", str(output),
                 "--blas", "keep"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(output.read_text())
    families = {s["drafter"] for s in result["systems"] if s["engine"] == "mlxspec"}
    assert families == {"ngram", "suffix:shared=False", "medusa", "eagle", "none"}
    for name in ("draft", "mtp", "dflash", "dspark"):  # nothing given, nothing ships: each says why, once
        assert err.count(f"mlxspec bench: not timing {name}: ") == 1
    assert "--draft-model" in err and "no DFlash drafter ships for this model" in err
    assert result["settings"]["temps"] == [0.0] and result["prompt_ids"] == ["yours.1", "yours.2"]
    assert {r["kind"] for r in result["runs"]} == {"your prompt"}
    assert len(result["runs"]) == len(result["systems"]) * 2
    assert "Best fixed γ" in out and "Every system" in out  # two fixed γ: the best-γ table says something new
    [verdict] = result["verdicts"]
    assert verdict["kind"] == "your prompt" and verdict["temp"] == 0.0 and verdict["noise"] is not None
    assert verdict["system"] in {s["name"] for s in result["systems"]} and verdict["system"] != "mlxspec none"
    generate, chat = verdict["commands"]
    assert generate.startswith(f"mlxspec generate --model {tiny_model_dir} --drafter ")
    assert generate.endswith("--blas keep --prompt 'Copy: red green blue red green blue'")
    assert chat == "mlxspec chat" + generate[len("mlxspec generate"):generate.index(" --prompt")]
    closing = out.split("\nwrote ")[1].split("\n\nVerdict (")[1]  # the verdict closes the output
    assert f"  {generate}\n  {chat}\n" in closing + "\n"
    assert ("fastest is" in out) == verdict["wins"] and ("nothing beats plain" in out) != verdict["wins"]


def test_bench_prompt_defaults_to_auto_and_says_how_many_runs_and_how_long_first(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    output = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tiny_model_dir), "--prompt", "Say hi.", "--drafters", "ngram,none",
                 "--max-tokens", "4", "--output", str(output), "--blas", "keep"]) == 0
    err = capsys.readouterr().err
    result = json.loads(output.read_text())
    assert [s["name"] for s in result["systems"]] == [BASELINE, CONTROL,
                                                      "mlxspec ngram γ=auto", "mlxspec none"]
    assert len(result["runs"]) == 4 * 3  # systems × the default 3 repeats
    line = next(line for line in err.splitlines() if line.startswith("mlxspec bench: 12 runs"))
    assert line.startswith("mlxspec bench: 12 runs (4 systems × 3 repeats of your prompt × 1 temperature), "
                           "about ")
    assert " here if every answer runs to 4 tokens at plain decoding's " in line and result["estimated_s"] > 0
    assert err.index(line) < err.index("0/12")  # before the progress bar starts


def test_the_duration_estimate_counts_prefill_steps_and_warm_ups():
    from mlxspec.bench.runs import WARMUP_TOKENS, estimate_s

    costs = Costs([0.1] * 16)  # every forward of up to 16 tokens: 0.1 s
    # 2 systems × 1 temperature × (a 20-token prompt in 2 forwards + 10 steps) + 2
    # warm-ups (1 forward + 4 steps)
    assert estimate_s(costs, 2, [[1] * 20], 1, 10) == pytest.approx(
        2 * (0.2 + 1.0) + 2 * (0.1 + WARMUP_TOKENS * 0.1))


def test_bench_prompt_from_stdin_and_its_errors(monkeypatch, capsys, tmp_path, tiny_model_dir):
    monkeypatch.setenv("MLXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"Say hi.")))
    output = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tiny_model_dir), "--prompt", "-", "--drafters", "ngram,none",
                 "--num-draft-tokens", "2", "--repeats", "1", "--max-tokens", "4", "--no-control",
                 "--output", str(output), "--blas", "keep"]) == 0
    result = json.loads(output.read_text())
    assert result["prompt_source"]["texts"] == {"yours.1": "Say hi."}
    assert [s["name"] for s in result["systems"]] == [BASELINE, "mlxspec ngram γ=2", "mlxspec none"]
    assert "no noise floor: --no-control" in capsys.readouterr().out
    assert main(["bench", "--prompt", "hi", "--prompts", "sharegpt", "--blas", "keep"]) == 2
    assert "mlxspec: error: --prompt and --prompts both name the prompts; pass one" in capsys.readouterr().err
    assert main(["bench", "--prompt", "hi", "--repeats", "0", "--blas", "keep"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--prompt", "hi", "--eagle-heads", str(tmp_path / "none"), "--model",
                 str(tiny_model_dir), "--blas", "keep", "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlxspec: error: the eagle drafter cannot run: ") and str(tmp_path / "none") in err


def _runs(ratios: dict[str, list[float]]) -> list[RunRecord]:
    """Runs of a baseline at 10 tokens/s and of each system at ``ratio`` × that, one per ratio (prompt)."""
    runs = []
    for system, values in {BASELINE: [1.0] * 3, **ratios}.items():
        runs += [RunRecord(system, f"p{i}", "open", 0.0, 0, 10, 1.0, 10, 1.0 / r,
                           rounds=[[2, 1]] if "γ" in system else []) for i, r in enumerate(values)]
    return runs


@pytest.mark.parametrize("ngram, wins", [([1.5, 1.4, 1.6], True), ([1.03, 1.05, 1.02], False)])
def test_verdict_weighs_the_fastest_setting_against_the_noise_floor(ngram, wins):
    from mlxspec.bench.summary import verdicts

    systems = make_systems(["ngram", "none"], [2, 4], has_draft_model=False)
    rows = summarize(_runs({CONTROL: [1.06, 0.96, 1.0], "mlxspec ngram γ=2": ngram,
                            "mlxspec ngram γ=4": [1.01, 1.0, 0.99], "mlxspec none": [1.2, 1.2, 1.2]}),
                     systems, {})
    [verdict] = verdicts(rows, systems)
    assert verdict.noise == pytest.approx(0.06)  # the control's widest swing
    assert verdict.system == "mlxspec ngram γ=2" and verdict.drafter == "ngram" and verdict.gamma == 2
    assert verdict.speedup == pytest.approx(ngram[0] if wins else 1.03) and verdict.wins == wins
    result = {"flags": {"target": ["--model", "my model"], "draft": [], "blas": []},
              "prompt_source": {"source": "--prompt", "texts": {"yours.1": "Hi there"}}}
    generate, chat = bench_command.verdict_commands(verdict, result)
    drafter = "--drafter ngram --num-draft-tokens 2" if wins else "--drafter none"
    assert generate == f"mlxspec generate --model 'my model' {drafter} --prompt 'Hi there'"
    assert chat == f"mlxspec chat --model 'my model' {drafter}"
    text = bench_command.format_verdict(verdict, [generate, chat])
    assert "±6%" in text and (("fastest is mlxspec ngram γ=2, 1.50×" in text) if wins
                              else ("nothing beats plain decoding beyond the noise floor" in text))


def test_the_verdict_never_picks_a_system_priced_as_plain():
    """A system priced as plain decoding takes plain steps (plain decoding in disguise): however fast its runs
    looked, the verdict picks another drafting system, or plain decoding
    (``--drafter none``) when none is left."""
    from dataclasses import replace

    from mlxspec.bench.summary import verdicts

    systems = make_systems(["medusa", "ngram", "none"], ["auto", 2], has_draft_model=False)
    systems = [replace(s, priced_plain=True) if s.drafter == "medusa" else s for s in systems]
    ratios = {CONTROL: [1.06, 0.96, 1.0], "mlxspec medusa γ=auto": [1.5, 1.5, 1.5],
              "mlxspec medusa γ=2": [1.4] * 3,
              "mlxspec ngram γ=auto": [1.2, 1.2, 1.2], "mlxspec ngram γ=2": [1.01] * 3,
              "mlxspec none": [1.0] * 3}
    [verdict] = verdicts(summarize(_runs(ratios), systems, {}), systems)
    assert verdict.system == "mlxspec ngram γ=auto" and verdict.wins
    systems = [s for s in systems if s.drafter != "ngram"]
    rows = summarize(_runs({k: v for k, v in ratios.items() if "ngram" not in k}), systems, {})
    [verdict] = verdicts(rows, systems)
    assert verdict.system is None and not verdict.wins
    generate, _ = bench_command.verdict_commands(verdict, {"flags": {"target": [], "draft": [], "blas": []}})
    assert "--drafter none" in generate


def test_the_verdicts_generate_line_runs_as_printed():
    """A one-line prompt of up to 300 characters is repeated, quoted; a longer or multi-line one is read from
    a file the line says to write (a bare ``< prompt.txt`` failed for a user who gave the prompt inline)."""
    import shlex

    from mlxspec.bench.summary import Verdict
    from mlxspec.commands.bench import verdict_commands

    verdict = Verdict("your prompt", 0.0, "mlxspec ngram γ=auto", "ngram", "auto", 1.5, 0.05, True)
    for text, inline in (("Why is the sky blue? " * 12, True), ("line one\nline two", False),
                         ("x" * 301, False)):
        result = {"prompt_source": {"source": "--prompt", "texts": {"yours": text}}, "flags": {}}
        generate, _ = verdict_commands(verdict, result)
        words = shlex.split(generate, comments=True)
        assert (words[-1] == text) == inline, generate
        assert (words[-3:] == ["-", "<", "prompt.txt"]) == (not inline), generate
        assert inline or generate.endswith("# with your prompt saved in prompt.txt")


def test_records_measured_before_rounds_were_named_rounds_still_read():
    """The shipped records of models/bench/heldout/ say "cycles": they are read as rounds, τ as recorded."""
    from pathlib import Path

    from mlxspec.train.measure import read_records

    path = Path(__file__).resolve().parents[1] / "models" / "bench" / "heldout" / "engine-temp0.jsonl"
    raw = [json.loads(line)["stats"] for line in path.read_text().splitlines() if line.strip()]
    records = read_records(path)
    assert "cycles" in raw[0] and len(records) == len(raw)
    assert [r.stats.rounds for r in records] == [s["cycles"] for s in raw]
    assert [r.stats.tau for r in records] == pytest.approx([s["tau"] for s in raw])
