"""Stop strings: end generation at the first occurrence of any of them in the output text.

Exact even when a stop string spans several tokens accepted in one round: ``StopStrings.cut`` reads
a round's tokens in order before the round is committed, so the cache keeps exactly the tokens up
to the one that completes the stop string, and nothing after it is generated. ``HeldText`` holds
back streamed text that could still become a stop string, so no part of one is ever streamed
(the output ends just before it, as in OpenAI-style APIs).
"""

from __future__ import annotations


def check_stops(stops) -> tuple[str, ...]:
    """Stop strings as a tuple: one ``str`` is one stop string (as OpenAI-style APIs take it), never its
    characters; a list, tuple or set gives several; ``None`` gives none.

    Raises:
        TypeError: ``stop`` is neither text nor a list, tuple or set of text (bytes, a number, a dict...).
        ValueError: an empty stop string.
    """
    if stops is None:
        return ()
    if isinstance(stops, str):
        stops = (stops,)
    elif isinstance(stops, (list, tuple)):
        stops = tuple(stops)
    elif isinstance(stops, (set, frozenset)):
        stops = tuple(sorted(stops, key=repr))
    else:
        raise TypeError(f"stop must be text (str) or a list of texts, got {type(stops).__name__}")
    for stop in stops:
        if not isinstance(stop, str):
            raise TypeError(f"stop strings must be text (str), got {stop!r}")
        if not stop:
            raise ValueError("stop strings must be non-empty text, got ''")
    return stops


class StopStrings:
    """Finds where the output first contains a stop string, token by token.

    Args:
        tokenizer: The target's ``TokenizerWrapper`` (its own streaming detokenizer is used).
        stops: Non-empty stop strings.

    Attributes:
        text_end: Characters of output text before the stop string, once one was found; else ``None``.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.stops, self.detokenizer = stops, tokenizer.detokenizer
        self.longest = max(map(len, stops))
        self.text_end: int | None = None
        self._searched = 0  # text before this index cannot start a stop string any more

    def cut(self, tokens: list[int]) -> int | None:
        """Read ``tokens`` (the next committed ones, stop tokens excluded) in order.

        Returns:
            int | None: How many of them to keep when one completes a stop string (reading stops
            there), else ``None`` (all were read).
        """
        for i, token in enumerate(tokens):
            self.detokenizer.add_token(token)
            text = self.detokenizer.text
            found = [k for k in (text.find(stop, self._searched) for stop in self.stops) if k >= 0]
            if found:
                self.text_end = min(found)
                return i + 1
            self._searched = max(0, len(text) - self.longest + 1)
        return None


class HeldText:
    """Streams text deltas, holding back a tail that may be the start of a stop string.

    Args:
        stops: The stop strings (none: nothing is held).
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.text, self.sent = stops, "", 0

    def push(self, segment: str, final: bool = False, end: int | None = None) -> str:
        """Add ``segment`` of output text; return what may be streamed now.

        Args:
            segment: The next text delta.
            final: The generation ended: release everything up to ``end``.
            end: Where a found stop string starts (its characters and any after it are never
                streamed); ``None`` = the whole text.
        """
        self.text += segment
        if final:
            limit = len(self.text) if end is None else end
        else:
            limit = len(self.text) - self._held()
        out = self.text[self.sent : limit]
        self.sent = max(self.sent, limit)
        return out

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for n in range(min(len(self.text), max(map(len, self.stops), default=1) - 1), 0, -1):
            tail = self.text[-n:]
            if any(stop.startswith(tail) for stop in self.stops):
                return n
        return 0
