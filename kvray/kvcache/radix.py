"""The "radix" prefix cache: a radix tree over token ids whose edges hold token slots.

Invariants (checked by `check_integrity`):
- every non-root node's key and value have the same, non-zero length, a multiple of
  page_size, so nodes own whole pages and eviction frees whole pages;
- a node's children are keyed by their first page of token ids, which are distinct;
- locking a handle adds a reference to every node on its path to the root, so a node's
  ref_count is at least any child's: an unlocked node has an unlocked subtree, and
  evicting unlocked leaves repeatedly can reach every evictable slot;
- `evictable_size` / `protected_size` are the slots of unlocked / locked nodes;
- `node.pages` holds the chain key (kvcache.digest) of each page of the node, and
  `digest.keys` is the union of every node's: the whole-page prefixes the tree holds.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from kvray.kvcache.base import BaseCacheHandle, BasePrefixCache, SizeInfo
from kvray.kvcache.digest import ROOT_KEY, PrefixDigest, page_keys

_EMPTY = np.zeros(0, dtype=np.int32)


class RadixTreeNode:
    __slots__ = (
        "key",
        "value",
        "pages",
        "children",
        "parent",
        "ref_count",
        "last_access",
        "uid",
    )
    _uids = itertools.count()

    def __init__(
        self, key: tuple[int, ...], value: np.ndarray, parent: RadixTreeNode | None
    ) -> None:
        self.key = key
        self.value = value
        self.pages: list[int] = []  # chain key of each of its pages (kvcache.digest)
        self.children: dict[tuple[int, ...], RadixTreeNode] = {}
        self.parent = parent
        self.ref_count = 0
        self.last_access = 0
        self.uid = next(self._uids)

    def __len__(self) -> int:
        return len(self.key)


def _up_to_root(node: RadixTreeNode) -> Iterator[RadixTreeNode]:
    """`node` and its ancestors, the root (the one node without a parent) excluded."""
    while node.parent is not None:
        yield node
        node = node.parent


class RadixCacheHandle(BaseCacheHandle):
    __slots__ = ("cached_len", "node")

    def __init__(self, cached_len: int, node: RadixTreeNode) -> None:
        self.cached_len = cached_len
        self.node = node

    def get_matched_indices(self) -> np.ndarray:
        parts = [node.value for node in _up_to_root(self.node)]
        if not parts:
            return _EMPTY
        parts.reverse()
        return np.concatenate(parts)


class RadixPrefixCache(BasePrefixCache):
    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self._digest = self.digest = PrefixDigest()
        self.root = RadixTreeNode((), _EMPTY, None)
        self.root.ref_count = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0
        self._clock = 0

    # -- lookup ---------------------------------------------------------------------------

    def _walk(self, ids: tuple[int, ...]) -> tuple[RadixTreeNode, int]:
        """Follow `ids` (already page-aligned) down the tree; split the last node if the
        match ends inside it. Returns the deepest node whose whole path matches, and the
        matched length. Touches every node on the path (LRU)."""
        ps = self.page_size
        n = len(ids)
        self._clock += 1
        now = self._clock
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(ids[pos : pos + ps])
            if child is None:
                break
            key = child.key
            klen = len(key)
            if klen <= n - pos and ids[pos : pos + klen] == key:
                m = klen
            else:
                m, limit = ps, min(klen, n - pos)
                while m < limit and key[m : m + ps] == ids[pos + m : pos + m + ps]:
                    m += ps
            child.last_access = now
            if m < klen:
                child = self._split(child, m)
            node, pos = child, pos + m
            if m < klen:
                break
        return node, pos

    def _split(self, node: RadixTreeNode, m: int) -> RadixTreeNode:
        """Cut `node` after `m` tokens; the new upper half takes its place in the tree with
        the same lock count and time, so sizes and handles stay valid."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < m < len(node) and m % ps == 0
        upper = RadixTreeNode(node.key[:m], node.value[:m], parent)
        upper.ref_count = node.ref_count
        upper.last_access = node.last_access
        upper.pages, node.pages = node.pages[: m // ps], node.pages[m // ps :]
        parent.children[upper.key[:ps]] = upper
        node.key, node.value, node.parent = node.key[m:], node.value[m:], upper
        upper.children[node.key[:ps]] = node
        return upper

    def _aligned(self, input_ids: Sequence[int]) -> tuple[int, ...]:
        n = len(input_ids) // self.page_size * self.page_size
        return tuple(input_ids[:n])

    def match_prefix(self, input_ids: Sequence[int]) -> RadixCacheHandle:
        node, matched = self._walk(self._aligned(input_ids))
        return RadixCacheHandle(matched, node)

    def insert_prefix(
        self, input_ids: Sequence[int], indices: np.ndarray
    ) -> tuple[int, RadixCacheHandle]:
        ids = self._aligned(input_ids)
        n = len(ids)
        node, prefix_len = self._walk(ids)
        if prefix_len < n:
            new = RadixTreeNode(
                ids[prefix_len:], np.array(indices[prefix_len:n], dtype=np.int32), node
            )
            new.last_access = self._clock
            parent_key = node.pages[-1] if node.pages else ROOT_KEY
            new.pages = page_keys(ids, self.page_size, prefix_len, parent_key)
            self._digest.add(new.pages)
            node.children[new.key[: self.page_size]] = new
            self._evictable += n - prefix_len
            node = new
        return prefix_len, RadixCacheHandle(n, node)

    # -- locking and eviction ----------------------------------------------------------------

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        assert isinstance(handle, RadixCacheHandle)
        if unlock:
            for node in _up_to_root(handle.node):
                assert node.ref_count > 0, "unlock of an unlocked radix node"
                node.ref_count -= 1
                if node.ref_count == 0:
                    self._protected -= len(node)
                    self._evictable += len(node)
        else:
            for node in _up_to_root(handle.node):
                if node.ref_count == 0:
                    self._evictable -= len(node)
                    self._protected += len(node)
                node.ref_count += 1

    def evict(self, size: int) -> np.ndarray:
        if size <= 0:
            return _EMPTY
        if size > self._evictable:
            raise RuntimeError(
                f"cannot evict {size} slots: only {self._evictable} are unlocked in the cache"
            )
        leaves = [
            (n.last_access, n.uid, n) for n in self._nodes() if not n.children and n.ref_count == 0
        ]
        heapq.heapify(leaves)
        evicted: list[np.ndarray] = []
        total = 0
        while total < size:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[: self.page_size]]
            node.parent = None
            self._digest.remove(node.pages)
            evicted.append(node.value)
            total += len(node)
            self._evictable -= len(node)
            if parent is not self.root and not parent.children and parent.ref_count == 0:
                heapq.heappush(leaves, (parent.last_access, parent.uid, parent))
        return np.concatenate(evicted)

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self._evictable, self._protected)

    @property
    def evictable_size(self) -> int:
        return self._evictable

    # -- inspection ---------------------------------------------------------------------------

    def _nodes(self) -> Iterator[RadixTreeNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_indices(self) -> np.ndarray:
        parts = [n.value for n in self._nodes()]
        return np.concatenate(parts) if parts else _EMPTY

    def check_integrity(self) -> None:
        ps = self.page_size
        evictable = protected = 0
        for node in self._nodes():
            parent = node.parent
            assert parent is not None and parent.children.get(node.key[:ps]) is node
            assert len(node) > 0 and len(node) % ps == 0, "node not page aligned"
            assert node.value.shape == (len(node),), "key/value length mismatch"
            if parent is not self.root:
                assert parent.ref_count >= node.ref_count, "child locked more than parent"
            assert node.ref_count >= 0
            if node.ref_count:
                protected += len(node)
            else:
                evictable += len(node)
            if ps > 1:  # each page's slots are one page, consecutive from its start
                pages = node.value.reshape(-1, ps)
                assert (pages[:, 0] % ps == 0).all(), "page does not start at a page slot"
                assert (pages - pages[:, :1] == np.arange(ps)).all(), "page slots not contiguous"
        assert (evictable, protected) == (self._evictable, self._protected), "size drift"
        keys: set[int] = set()
        for node in self._nodes():  # each page named by its whole prefix (kvcache.digest)
            parent = node.parent
            assert parent is not None and len(node.pages) == len(node) // ps, "page keys drift"
            # A node's keys chain on from its parent's (checked at the first page; the rest
            # of a node's chain is computed once, at insert, and only ever sliced).
            parent_key = parent.pages[-1] if parent.pages else ROOT_KEY
            assert node.pages[0] == page_keys(node.key[:ps], ps, 0, parent_key)[0], "chain cut"
            keys.update(node.pages)
        assert keys == self._digest.keys, "digest differs from the tree"
        slots = self.all_indices()
        assert len(np.unique(slots)) == len(slots), "a slot is held twice by the cache"
