"""BlockManager: which physical KV pages each sequence holds (`attn` layers: paged; `swa` layers: a ring per slot)."""

from __future__ import annotations

from jetserve.engine.sequence import Sequence


class BlockManager:
    """Host-side page accounting; the K/V tensors themselves belong to the ModelRunner.

    `attn` layers: a sequence's logical page i (tokens `[i*page_size, (i+1)*page_size)`) lives in physical page
    `seq.pages[i]`, allocated as the sequence grows. Page 0 is reserved for padded rows and never handed out.

    `swa` layers keep only their window: each state slot owns a fixed ring of `MemoryPlan.ring_tokens` tokens
    (whole pages, at least window + draft tokens) in the SWA caches, position p at ring offset `p % ring_tokens`.
    The ring comes and goes with the slot, so it needs no accounting here; `ModelRunner` addresses it by slot, and
    slot 0's ring is the padding target.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages >= 2 and page_size >= 1
        self.num_pages = num_pages
        self.page_size = page_size
        # A stack: the most recently freed page is reused first (it is likelier to be warm in L2).
        self._free: list[int] = list(range(num_pages - 1, 0, -1))

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def max_tokens_per_seq(self) -> int:
        """The most tokens one sequence can hold when it has every page."""
        return self.num_usable_pages * self.page_size

    def pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Pages `seq` must add to cache `num_new_tokens` more tokens after its computed ones."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.page_size) - len(seq.pages))

    def num_fitting_tokens(self, seq: Sequence) -> int:
        """How many more tokens `seq` could cache with its pages plus every free page."""
        return (len(seq.pages) + len(self._free)) * self.page_size - seq.num_computed_tokens

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` the pages for `num_new_tokens` more tokens (the caller checked `num_fitting_tokens`)."""
        needed = self.pages_needed(seq, num_new_tokens)
        assert needed <= len(self._free), f"{seq}: needs {needed} pages, {len(self._free)} free"
        for _ in range(needed):
            seq.pages.append(self._free.pop())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the pages past the first `num_tokens` tokens (after a verify step rejected part of its tree)."""
        keep = -(-num_tokens // self.page_size)
        while len(seq.pages) > keep:
            self._free.append(seq.pages.pop())

    def free(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.pages))
        seq.pages = []
        assert len(self._free) <= self.num_pages - 1, "a page was freed twice"
