"""ShareGPT parsing record by record (a cut-off end, malformed records), prompt kinds, sampling, JSONL."""

from __future__ import annotations

import io
import json

import pytest

from mlxspec.loading.data import (
    ParseReport,
    classify_prompt,
    iter_conversations,
    iter_json_array,
    load_sharegpt,
    read_prompts_jsonl,
    sample_prompts,
)

PASSAGE = "The committee met on Tuesday to review the budget. " * 8
RECORDS = [
    {"id": "a_0", "conversations": [{"from": "human", "value": "Summarize this text: " + PASSAGE},
                                    {"from": "gpt", "value": "The committee reviewed the budget."}]},
    {"id": "b_0", "conversations": [{"from": "system", "value": "Be brief."},
                                    {"from": "human", "value": "What is the tallest mountain on Earth?"},
                                    {"from": "bing", "value": "Mount Everest."}]},
    {"id": "c_0", "conversations": [{"from": "narrator", "value": "?"}]},
    {"id": "d_0", "conversations": []},
]
CUT = '{"id": "e_0", "conversations": [{"from": "human", "value": "this record is cut o'


def truncated_json() -> str:
    return "[\n" + ",\n".join(json.dumps(r, indent=2) for r in RECORDS) + ",\n  " + CUT


@pytest.mark.parametrize("chunk_chars", [7, 1 << 20])
def test_cut_off_json_is_parsed_record_by_record(chunk_chars):
    report = ParseReport()
    records = list(iter_json_array(io.StringIO(truncated_json()), report, chunk_chars=chunk_chars))
    assert records == RECORDS
    assert report.truncated and report.skipped_chars == len(CUT)


def test_conversations_normalise_roles_and_report_skips(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(truncated_json())
    report = ParseReport()
    conversations = list(iter_conversations(path, report))
    assert [c.id for c in conversations] == ["a_0", "b_0"]
    assert [t.role for t in conversations[1].turns] == ["system", "user", "assistant"]
    assert conversations[1].first_user_turn() == "What is the tallest mountain on Earth?"
    assert conversations[0].messages()[1] == {
        "role": "assistant",
        "content": "The committee reviewed the budget.",
    }
    assert report.records == 2 and report.malformed == {"unknown role 'narrator'": 1, "no turns": 1}
    assert report.summary() == (
        f"2 conversations; skipped: 1 malformed (unknown role 'narrator'), "
        f"1 malformed (no turns), a record cut off at the end ({len(CUT)} characters)"
    )


def test_complete_json_is_not_truncated():
    report = ParseReport()
    assert list(iter_json_array(io.StringIO(json.dumps(RECORDS[:2])), report, chunk_chars=5)) == RECORDS[:2]
    assert not report.truncated and report.skipped_chars == 0
    with pytest.raises(ValueError, match="not a JSON array"):
        list(iter_json_array(io.StringIO('{"id": 1}'), ParseReport()))


def test_prompt_kinds():
    assert classify_prompt("Summarize this text: " + PASSAGE) == "grounded"
    assert classify_prompt(PASSAGE + "\nRewrite the paragraph above in plain words.") == "grounded"
    assert classify_prompt("What is the tallest mountain on Earth?") == "open"
    assert classify_prompt("```python\nprint(1)\n```") is None
    assert classify_prompt("hi") is None
    assert classify_prompt("Summarize quantum physics for me") is None  # a task, but no passage


def test_sample_is_seeded_and_filtered(tmp_path):
    path = tmp_path / "many.json"
    records = [{"id": f"q{i}", "conversations": [{"from": "human", "value": f"What is question number {i}?"}]}
               for i in range(40)]
    path.write_text(json.dumps(records))
    conversations = list(iter_conversations(path))
    first = sample_prompts(conversations, "open", 5, seed=1)
    assert first == sample_prompts(conversations, "open", 5, seed=1)
    assert first != sample_prompts(conversations, "open", 5, seed=2)
    assert len(first) == 5 and all(p.kind == "open" and p.id.startswith("sharegpt:q") for p in first)
    short = sample_prompts(conversations, "open", 50, seed=1, accept=lambda text: len(text) < 27)
    assert {p.text for p in short} == {f"What is question number {i}?" for i in range(10)}
    assert sample_prompts(conversations, "grounded", 3, seed=1) == []
    with pytest.raises(ValueError, match="unknown prompt kind"):
        sample_prompts(conversations, "chatty", 1, seed=0)


def test_prompts_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Rewrite: a b c", "kind": "grounded", "id": "r1"}\n\n{"prompt": "Why?"}\n')
    prompts = read_prompts_jsonl(path)
    assert [(p.id, p.kind, p.text) for p in prompts] == [("r1", "grounded", "Rewrite: a b c"),
                                                         ("prompts.jsonl:3", "custom", "Why?")]
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2"):
        read_prompts_jsonl(path)
    with pytest.raises(FileNotFoundError):
        read_prompts_jsonl(tmp_path / "missing.jsonl")


@pytest.mark.real_data
def test_real_sharegpt_wheel_parses():
    conversations, report = load_sharegpt()
    assert report.records == len(conversations) == 17_545
    assert report.truncated and report.skipped_chars == 2_987
    assert report.malformed == {"no turns": 126}
    assert {t.role for c in conversations[:2000] for t in c.turns} <= {"user", "assistant", "system"}
    kinds = [classify_prompt(c.first_user_turn() or "") for c in conversations]
    assert kinds.count("grounded") > 100 and kinds.count("open") > 5000
