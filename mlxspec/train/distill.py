"""Self-distillation: the target's own greedy answers as training text.

Medusa (arXiv 2401.10774, section 2.3.2) trains on the target's own outputs when the
original answers do not match the model. For each conversation the messages up to its
first user turn (and a system turn before it) are kept and the target's greedy answer,
at most ``max_new_tokens`` long, becomes the assistant turn. Only the first exchange is
regenerated, which keeps it affordable; even so this is slow on a CPU (one plain decoding
step per token). Answers are appended to a JSONL file as they are made, so an interrupted
run resumes where it stopped, and the file is itself a valid ``--data`` file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.nn as nn

from ..data import Conversation, Turn
from .dataset import trim_leading


@dataclass(frozen=True)
class DistillProgress:
    """One answered conversation: ``done`` of ``total``, ``tokens`` generated for it, ``cached`` if read back."""

    done: int
    total: int
    tokens: int
    cached: bool


def distill_conversations(model: nn.Module, tokenizer, conversations: list[Conversation], path: str | Path, *,
                          max_new_tokens: int = 256) -> Iterator[DistillProgress]:
    """Answer each conversation's first prompt with the target (greedy) and append it to ``path``.

    Args:
        model: The target.
        tokenizer: Its tokenizer (with a chat template).
        conversations: Conversations whose first prompt to answer.
        path: JSONL file of ``{"id", "messages"}``; ids already in it are skipped.
        max_new_tokens: Longest answer. Default: ``256``.

    Yields:
        ``DistillProgress`` per conversation.
    """
    from ..generate import generate

    path = Path(path)
    done = set()
    if path.is_file():
        done = {json.loads(line)["id"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}
    path.parent.mkdir(parents=True, exist_ok=True)
    for i, conversation in enumerate(conversations):
        if conversation.id in done:
            yield DistillProgress(i + 1, len(conversations), 0, True)
            continue
        prompt = _prompt_turns(conversation)
        if prompt is None:
            continue
        messages = [{"role": t.role, "content": t.text} for t in prompt]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        result = generate(model, tokenizer, list(ids), drafter="none", max_tokens=max_new_tokens)
        messages.append({"role": "assistant", "content": result.text})
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"id": conversation.id, "messages": messages}, ensure_ascii=False) + "\n")
        yield DistillProgress(i + 1, len(conversations), len(result.tokens), False)


def _prompt_turns(conversation: Conversation) -> tuple[Turn, ...] | None:
    turns = trim_leading(conversation)
    users = [i for i, t in enumerate(turns) if t.role == "user"]
    return turns[: users[0] + 1] if users else None
