"""The suffix drafter's process-wide store of earlier outputs: bounded, evictable, joined incrementally.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) keeps earlier outputs in a global suffix tree; the
suffix drafter (``suffix.py``) searches this store instead, a flat token array (see its module docstring for
the search). Documents are outputs (one per request), chat turns and corpus files, separated by ``-1``.
"""

from __future__ import annotations

import weakref
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Tokens the global store keeps before evicting its oldest documents (about 8 MB).
DEFAULT_STORE_TOKENS = 1_000_000
#: Corpus files larger than this are skipped (binary blobs, data dumps).
MAX_CORPUS_FILE_BYTES = 2_000_000
#: Ends each document in a searched array.
SEPARATOR = -1


@dataclass(frozen=True)
class StoreStats:
    """Size of a global suffix store.

    Attributes:
        documents: Documents held (outputs, chat turns, corpus files).
        tokens: Tokens held.
        max_tokens: The bound; the oldest documents are evicted beyond it.
        bytes: Memory of the token arrays, bytes (documents plus the joined search copy).
        evicted_documents: Documents evicted so far.
    """

    documents: int
    tokens: int
    max_tokens: int
    bytes: int
    evicted_documents: int


class SuffixStore:
    """A bounded, evictable store of token documents shared by every suffix drafter of a process.

    A drafter opens a document at each prefill (the prompt's last ``PROMPT_CONTEXT`` tokens) and
    appends each round's committed tokens to it; a document is searchable by other drafters at once,
    and becomes part of the joined search array when its drafter moves on or is gone. Beyond
    ``max_tokens`` the oldest documents are evicted (a document stops growing at ``max_tokens``).

    The joined array holds the closed documents in the order they were opened, each followed by a ``-1``,
    in a buffer that grows by doubling: a document that closes after every other closed one was opened (a
    chat, a server: one request after another) is copied in once, amortised O(its length), and evicting the
    oldest documents only moves the start of the live part (the buffer is compacted when over half of it is
    dead). A document that closes while a newer one is already joined (two drafters writing in turns) has
    the joined array rebuilt, O(stored tokens), to keep that order: the searches, and so the drafts, are
    exactly those of joining every closed document afresh.

    Args:
        max_tokens: Bound on the tokens held.

    Attributes:
        tokens_joined: Tokens (separators included) of documents copied into the joined array so far: the
            store's work for its searches, which tests and ``python -m mlxspec.bench.suffix`` read
            (the buffer's doubling and compaction copy too, amortised O(1) a token).

    Raises:
        ValueError: ``max_tokens < 1``.
    """

    def __init__(self, max_tokens: int = DEFAULT_STORE_TOKENS):
        self.max_tokens = max_tokens
        self._docs: OrderedDict[int, array] = OrderedDict()
        self._owners: dict[int, weakref.ref] = {}  # open documents → the drafter writing them
        self._buffer = np.zeros(0, dtype=np.int32)  # the joined closed documents live in [_start, _end)
        self._start = self._end = 0
        self._spans: OrderedDict[int, int] = OrderedDict()  # joined documents (id order) → tokens + separator
        self._closed: list[int] = []  # closed documents not joined yet
        self.num_tokens, self.evicted_documents, self._next_id, self.tokens_joined = 0, 0, 0, 0
        self.corpora: set[tuple[str, int]] = set()
        self.resize(max_tokens)

    def resize(self, max_tokens: int) -> None:
        """Set the bound (evicting at once if the store is over it).

        Raises:
            ValueError: ``max_tokens < 1``.
        """
        if max_tokens < 1:
            raise ValueError(f"--suffix-store-tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._evict()

    def open(self, owner: object, tokens: list[int]) -> int:
        """Start a document written by ``owner`` (held weakly), beginning with ``tokens``; returns its id."""
        doc = self._new(tokens)
        self._owners[doc] = weakref.ref(owner)
        self._evict(keep=doc)
        return doc

    def add(self, tokens: list[int]) -> int:
        """Add a finished document (a corpus file); returns its id."""
        doc = self._new(tokens)
        self._closed.append(doc)
        self._evict(keep=doc)
        return doc

    def _new(self, tokens: list[int]) -> int:
        doc, self._next_id = self._next_id, self._next_id + 1
        self._docs[doc] = array("i", tokens[: self.max_tokens])
        self.num_tokens += len(self._docs[doc])
        return doc

    def append(self, doc: int | None, tokens: list[int]) -> None:
        """Append committed tokens to an open document (nothing if it was evicted or is full)."""
        target = self._docs.get(doc)
        if target is None or not tokens:
            return
        tokens = tokens[: self.max_tokens - len(target)]
        target.extend(tokens)
        self.num_tokens += len(tokens)
        self._evict(keep=doc)

    def _evict(self, keep: int | None = None) -> None:
        while self.num_tokens > self.max_tokens and len(self._docs) > (keep is not None):
            oldest = next(d for d in self._docs if d != keep)
            self.num_tokens -= len(self._docs.pop(oldest))
            self._owners.pop(oldest, None)
            self.evicted_documents += 1
            if oldest in self._spans:  # the oldest joined document: the live part starts after it
                if next(iter(self._spans)) != oldest:
                    raise AssertionError("the joined documents are out of order")  # never: ids ascend
                self._start += self._spans.pop(oldest)
        live = self._end - self._start
        if self._start > live:  # over half of the buffer is dead: release it
            self._reallocate(2 * live)

    def _reallocate(self, capacity: int) -> None:
        """Move the live part of the joined array to the start of a new buffer of ``capacity`` tokens (a new
        array: views handed out earlier keep what they showed)."""
        live = self._end - self._start
        buffer = np.empty(capacity, dtype=np.int32)
        buffer[:live] = self._buffer[self._start : self._end]
        self._buffer, self._start, self._end = buffer, 0, live

    def _join_closed(self) -> None:
        """Copy the documents closed since the last search into the joined array, in id order."""
        closed = sorted(d for d in self._closed if d in self._docs)
        self._closed = []
        if closed and self._spans and closed[0] < next(reversed(self._spans)):  # out of order: rebuild
            closed = sorted([*self._spans, *closed])
            self._spans, self._buffer, self._start, self._end = (
                OrderedDict(),
                np.zeros(0, dtype=np.int32),
                0,
                0,
            )
        for doc in closed:
            tokens = self._docs[doc]
            self._spans[doc] = len(tokens) + 1 if len(tokens) else 0
            if not len(tokens):
                continue
            if self._end + len(tokens) + 1 > self._buffer.shape[0]:  # doubling: amortised O(1) a token
                self._reallocate(2 * (self._end - self._start + len(tokens) + 1))
            self._buffer[self._end : self._end + len(tokens)] = np.frombuffer(tokens, dtype=np.int32)
            self._buffer[self._end + len(tokens)] = SEPARATOR
            self._end += len(tokens) + 1
            self.tokens_joined += len(tokens) + 1

    def searchable(self, exclude: int | None = None) -> np.ndarray:
        """Every document but ``exclude``, joined by ``-1`` separators, shape [L], int32: the closed ones in
        the order they were opened, then the open ones (a view of the store's buffer that later changes never
        write into)."""
        for doc, owner in list(self._owners.items()):
            drafter = owner()
            if drafter is None or drafter.document != doc:  # its writer is gone or moved on: closed
                del self._owners[doc]
                self._closed.append(doc)
        self._join_closed()
        joined = self._buffer[self._start : self._end]
        open_docs = [self._docs[d] for d in self._owners if d != exclude]
        return _join([joined, *open_docs]) if open_docs else joined

    def stats(self) -> StoreStats:
        """Documents, tokens and bytes held now."""
        held = sum(doc.itemsize * len(doc) for doc in self._docs.values())
        return StoreStats(len(self._docs), self.num_tokens, self.max_tokens, held + self._buffer.nbytes,
                          self.evicted_documents)


def _join(docs: list) -> np.ndarray:
    pieces = []
    for doc in docs:
        if doc is not None and len(doc):
            pieces += [np.asarray(doc, dtype=np.int32), np.array([SEPARATOR], dtype=np.int32)]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


_STORES: dict[tuple, SuffixStore] = {}


def global_store(key: tuple = (), max_tokens: int = DEFAULT_STORE_TOKENS) -> SuffixStore:
    """The process-wide store for one vocabulary ``key`` (created on first use, then resized to
    ``max_tokens``)."""
    store = _STORES.get(key)
    if store is None:
        store = _STORES[key] = SuffixStore(max_tokens)
    else:
        store.resize(max_tokens)
    return store


def global_store_stats() -> dict[tuple, StoreStats]:
    """``StoreStats`` of every global store of this process, by vocabulary key (the memory report)."""
    return {key: store.stats() for key, store in _STORES.items()}


def load_corpus(store: SuffixStore, path: str, tokenizer, vocab_size: int | None = None) -> int:
    """Tokenize the text files at ``path`` (a file, or every file under a folder) into ``store``.

    A file is read once per process (by path and modification time); files that are not UTF-8
    text, hidden ones and ones over 2 MB are skipped. Ids at or above ``vocab_size`` (tokens the
    target cannot score) become document breaks.

    Returns:
        int: Tokens added.

    Raises:
        ValueError: the path does not exist, holds no text file, or there is no tokenizer.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise ValueError(f"--suffix-corpus: {path} does not exist; give a text file or a folder of them")
    if not hasattr(tokenizer, "encode"):
        raise ValueError("--suffix-corpus needs the target's tokenizer to read text files")
    files = (
        [root]
        if root.is_file()
        else sorted(
            f
            for f in root.rglob("*")
            if f.is_file() and not any(p.startswith(".") for p in f.relative_to(root).parts)
        )
    )
    added, texts = 0, 0
    for file in files:
        key = (str(file.resolve()), file.stat().st_mtime_ns)
        if file.stat().st_size > MAX_CORPUS_FILE_BYTES:
            continue
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts += 1
        if key in store.corpora or not text.strip():
            continue
        tokens = list(tokenizer.encode(text, add_special_tokens=False))
        if vocab_size is not None:
            tokens = [t if t < vocab_size else SEPARATOR for t in tokens]
        store.add(tokens)
        store.corpora.add(key)
        added += len(tokens)
    if texts == 0:
        raise ValueError(f"--suffix-corpus: no UTF-8 text file under {path}")
    return added
