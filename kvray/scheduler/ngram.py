"""NgramDrafter: draft tokens for a request from its own earlier tokens (prompt lookup).

A request's latest n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are
looked up among the n-grams that occurred earlier in its prompt and output; the tokens that
followed the most recent earlier occurrence are the draft. The model then checks the whole
draft in one step (the scheduler plans it like a short prompt chunk) and keeps it up to the
first token greedy decoding would not have chosen, so the output is exactly greedy's.

Each request's index maps every n-gram to the position after its latest occurrence, and
grows by the few n-grams each new token ends: a lookup is a handful of dict operations,
whatever the request's length.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One request's n-grams -> the position after each one's latest occurrence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # longest first
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in self.sizes]
        self.indexed = 0  # n-grams ending before this position are in `latest`

    def draft(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest of
        `ids`' final n-grams that occurred before (none: an empty draft)."""
        n_ids = len(ids)
        # Index every n-gram that some known token follows: those ending before the last.
        for end in range(self.indexed, n_ids - 1):
            for n, latest in zip(self.sizes, self.latest, strict=True):
                if end + 1 >= n:
                    latest[tuple(ids[end + 1 - n : end + 1])] = end + 1
        self.indexed = max(self.indexed, n_ids - 1)
        for n, latest in zip(self.sizes, self.latest, strict=True):
            if n_ids >= n:
                at = latest.get(tuple(ids[n_ids - n :]))
                if at is not None:
                    return list(ids[at : at + k])
        return []
