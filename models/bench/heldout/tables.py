"""The README tables (run from the repository root with mlxspec installed): replayed τ (the first
table's n-gram, Medusa and draft-model rows + the EAGLE rows, all on the same stored plain runs)
and the engine timings."""
import os
import sys

from mlxspec.train.measure import ENGINE, PLAIN, markdown_table, read_records

S = os.environ.get("RUNS", os.path.dirname(os.path.abspath(__file__)))  # this folder
FILES = {  # temperature: (first table's runs, EAGLE replay files)
    "0": ("replay-temp0", ["eagle3-replay-temp0", "eagle3-ngram6-replay-temp0", "eagle1-replay-temp0"]),
    "0.7": ("replay-temp0.7", ["eagle3-replay-temp0.7", "eagle1-replay-temp0.7"]),
}


def complete(path):
    """Records of the prompts on which every contender of ``path`` finished."""
    records = [r for r in read_records(path) if r.config != PLAIN] if os.path.exists(path) else []
    names = {r.config for r in records}
    seen = {}
    for r in records:
        seen.setdefault(r.prompt_id, set()).add(r.config)
    return [r for r in records if seen[r.prompt_id] == names]


tau, counts = [], {}
for first, eagle in FILES.values():
    tau += [r for r in read_records(f"{S}/{first}.jsonl") if not r.config.startswith("EAGLE")]
    for name in eagle:
        rows = [r for r in complete(f"{S}/{name}.jsonl") if r.config != "EAGLE-3 chain γ6 + n-gram 6"]
        # (that contender was capped at the head's total_tokens 5: the same tree as chain γ4 + n-gram 6)
        counts[name] = len({r.prompt_id for r in rows})
        tau += rows
print(counts, file=sys.stderr)
print(markdown_table(tau))
print()
print(markdown_table([r for r in read_records(f"{S}/eagle-engine.jsonl") if r.mode == ENGINE]))
print()
print(markdown_table([r for r in read_records(f"{S}/eagle-ngram6-engine.jsonl") if r.mode == ENGINE]))
