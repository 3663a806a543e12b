"""Training conversations: sources, the assistant-token loss mask, the held-out split.

Conversations come from ShareGPT (``mlxspec.loading.data``) or a user JSONL file, are rendered with
the target's chat template, and get a loss mask that is true only on assistant tokens. The
assistant spans are found by rendering prefixes of the conversation and diffing token counts,
so any template works as long as rendering a prefix gives a prefix of the tokens (templates
that rewrite earlier turns, e.g. by dropping reasoning, are refused per conversation).

The split is by conversation with a fixed seed: the held-out conversations (whose first user
turns become the benchmark prompts) are never trained on, and neither is any training
conversation that opens with the same text as a held-out prompt (ShareGPT repeats prompts).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..loading.data import ROLES, Conversation, Prompt, Turn, conversation_from_record, load_sharegpt

SHAREGPT = "sharegpt"
HELDOUT_KIND = "heldout"
"""``kind`` of the held-out prompts written by ``write_heldout_prompts``."""


@dataclass(frozen=True)
class Example:
    """One tokenized conversation.

    Attributes:
        id: The conversation's id.
        tokens: Token ids, shape [T], int32 (chat template applied, truncated).
        mask: Loss mask, shape [T], bool: true on assistant tokens (their text and end token).
    """

    id: str
    tokens: np.ndarray
    mask: np.ndarray


@dataclass
class DataReport:
    """What ``tokenize_conversations`` kept and why it dropped the rest.

    Attributes:
        conversations: Conversations turned into examples.
        tokens: Tokens in those examples.
        masked_tokens: Assistant (loss) tokens in them.
        truncated: Examples cut at the maximum length.
        skipped: Conversations dropped, by reason.
    """

    conversations: int = 0
    tokens: int = 0
    masked_tokens: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        """One line, e.g.
        ``"412 conversations, 200123 tokens (121000 assistant); 40 truncated; skipped: ..."``."""
        skipped = ", ".join(f"{n} {why}" for why, n in self.skipped.most_common()) or "nothing"
        return (f"{self.conversations} conversations, {self.tokens} tokens ({self.masked_tokens} assistant); "
                f"{self.truncated} truncated; skipped: {skipped}")


def read_conversations(source: str) -> tuple[list[Conversation], str]:
    """Conversations from ShareGPT or a JSONL file.

    Args:
        source: ``"sharegpt"`` (ShareGPT V3, fetched once, see ``mlxspec.loading.data``) or a JSONL
            file with one conversation per line: ``{"messages": [{"role", "content"}, ...]}``
            or ShareGPT's ``{"conversations": [{"from", "value"}, ...]}``; an optional ``"id"``.

    Returns:
        tuple: the conversations, and a one-line note on what the parser skipped.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a line that is not a conversation (naming the line), or ShareGPT unavailable.
    """
    if source == SHAREGPT:
        conversations, report = load_sharegpt()
        return conversations, f"ShareGPT: {report.summary()}"
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no such data file: {source}; pass 'sharegpt' or a JSONL of conversations")
    conversations = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            conversations.append(_jsonl_conversation(line, f"{path.name}:{number}"))
    return conversations, f"{path.name}: {len(conversations)} conversations"


def _jsonl_conversation(line: str, where: str) -> Conversation:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg}); write one conversation object per line") from e
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        turns = []
        for m in record["messages"]:
            role = ROLES.get(m.get("role")) if isinstance(m, dict) else None
            if role is None or not isinstance(m.get("content"), str):
                raise ValueError(
                    f"{where}: each message needs a known 'role' ({', '.join(sorted(set(ROLES)))}) "
                    "and a string 'content'"
                )
            turns.append(Turn(role, m["content"]))
        return Conversation(str(record.get("id", where)), tuple(turns))
    conversation, problem = conversation_from_record(record)
    if problem:
        raise ValueError(f'{where}: expected {{"messages": [{{"role", "content"}}]}} or '
                         f'{{"conversations": [{{"from", "value"}}]}} ({problem})')
    return Conversation(str(record.get("id") or where), conversation.turns)


def trim_leading(conversation: Conversation) -> tuple[Turn, ...]:
    """The turns from the first user turn on, keeping a system turn right before it.

    ShareGPT V3 splits long conversations, so many parts open with an assistant turn that
    answers a message we do not have; those opening turns are dropped.
    """
    turns = conversation.turns
    first = next((i for i, t in enumerate(turns) if t.role == "user"), len(turns))
    keep_system = first > 0 and turns[first - 1].role == "system"
    return turns[first - 1 if keep_system else first :]


def first_prompt(conversation: Conversation) -> str | None:
    """The first user turn's text, if an assistant turn answers it."""
    turns = trim_leading(conversation)
    roles = [t.role for t in turns]
    if "user" not in roles or "assistant" not in roles[roles.index("user") :]:
        return None
    return turns[roles.index("user")].text


def first_answer(conversation: Conversation) -> str | None:
    """The text of the assistant turn that answers ``first_prompt``, if there is one."""
    turns = trim_leading(conversation)
    roles = [t.role for t in turns]
    if "user" not in roles:
        return None
    start = roles.index("user")
    return next((t.text for t in turns[start:] if t.role == "assistant"), None)


