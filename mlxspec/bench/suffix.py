"""The first round's cost against the number of documents in the suffix store (issue 46).

    python -m mlxspec.bench.suffix [--docs 1000,20000] [--tokens 1000000] [--requests 30]

A store is filled with ``--docs`` finished documents of random tokens, then ``--requests`` requests run one
after another as in a chat or a server: each opens its document (closing the last one) and drafts its first
round, which is timed (the median is printed). Two layouts: the store at its bound (``--tokens`` in all,
split into N documents: the round's O(L) scan is the same, so what grows with N is the join), and documents of
a fixed size (``--tokens`` / the largest N each: the scan grows with L, about a millisecond per million
tokens). The store before issue 46, which joined every closed document again at each request's first search,
runs beside it on the same documents. Timing only: no test asserts on it; the machine's load is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from ..core.sampling import SamplingParams
from ..drafters.suffix import SuffixDrafter
from ..drafters.suffix_store import SuffixStore, _join


class RejoiningStore(SuffixStore):
    """The store before issue 46: every closed document joined afresh whenever the closed set changed."""

    def searchable(self, exclude=None):
        for doc, owner in list(self._owners.items()):
            drafter = owner()
            if drafter is None or drafter.document != doc:
                del self._owners[doc]
        closed = frozenset(d for d in self._docs if d not in self._owners)
        if closed != getattr(self, "_ids", None):
            self._joined, self._ids = _join([self._docs[d] for d in self._docs if d in closed]), closed
        open_docs = [self._docs[d] for d in self._owners if d != exclude]
        return _join([self._joined, *open_docs]) if open_docs else self._joined


def first_rounds(store_type, num_docs: int, doc_tokens: int, requests: int, seed: int = 0) -> float:
    """Median seconds of a request's first round (open its document, draft once) with ``num_docs``
    documents."""
    rng = np.random.default_rng(seed)
    store = store_type(max_tokens=num_docs * doc_tokens + requests * 64)
    for _ in range(num_docs):
        store.add(rng.integers(0, 1000, size=doc_tokens).tolist())
    drafter, sampling = SuffixDrafter(store, depth=8, min_prob=0.0), SamplingParams()
    drafter.prefill([1, 2, 3])
    drafter.propose([1, 2, 3], 8, sampling)  # the first search of all joins the filled store, once
    times = []
    for _ in range(requests):
        history = rng.integers(0, 1000, size=32).tolist()
        start = time.perf_counter()
        drafter.prefill(history)  # closes the last request's document
        drafter.propose(history, 8, sampling)
        times.append(time.perf_counter() - start)
        drafter.commit(len(history) + 1, [])
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m mlxspec.bench.suffix", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--docs", default="1000,20000", help="document counts, comma-separated. Default: 1000,20000"
    )
    parser.add_argument(
        "--tokens", type=int, default=1_000_000, help="tokens of the full store. Default: 1000000"
    )
    parser.add_argument("--requests", type=int, default=30, help="requests timed per setting. Default: 30")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.docs.split(",")]
    print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for layout in ("at the bound", "fixed size"):
        print(f"\n{layout}: " + ("--tokens split into N documents" if layout == "at the bound"
                                 else f"documents of {args.tokens // max(counts)} tokens"))
        print(f"{'documents':>10} {'tokens':>9} {'now ms':>8} {'before ms':>10}")
        for n in counts:
            size = args.tokens // n if layout == "at the bound" else args.tokens // max(counts)
            now = first_rounds(SuffixStore, n, size, args.requests)
            before = first_rounds(RejoiningStore, n, size, max(3, args.requests // 5))
            print(f"{n:>10} {n * size:>9} {1000 * now:>8.2f} {1000 * before:>10.2f}")
    print(f"\nload average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
