"""PrefixDigest: which page-aligned prefixes a prefix cache holds, as chain keys, with a
log of changes a router (in another process) follows.

A prefix of n whole pages is named by its chain key: key(0) = ROOT_KEY and
key(i + 1) = hash((key(i), tokens of page i)). Python hashes ints and tuples of ints the
same in every process (no hash randomisation for them), so a router computes the same keys
from a request's token ids as the engine did from its cache, and a prefix of the request
is cached exactly when its key is in the engine's set (up to a 64-bit collision, which
only misroutes a request: nothing depends on it for correctness).

Invariants:
- `keys` is the set of chain keys of every whole-page prefix the cache holds; a radix tree
  holds every prefix of what it holds, so the set is prefix-closed: if key(i) is in it, so
  is every key(j), j < i;
- the log's entries since sequence number `s` turn the set as of `s` into the set now; a
  follower too far behind (the log is bounded) or of another epoch (a new cache) gets the
  whole set instead.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

ROOT_KEY = 0
MAX_LOG = 1 << 16  # changes kept for followers; one further behind gets a snapshot


def page_keys(
    token_ids: Sequence[int], page_size: int, start: int = 0, parent: int = ROOT_KEY
) -> list[int]:
    """The chain keys of the whole pages of `token_ids` from token `start` (a page
    boundary) on, continuing the chain from `parent` (the key of the first `start` tokens)."""
    keys = []
    key = parent
    end = len(token_ids) // page_size * page_size
    for pos in range(start, end, page_size):
        key = hash((key, tuple(token_ids[pos : pos + page_size])))
        keys.append(key)
    return keys


@dataclass(frozen=True)
class DigestDelta:
    """What a follower at (epoch, seq) needs to reach (`epoch`, `seq`): `added` and
    `removed` keys, or, if `snapshot`, the whole set in `added`."""

    epoch: int
    seq: int
    added: list[int]
    removed: list[int]
    snapshot: bool


class PrefixDigest:
    def __init__(self, max_log: int = MAX_LOG) -> None:
        self.epoch = random.getrandbits(62)  # a new cache (or engine) is a new epoch
        self.keys: set[int] = set()
        self._log: list[tuple[bool, int]] = []  # (added?, key), oldest first
        self._log_start = 0  # sequence number of self._log[0]
        self._max_log = max_log

    @property
    def seq(self) -> int:
        return self._log_start + len(self._log)

    def add(self, keys: Iterable[int]) -> None:
        for k in keys:
            self.keys.add(k)
            self._log.append((True, k))
        self._trim()

    def remove(self, keys: Iterable[int]) -> None:
        for k in keys:
            self.keys.discard(k)
            self._log.append((False, k))
        self._trim()

    def _trim(self) -> None:
        extra = len(self._log) - self._max_log
        if extra > 0:
            del self._log[:extra]
            self._log_start += extra

    def since(self, epoch: int, seq: int) -> DigestDelta:
        """The changes after `seq` of `epoch`; a snapshot if those are gone or unknown."""
        if epoch != self.epoch or not self._log_start <= seq <= self.seq:
            return DigestDelta(self.epoch, self.seq, list(self.keys), [], True)
        final: dict[int, bool] = {}  # each key's last change wins
        for was_added, key in self._log[seq - self._log_start :]:
            final[key] = was_added
        added = [k for k, present in final.items() if present]
        removed = [k for k, present in final.items() if not present]
        return DigestDelta(self.epoch, self.seq, added, removed, False)


class DigestFollower:
    """A router's copy of one engine's digest, kept current by applying deltas."""

    def __init__(self) -> None:
        self.epoch = -1
        self.seq = 0
        self.keys: set[int] = set()

    def apply(self, delta: DigestDelta) -> None:
        if delta.snapshot:
            self.keys = set(delta.added)
        else:  # a key is in at most one of the lists (its net change)
            self.keys.difference_update(delta.removed)
            self.keys.update(delta.added)
        self.epoch, self.seq = delta.epoch, delta.seq

    def matched_pages(self, keys: Sequence[int], also: Callable[[int], bool] | None = None) -> int:
        """How many leading pages of a request (its chain `keys`) this engine holds (or,
        page by page, `also` says it will)."""
        n = 0
        for k in keys:
            if k not in self.keys and (also is None or not also(k)):
                break
            n += 1
        return n
