"""Two multi-request tasks where earlier answers predict later ones: the suffix drafter's benchmark.

    python -m mlxspec.bench.tasks --model qwen2.5-coder-1.5b --dtype float32 --drafters none,ngram,suffix

- **code editing**: one conversation: a function, then three successive edits of it; each answer
  goes back into the conversation (one ``PromptCache`` per conversation, as the chat keeps).
- **repeated JSON**: five separate requests, each extracting one person as the same JSON shape.

Every contender starts from an empty suffix store (each gets its own store key), decodes greedily
(so every contender must produce the same tokens; a mismatch is reported), and is timed on
generation only (prefill excluded), as ``docs/drafters.md`` reports. The rows are printed as a
Markdown table with the speed-up over the first contender.
"""

from __future__ import annotations

import argparse
import sys

from ..core.cache import PromptCache
from ..drafters import DrafterSpec, make_drafter, parse_specs
from ..engine.generate import generate
from ..engine.session import ModelSpec, load_model

CODE_EDITS = (
    "Write a Python function parse_line(line) that splits a comma-separated line into fields and strips "
    "spaces.",
    "Change it so that the separator is a parameter sep with default ','.",
    "Now also skip empty fields.",
    "Finally, add a docstring and type hints.",
)
JSON_ASK = 'Extract the person as JSON with keys "name", "age" and "city". Reply with the JSON only.\n\n'
PEOPLE = (
    "Alice is 30 years old and lives in Paris.",
    "Bob, 45, is from Berlin.",
    "Carol lives in Madrid; she turned 27 last week.",
    "Dan (52) has spent his whole life in Oslo.",
    "Eve is a 38-year-old engineer based in Rome.",
)


def _template(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def run_task(task: str, loaded, spec: DrafterSpec, key: str, max_tokens: int) -> dict:
    """Run one task with one drafter; returns tokens, rounds, drafted, accepted, seconds and the outputs.

    Args:
        task: ``"code editing"`` or ``"repeated JSON"``.
        loaded: The target (``session.LoadedModel``).
        spec: The drafter.
        key: Its own store key (the ``target_name`` its suffix store is kept under).
        max_tokens: Most tokens per answer.
    """
    model, tokenizer = loaded.model, loaded.tokenizer
    drafter = make_drafter(spec, model, tokenizer, target_name=key)
    gamma = 0 if spec.kind.plain else 8
    totals = {"tokens": 0, "rounds": 0, "drafted": 0, "accepted": 0, "seconds": 0.0, "outputs": []}

    def one(prompt: list[int], cache: PromptCache | None) -> str:
        result = generate(
            model,
            tokenizer,
            prompt,
            drafter=drafter,
            num_draft_tokens=gamma,
            max_tokens=max_tokens,
            prompt_cache=cache,
        )
        s = result.stats
        for name, value in (("tokens", s.generation_tokens), ("rounds", s.rounds), ("drafted", s.drafted),
                            ("accepted", s.accepted), ("seconds", s.generation_s)):
            totals[name] += value
        totals["outputs"].append(result.tokens)
        return result.text

    if task == "code editing":
        messages, cache = [], PromptCache(model)
        for ask in CODE_EDITS:
            messages.append({"role": "user", "content": ask})
            messages.append({"role": "assistant", "content": one(_template(tokenizer, messages), cache)})
    else:
        for person in PEOPLE:
            one(_template(tokenizer, [{"role": "user", "content": JSON_ASK + person}]), None)
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxspec.bench.tasks", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--drafters", default="none,ngram,suffix,suffix:shared=false")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tasks", default="code editing,repeated JSON")
    args = parser.parse_args(argv)
    loaded = load_model(ModelSpec(args.model, args.dtype))
    specs = parse_specs(args.drafters)
    print(f"{loaded.display}; greedy; γ = 8; generation time only\n")
    print("| task | drafter | tokens | rounds | α | τ | tokens/s | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for task in args.tasks.split(","):
        base = None
        for i, spec in enumerate(specs):
            r = run_task(task, loaded, spec, f"bench-tasks-{i}", args.max_tokens)
            rate = r["tokens"] / r["seconds"]
            base = base or (rate, r["outputs"])
            alpha = f"{r['accepted'] / r['drafted']:.2f}" if r["drafted"] else "–"
            same = "" if r["outputs"] == base[1] else " (OUTPUT DIFFERS)"
            print(
                f"| {task} | `{spec}` | {r['tokens']} | {r['rounds']} | {alpha} | "
                f"{r['tokens'] / r['rounds']:.2f} "
                f"| {rate:.2f} | {rate / base[0]:.2f}{same} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
