"""The paged KV cache's bookkeeping on the host: which pages each sequence owns.

The cache itself lives on the GPU as [layer][page, kv_head, slot, head_dim] fp16 arrays; a sequence's tokens sit
in its pages in order (token p in page pages[p // PAGE], slot p % PAGE), so sequences of any length share one
pool without fragmentation, and the server can admit a request only when its pages are free.
"""

from __future__ import annotations

from ingot.runtime.errors import IngotError


class CacheFullError(IngotError):
    """No free KV-cache pages left for a sequence to grow."""


class PagePool:
    def __init__(self, n_pages: int, page_size: int):
        self.n_pages, self.page_size = n_pages, page_size
        self._free = list(range(n_pages - 1, -1, -1))  # pop() hands out low page ids first

    @property
    def free(self) -> int:
        return len(self._free)

    def pages_for(self, n_tokens: int) -> int:
        return (n_tokens + self.page_size - 1) // self.page_size

    def grow(self, pages: list[int], n_tokens: int) -> bool:
        """Append pages until `pages` can hold n_tokens. Returns True if pages were added."""
        need = self.pages_for(n_tokens) - len(pages)
        if need <= 0:
            return False
        if need > len(self._free):
            raise CacheFullError(
                f"KV cache full: {need} more pages needed, {len(self._free)} free",
                hint="finish or cancel other sequences, or lower --max-seqs or --ctx, or raise INGOT_KV_FRACTION",
            )
        pages.extend(self._free.pop() for _ in range(need))
        return True

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
        pages.clear()
