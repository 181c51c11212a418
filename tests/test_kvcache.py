"""The KV page pool and its prefix cache (runtime/engines/kvcache.py), on the host alone: the chained page hash,
reference counts, the LRU order in which cached pages are reclaimed, that a partially filled page or the last
prompt token's page is never adopted, and (hypothesis) that any interleaving of prefills, decode steps and
releases keeps every page in exactly one state, never writes a shared page, and only ever adopts a page that
holds exactly the tokens asked for."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ingot.runtime.engines.kvcache import CacheFullError, PagePool, PrefixChain, page_hash

P = 4  # tokens per page: small, so short prompts span several pages


class Seq:
    """What an engine keeps per sequence for the pool: its pages, its chain, its tokens."""

    def __init__(self):
        self.pages: list[int] = []
        self.chain = PrefixChain()
        self.tokens: list[int] = []


def prefill(pool: PagePool, s: Seq, tokens: list[int]) -> int:
    """An engine's prefill, booking only: adopt, grow for the rest, register. Returns the tokens adopted."""
    hit = pool.adopt(s.pages, s.chain, tokens)
    s.tokens += tokens[:hit]
    rest = tokens[hit:]
    pool.grow(s.pages, len(s.tokens) + len(rest))
    s.tokens += rest
    pool.append(s.pages, s.chain, rest)
    return hit


def test_page_hash_chains_the_parent():
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    assert page_hash(b"", a) == page_hash(b"", list(a))  # same tokens, same hash
    assert page_hash(b"", a) != page_hash(b"", b)
    # the same page after a different first page is a different page (its keys depend on the whole prefix)
    assert page_hash(page_hash(b"", a), b) != page_hash(page_hash(b"", b), b)
    # token ids are hashed as int32: 256 and 1 do not collide the way bytes would
    assert page_hash(b"", [256, 0, 0, 0]) != page_hash(b"", [1, 0, 0, 0])


def test_a_repeated_prompt_adopts_its_full_pages_and_counts_references():
    pool = PagePool(16, P)
    a, b = Seq(), Seq()
    prompt = list(range(10))  # pages [0..4) [4..8) full, [8..10) partial
    assert prefill(pool, a, prompt) == 0
    assert pool.cached == 2 and pool.used == 3
    assert prefill(pool, b, prompt) == 8
    assert b.pages[:2] == a.pages[:2] and b.pages[2] != a.pages[2]  # the partial page is never shared
    assert [pool.refs(p) for p in a.pages] == [2, 2, 1]
    assert pool.used == 4  # shared pages count once
    pool.release(a.pages)
    assert [pool.refs(p) for p in b.pages] == [1, 1, 1] and pool.evictable == 0
    pool.release(b.pages)
    assert pool.used == 0 and pool.evictable == 2 and pool.free == 16
    stats = pool.prefix_stats()
    assert (stats["queried_tokens"], stats["hit_tokens"], stats["hit_rate"]) == (20, 8, 0.4)


def test_the_last_prompt_token_is_always_computed():
    pool = PagePool(16, P)
    a, b = Seq(), Seq()
    prompt = list(range(8))  # exactly two full pages
    prefill(pool, a, prompt)
    assert pool.cached == 2
    # the whole prompt is cached, but its last token's logits are needed: its page is computed again
    assert prefill(pool, b, prompt) == 4
    assert b.pages[0] == a.pages[0] and b.pages[1] != a.pages[1]
    assert pool.cached == 2  # b's copy of the second page has a cached twin: it stays private
    pool.release(b.pages)
    assert pool.evictable == 0 and pool.used == 2  # a holds both; b's private page went back to the free list


def test_a_different_first_page_misses_even_if_later_pages_match():
    pool = PagePool(16, P)
    prefill(pool, Seq(), [1, 1, 1, 1, 2, 2, 2, 2, 9])
    assert prefill(pool, Seq(), [3, 3, 3, 3, 2, 2, 2, 2, 9]) == 0
    assert prefill(pool, Seq(), [1, 1, 1, 1, 2, 2, 2, 3, 9]) == 4  # the first page still hits


