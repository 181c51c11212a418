"""The paged KV cache's bookkeeping on the host: which pages each sequence holds, and the prefix cache.

The cache itself lives on the GPU as [layer][page, kv_head, slot, head_dim] fp16 arrays; a sequence's tokens sit
in its pages in order (token p in page pages[p // PAGE], slot p % PAGE), so sequences of any length share one
pool without fragmentation, and the server can admit a request only when its pages are free. (The CPU engine
keeps the same books over page-sized chunks of its per-sequence arrays, so both count alike.)

Prefix cache. A full page's keys and values depend only on the tokens up to its end, so a full page is named
by a chained hash, hash(parent page's hash, the page's token ids), and registered under it. A prefill that
starts at a page boundary looks its tokens up page by page and adopts the matching pages (reference count + 1)
instead of computing them; a prompt's last chunk always computes at least its last token, whose logits sample
the next one (an earlier chunk of a prompt prefilled in several samples nothing, and may adopt every page). A
page is shared only once full and registered, and a sequence writes only past its last full page, so a page
with more than one reference is never written. When its last reference goes, a registered page stays cached
in an LRU of evictable pages, reclaimed (oldest first) only when no never-used page is left.

Every page is in exactly one state:
    free        never used, or reclaimed: on the free list
    held        reference count >= 1: in the page lists of that many live sequences
    evictable   reference count 0 and registered: in the LRU, its contents kept for a later hit
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ingot.runtime.errors import IngotError


class CacheFullError(IngotError):
    """No free KV-cache pages left for a sequence to grow."""


ROOT = b""  # the parent hash of a sequence's first page


def page_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chained hash naming a full page: sha256(parent hash || the page's token ids as int32). A collision
    would hand one prompt another's keys and values, so it is a cryptographic hash (as in vLLM), not hash()."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int32).tobytes()).digest()


@dataclass
class PrefixChain:
    """One sequence's hash chain: the hash of each of its full pages in order, and the tokens past them."""

    hashes: list[bytes] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)  # tokens of the partially filled last page

    @property
    def parent(self) -> bytes:
        return self.hashes[-1] if self.hashes else ROOT


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens of prefills that looked the cache up
    hit_tokens: int = 0  # of those, tokens adopted from cached pages instead of computed
    evicted_pages: int = 0  # cached pages reclaimed for new contents