def _ids(rendered) -> list[int]:
    return list(rendered["input_ids"] if isinstance(rendered, dict) else rendered)


def assistant_mask(tokenizer, messages: list[dict]) -> tuple[list[int], np.ndarray]:
    """Render a conversation and mark its assistant tokens.

    For each assistant turn i, its span runs from the length of ``messages[:i]`` rendered with
    the generation prompt to the length of ``messages[:i + 1]``, and ends after its end-of-turn
    token (what follows it, such as a newline, is never generated, so it is not a target).

    Args:
        tokenizer: The target's tokenizer (``apply_chat_template``, ``eos_token_ids``).
        messages: Chat messages, ``[{"role", "content"}, ...]``.

    Returns:
        tuple: token ids [T] and the mask [T] (bool).

    Raises:
        ValueError: if a rendered prefix is not a prefix of the whole rendering.
    """
    full = _ids(tokenizer.apply_chat_template(messages, tokenize=True))
    mask = np.zeros(len(full), dtype=bool)
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = _ids(tokenizer.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True))
        upto = _ids(tokenizer.apply_chat_template(messages[: i + 1], tokenize=True))
        if full[: len(head)] != head or full[: len(upto)] != upto:
            raise ValueError("the chat template renders a prefix of the conversation differently")
        span = full[len(head) : len(upto)]
        ends = [j for j, token in enumerate(span) if token in eos]
        mask[len(head) : len(head) + (ends[-1] + 1 if ends else len(span))] = True
    return full, mask


def tokenize_conversations(tokenizer, conversations: Iterable[Conversation], *, max_length: int,
                           max_tokens_total: int | None = None,
                           report: DataReport | None = None) -> Iterator[Example]:
    """Examples in the order given, until ``max_tokens_total`` tokens have been produced.

    Args:
        tokenizer: The target's tokenizer, with a chat template.
        conversations: Conversations (opening non-user turns are dropped, see ``trim_leading``).
        max_length: Longest example in tokens; longer ones are truncated.
        max_tokens_total: Stop once this many tokens were produced (the last example is kept
            whole). Default: no limit.
        report: Filled in as examples are made. Default: a throw-away one.

    Yields:
        ``Example`` per conversation with at least one assistant token inside ``max_length``.
    """
    report = report if report is not None else DataReport()
    for conversation in conversations:
        if max_tokens_total is not None and report.tokens >= max_tokens_total:
            return
        messages = [{"role": t.role, "content": t.text} for t in trim_leading(conversation)]
        if not any(m["role"] == "assistant" for m in messages):
            report.skipped["without an assistant turn"] += 1
            continue
        try:
            tokens, mask = assistant_mask(tokenizer, messages)
        except ValueError:
            report.skipped["whose prefixes render differently"] += 1
            continue
        if len(tokens) > max_length:
            tokens, mask = tokens[:max_length], mask[:max_length]
            report.truncated += 1
        if not mask.any():
            report.skipped["without assistant tokens within the maximum length"] += 1
            continue
        report.conversations += 1
        report.tokens += len(tokens)
        report.masked_tokens += int(mask.sum())
        yield Example(conversation.id, np.asarray(tokens, dtype=np.int32), mask)


def split_conversations(conversations: list[Conversation], *, num_heldout: int, seed: int,
                        heldout_ok: Callable[[Conversation], bool] | None = None,
                        ) -> tuple[list[Conversation], list[Conversation]]:
    """A fixed-seed split by conversation into (train, held-out), both in shuffled order.

    The held-out conversations are the first ``num_heldout`` of the shuffle whose first user
    turn is answered and that pass ``heldout_ok``. Training conversations whose first prompt
    equals a held-out prompt are dropped, so no held-out prompt is trained on.

    Args:
        conversations: All conversations.
        num_heldout: How many to hold out.
        seed: Seed of the shuffle; the same seed and data give the same split.
        heldout_ok: Extra condition on a held-out conversation (e.g. a prompt token limit).
            Default: none.

    Returns:
        tuple: (train, held-out) conversations.
    """
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    heldout, rest = [], []
    for i in order:
        prompt = first_prompt(conversations[i])
        if len(heldout) < num_heldout and prompt and (heldout_ok is None or heldout_ok(conversations[i])):
            heldout.append(conversations[i])
        else:
            rest.append(conversations[i])
    seen = {first_prompt(c) for c in heldout}
    train = [c for c in rest if first_prompt(c) not in seen]
    return train, heldout


def starts_a_conversation(conversation: Conversation) -> bool:
    """Whether a ShareGPT record is the first part of its conversation (id ``..._0``), so its first
    prompt makes sense on its own; V3 splits long conversations into parts ``_0``, ``_1``, ..."""
    return conversation.id.endswith("_0")


def heldout_prompts(heldout: list[Conversation]) -> list[Prompt]:
    """The held-out conversations' first user turns, as benchmark prompts."""
    return [Prompt(f"sharegpt:{c.id}", HELDOUT_KIND, first_prompt(c)) for c in heldout]


def write_heldout_prompts(path: str | Path, prompts: list[Prompt]) -> None:
    """Write prompts as JSONL (``{"id", "kind", "prompt"}``), readable by ``data.read_prompts_jsonl``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": p.id, "kind": p.kind, "prompt": p.text}, ensure_ascii=False) for p in prompts]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
