"""``python -m mlxspec.bench.tasks``: both tasks run for every contender and greedy outputs agree."""

from mlxspec.bench import tasks as bench_tasks


def test_every_contender_runs_both_tasks_with_the_same_greedy_output(tiny_model_dir, capsys):
    assert bench_tasks.main(["--model", str(tiny_model_dir), "--max-tokens", "6"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| " + task, f"`{drafter}`"] for task in ("code editing", "repeated JSON")
        for drafter in ("none", "ngram", "suffix", "suffix:shared=False")]
    assert not any("DIFFERS" in row for row in rows)
    # the code-editing conversation is four answers of at most 6 tokens; the JSON task five
    assert {int(row.split(" | ")[2]) for row in rows[:4]} <= set(range(4, 25))