def test_decoded_tokens_fill_and_register_pages():
    pool = PagePool(16, P)
    a = Seq()
    prefill(pool, a, [1, 2, 3])
    assert pool.cached == 0
    pool.grow(a.pages, 4)
    pool.append(a.pages, a.chain, [4])  # a decode step completes the first page
    assert pool.cached == 1
    assert prefill(pool, Seq(), [1, 2, 3, 4, 5]) == 4


def test_a_prefill_that_does_not_start_at_a_page_boundary_does_not_look_up():
    pool = PagePool(16, P)
    prefill(pool, Seq(), list(range(12)))
    b = Seq()
    prefill(pool, b, [0, 1])  # fills half a page: b's chain has a tail now
    assert prefill(pool, b, list(range(2, 12))) == 0 and pool.prefix_stats()["queried_tokens"] == 12 + 2
    # a second prefill that starts on a boundary continues the chain (multi-turn): it hits
    c = Seq()
    prefill(pool, c, [0, 1, 2, 3])
    assert prefill(pool, c, list(range(4, 12))) == 4


@pytest.mark.parametrize("n_new", [4, 5])
def test_evictable_pages_are_reclaimed_least_recently_released_first_tail_first(n_new):
    evicted: list[int] = []
    pool = PagePool(6, P, on_evict=evicted.append)
    a, b = Seq(), Seq()
    prefill(pool, a, [1] * 8 + [0])  # pages a0 a1 cached, a2 private
    prefill(pool, b, [2] * 4 + [0])  # page b0 cached, b1 private
    (a0, a1, _), (b0, _) = a.pages, b.pages
    pool.release(a.pages)
    pool.release(b.pages)
    assert pool.free == 6 and pool.evictable == 3 and pool.used == 0
    # 3 pages are free without evicting (one never used, a's and b's private ones); then the LRU goes oldest
    # first: a released before b, and of a's chain the tail before the head
    c = Seq()
    pool.grow(c.pages, n_new * P)
    assert evicted == [a1, a0][: n_new - 3] and pool.prefix_stats()["pages_evicted"] == n_new - 3
    pool.release(c.pages)  # private pages: straight back to the free list
    assert prefill(pool, Seq(), [2] * 4 + [0]) == 4  # b, released last, still hits
    assert prefill(pool, Seq(), [1] * 8 + [0]) == (4 if n_new == 4 else 0)  # a's head outlives its tail
    assert b0 not in evicted


def test_growing_past_the_pool_is_a_cache_full_error():
    pool = PagePool(2, P)
    with pytest.raises(CacheFullError):
        pool.grow([], 3 * P)


def test_double_release_is_refused():
    pool = PagePool(4, P)
    pages: list[int] = []
    pool.grow(pages, P)
    copy = list(pages)
    pool.release(pages)
    with pytest.raises(RuntimeError):
        pool.release(copy)


def test_disabled_prefix_cache_neither_registers_nor_adopts():
    pool = PagePool(8, P, prefix_cache=False)
    a = Seq()
    prefill(pool, a, list(range(9)))
    assert pool.cached == 0
    assert prefill(pool, Seq(), list(range(9))) == 0
    pool.release(a.pages)
    assert pool.evictable == 0 and pool.prefix_stats()["queried_tokens"] == 0


# --- property test: any interleaving ---------------------------------------------------------------

N_PAGES = 12
# a tiny alphabet and a few fixed prompt stems, so that prompts share prefixes often and hits happen
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7, 7, 7, 7, 7]]