class PagePool:
    def __init__(
        self,
        n_pages: int,
        page_size: int,
        *,
        prefix_cache: bool = True,
        on_evict: Callable[[int], None] | None = None,
    ):
        """n_pages pages of page_size tokens. prefix_cache=False: no lookups, no registration, a released page
        is free at once (an attribute that may be switched at any time: chains are kept either way, so a page is
        never registered under a hash that is not its own). on_evict(page): called when a cached page is
        reclaimed (the CPU engine drops its copy)."""
        self.n_pages, self.page_size = n_pages, page_size
        self.prefix_cache = prefix_cache
        self._on_evict = on_evict
        self._free = list(range(n_pages - 1, -1, -1))  # pop() hands out low page ids first
        self._refs = [0] * n_pages
        self._page_of: dict[bytes, int] = {}  # hash -> the registered page holding it
        self._hash_of: dict[int, bytes] = {}  # registered page -> its hash
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable pages, least recently released first
        self.stats = PrefixStats()

    # --- counts -----------------------------------------------------------------------------------

    @property
    def free(self) -> int:
        """Pages a sequence can still get: never-used ones plus evictable cached ones (reclaimed on demand)."""
        return len(self._free) + len(self._lru)

    @property
    def used(self) -> int:
        """Pages held by live sequences (a shared page counts once)."""
        return self.n_pages - self.free

    @property
    def cached(self) -> int:
        """Registered pages, held or evictable."""
        return len(self._hash_of)

    @property
    def evictable(self) -> int:
        return len(self._lru)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def pages_for(self, n_tokens: int) -> int:
        return (n_tokens + self.page_size - 1) // self.page_size

    def prefix_stats(self) -> dict:
        s = self.stats
        return {
            "enabled": self.prefix_cache,
            "queried_tokens": s.queried_tokens,
            "hit_tokens": s.hit_tokens,
            "hit_rate": s.hit_tokens / s.queried_tokens if s.queried_tokens else 0.0,
            "pages_cached": self.cached,
            "pages_evictable": self.evictable,
            "pages_evicted": s.evicted_pages,
        }

    # --- allocation -------------------------------------------------------------------------------

    def needed(self, pages: list[int], n_tokens: int) -> int:
        """Pages a sequence holding `pages` must add to hold n_tokens."""
        return max(0, self.pages_for(n_tokens) - len(pages))

    def require(self, need: int) -> None:
        """CacheFullError unless `need` more pages can be had (a step checks all its sequences' growth at once)."""
        if need > self.free:
            raise CacheFullError(
                f"KV cache full: {need} more pages needed, {self.free} free",
                hint="finish or cancel other sequences, or lower --max-seqs or --ctx, or raise INGOT_KV_FRACTION",
            )

    def grow(self, pages: list[int], n_tokens: int) -> bool:
        """Append pages until `pages` can hold n_tokens. Returns True if pages were added."""
        need = self.needed(pages, n_tokens)
        if not need:
            return False
        self.require(need)
        for _ in range(need):
            page = self._take()
            self._refs[page] = 1
            pages.append(page)
        return True

    def _take(self) -> int:
        """A page with no contents anyone can look up: a never-used one, else the least recently released
        cached one (its hash is forgotten)."""
        if self._free:
            return self._free.pop()
        page, _ = self._lru.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        self.stats.evicted_pages += 1
        if self._on_evict is not None:
            self._on_evict(page)
        return page

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page (a sequence ended). Pages go last-first, so that of an evictable
        chain the tail is reclaimed before the head it hangs from (a head alone still gives hits)."""
        for page in reversed(pages):
            if self._refs[page] <= 0:
                raise RuntimeError(f"KV page {page} released more often than taken")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._lru[page] = None
                else:
                    self._free.append(page)
        pages.clear()

    # --- the prefix cache -------------------------------------------------------------------------

    def adopt(self, pages: list[int], chain: PrefixChain, tokens: Sequence[int], *, sample: bool = True) -> int:
        """Before prefilling `tokens` into a sequence at a page boundary (chain.tail empty, len(pages) ==
        len(chain.hashes)): append to `pages` the cached pages that hold the longest run of its leading full
        pages; when the prefill samples (`sample`: a prompt's last chunk), never the page of the last token, whose
        logits must be computed. Returns the tokens adopted (a multiple of the page size, all of them when a chunk
        that does not sample is all cached pages); the caller computes tokens[returned:]."""
        if not self.prefix_cache or chain.tail or len(pages) != len(chain.hashes):
            return 0
        P = self.page_size
        self.stats.queried_tokens += len(tokens)
        n, end = 0, len(tokens) - 1 if sample else len(tokens)
        while n + P <= end:  # the page [n, n + P) ends before the last token (sample) or with the tokens
            h = page_hash(chain.parent, tokens[n : n + P])
            page = self._page_of.get(h)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._lru[page]
            self._refs[page] += 1
            pages.append(page)
            chain.hashes.append(h)
            n += P
        self.stats.hit_tokens += n
        return n

    def page_hashes(self, chain: PrefixChain, tokens: Sequence[int]) -> list[bytes]:
        """The hashes of the full pages that appending `tokens` to the chain would complete (the chain is not
        changed): what append() will register, for a prefill that wants to know it before computing them."""
        P, tail, parent, out = self.page_size, chain.tail + list(tokens), chain.parent, []
        while len(tail) >= P:
            parent = page_hash(parent, tail[:P])
            out.append(parent)
            del tail[:P]
        return out

    def append(self, pages: list[int], chain: PrefixChain, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """After `tokens` were written into the sequence's pages: extend its chain, and register each page
        they filled. Returns (index in `pages`, page) of the pages registered now (the CPU engine copies their
        contents); a page whose hash is cached already (two sequences computed it at once) stays private."""
        P, tail = self.page_size, chain.tail
        tail.extend(map(int, tokens))
        registered = []
        while len(tail) >= P:
            h = page_hash(chain.parent, tail[:P])
            i = len(chain.hashes)
            page = pages[i]
            if self.prefix_cache and h not in self._page_of and page not in self._hash_of:
                self._page_of[h], self._hash_of[page] = page, h
                registered.append((i, page))
            chain.hashes.append(h)
            del tail[:P]
        return registered
