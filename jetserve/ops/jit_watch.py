"""Which Triton kernels specialize (compile, or load from the disk cache) while a block of code runs.

Triton builds one binary per kernel per specialization of its arguments (integers equal to 1 or multiples of 16,
pointer alignment, constexprs) on first use in a process. The first use costs from milliseconds (a binary from the
disk cache) to seconds (a compile), so a specialization first met inside a timed region shows up as a slow step;
`watch_specializations` names them. Off the GPU the interpreter compiles nothing, and the count stays 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def watch_specializations() -> Iterator[Counter]:
    """Counts, by kernel name, the specializations built while the block runs (chaining any hook already set)."""
    from triton import knobs

    seen: Counter = Counter()
    previous = knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        seen[getattr(fn, "name", "?")] += 1
        return previous(*args, **kwargs) if previous is not None else False

    knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook = previous