class PoolMachine(RuleBasedStateMachine):
    """Sequences start, prefill, decode and end in any order. A model of what each page holds (for each slot,
    the whole token prefix up to it: what its keys and values depend on) checks that an adopted page holds
    exactly the adopter's tokens, and that no write lands in a page anyone else holds."""

    def __init__(self):
        super().__init__()
        self.evicted: list[int] = []
        self.pool = PagePool(N_PAGES, P, on_evict=self.evicted.append)
        self.seqs: list[Seq] = []
        self.holds: dict[int, list[tuple]] = {}  # page -> per slot, the token prefix its K/V was computed from

    def _write(self, s: Seq, start: int) -> None:
        for pos in range(start, len(s.tokens)):
            page = s.pages[pos // P]
            assert self.pool.refs(page) == 1, f"write into page {page} held {self.pool.refs(page)} times"
            slots = self.holds.setdefault(page, [None] * P)
            if pos % P == 0:
                slots[:] = [None] * P  # a page taken afresh (free or reclaimed): its old contents are gone
            slots[pos % P] = tuple(s.tokens[: pos + 1])

    def _room(self, n_new: int, s: Seq) -> bool:
        return self.pool.pages_for(len(s.tokens) + n_new) - len(s.pages) <= self.pool.free

    @rule(stem=st.sampled_from(STEMS), extra=st.lists(st.integers(0, 3), max_size=6))
    def start(self, stem, extra):
        s, tokens = Seq(), stem[: len(stem) - len(extra) % 3] + extra
        if not tokens or not self._room(len(tokens), s):
            return
        first = len(s.pages)
        hit = self.pool.adopt(s.pages, s.chain, tokens)
        assert hit % P == 0 and hit < len(tokens)
        for j in range(first, len(s.pages)):  # an adopted page holds exactly these tokens' keys and values
            assert self.holds[s.pages[j]] == [tuple(tokens[: j * P + i + 1]) for i in range(P)]
        s.tokens += tokens[:hit]
        start = len(s.tokens)
        self.pool.grow(s.pages, len(tokens))
        s.tokens += tokens[hit:]
        self._write(s, start)
        self.pool.append(s.pages, s.chain, tokens[hit:])
        self.seqs.append(s)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), tok=st.integers(0, 3))
    def decode(self, i, tok):
        s = self.seqs[i % len(self.seqs)]
        if not self._room(1, s):
            return
        self.pool.grow(s.pages, len(s.tokens) + 1)
        s.tokens.append(tok)
        self._write(s, len(s.tokens) - 1)
        self.pool.append(s.pages, s.chain, [tok])

    @rule()
    def switch(self):
        """The setting may change between any two calls (benchmarks): nothing may be registered wrongly."""
        self.pool.prefix_cache = not self.pool.prefix_cache

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        s = self.seqs.pop(i % len(self.seqs))
        self.pool.release(s.pages)
        assert s.pages == []

    @invariant()
    def every_page_is_in_exactly_one_state(self):
        pool = self.pool
        held = [p for s in self.seqs for p in s.pages]
        free, lru = pool._free, list(pool._lru)
        assert len(set(free)) == len(free) and not set(free) & set(lru) and not set(free) & set(held)
        assert not set(lru) & set(held)
        assert set(free) | set(lru) | set(held) == set(range(N_PAGES))
        for page in range(N_PAGES):  # a reference per holder: nothing leaks, nothing is freed twice
            assert pool.refs(page) == held.count(page)
        assert pool.used == len(set(held)) and pool.free == N_PAGES - len(set(held))
        assert set(lru) <= set(pool._hash_of)  # evictable pages are cached ones
        assert len(pool._page_of) == len(pool._hash_of) == pool.cached

    @invariant()
    def shared_pages_are_full_and_registered(self):
        for s in self.seqs:
            assert len(s.chain.hashes) == len(s.tokens) // P and len(s.chain.tail) == len(s.tokens) % P
            for j, page in enumerate(s.pages):
                if self.pool.refs(page) > 1:
                    assert j < len(s.chain.hashes) and self.pool._hash_of[page] == s.chain.hashes[j]

    def teardown(self):
        for s in self.seqs:
            self.pool.release(s.pages)
        assert self.pool.used == 0 and self.pool.free == N_PAGES


TestPoolInterleavings = PoolMachine.TestCase
TestPoolInterleavings.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
