"""Stop sequences found in streamed text in time linear in the text (issue 46).

Checking every prefix of every stop sequence against the held-back text on each new piece
costs the square of a stop's length per piece: one 250 KB stop took 1.5 s a token. Here
each stop sequence carries the Knuth-Morris-Pratt automaton of its prefixes: each new
character moves it in amortised constant time, and its state (the longest prefix of the
stop that the text ends with) is exactly how much text must be held back.
"""

from __future__ import annotations

__all__ = ["StopMatcher"]


def _failure(stop: str) -> list[int]:
    """KMP's table: for each prefix stop[:i+1], its longest proper border's length."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


class StopMatcher:
    """Feed it streamed text; it says what may be sent and when a stop sequence ended it.

    The answer is cut at the first stop sequence to complete (the longest one when several
    complete on the same character), as the text is generated: it is not part of the answer.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._tables = [_failure(s) for s in self.stops]
        self._states = [0] * len(self.stops)
        self._held = ""  # sent text's tail that may still start a stop sequence

    def feed(self, text: str) -> tuple[str, bool]:
        """The text now safe to send, and whether a stop sequence completed (then the
        text is cut before it; feed nothing more)."""
        if not self.stops:
            return text, False
        for pos, char in enumerate(text):
            done = 0
            for i, stop in enumerate(self.stops):
                k, table = self._states[i], self._tables[i]
                while k and stop[k] != char:
                    k = table[k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop):
                    done = max(done, k)
                    k = table[k - 1]
                self._states[i] = k
            if done:
                seen = self._held + text[: pos + 1]
                self._held = ""
                return seen[: len(seen) - done], True
        self._held += text
        keep = max(self._states)
        send = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        return send, False

    def flush(self) -> str:
        """The text held back at the end of the answer (no stop sequence followed)."""
        held, self._held = self._held, ""
        return held
