"""EngineConfig: the frozen knobs of one engine instance (scheduling limits, cache sizing, graphs, device)."""

from __future__ import annotations

from dataclasses import dataclass

from jetserve.engine.prefill_graph import prefill_buckets

DTYPES = ("auto", "float32", "float16", "bfloat16")
# Positions per sequence that plain decode steps may leave the draft behind by (their target features wait in a
# per-slot ring); a sequence whose ring fills catches up on all of them in one draft forward. Session 18 (H200, the
# default pair): a catch-up of a 32-position ring cost ~0.3 ms of host time and 0.11–0.15 ms of device time, mostly
# fixed costs, ~4% of a batch-1 step of the 16 M default model; with 128 positions its speed-up at batch 1 went
# 0.94–0.95x → 0.97–0.98x (the policy decoding plainly throughout).
DEFAULT_FEATURE_RING = 128
# Draft levels per verify step when `spec_steps` is not given: [chain, tree]. With the trained default pair on
# MT-bench (H200, every step verified) a chain of 7 beat chains of 3 and 5 at batch 1, 8 and 32 (session 40), and
# gave 1.68x / 1.52x / 1.29x with the retrained draft (session 41); the adaptive policy also weighs the chain of 3
# (`draft_shapes`' half shape) and plain decoding. A tree's nodes grow by topk² a level, so a tree keeps 3 levels.
DEFAULT_SPEC_STEPS = (7, 3)


@dataclass(frozen=True)
class EngineConfig:
    """What the user chose; sizes found at start-up (pages, slots) live in a separate `MemoryPlan`.

    `max_num_batched_tokens` is the token budget of one step (decode tokens first, then prefill chunks).
    `num_pages` / `num_slots` override the memory plan (each counts the reserved page 0 / slot 0); on a device
    without a memory query (the CPU) the plan sizes the caches from `cpu_cache_bytes` instead.
    `overlap_scheduling` launches each decode or verify step before reading the previous one's tokens, so the host's
    scheduling and postprocessing overlap the device's work (not for prefill or requests asking for log-probs).
    """

    model: str = ""
    tokenizer: str | None = None  # defaults to `model`
    dtype: str = "auto"
    device: str = "auto"  # "auto": cuda when available, else cpu
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    page_size: int = 16  # tokens per KV page
    gpu_memory_utilization: float = 0.9
    num_pages: int | None = None
    num_slots: int | None = None
    cpu_cache_bytes: int = 512 << 20
    draft: str | None = None  # EAGLE-3 draft checkpoint folder: speculative decoding on
    spec_topk: int | None = None  # children per draft node (default 1: a chain)
    spec_steps: int | None = None  # draft levels per step (default: 7 for a chain, 3 for a tree; DEFAULT_SPEC_STEPS)
    spec_num_draft_tokens: int | None = None  # tree nodes per verify step, root included (default 1 + topk*steps)
    spec_adaptive: bool = True  # per step, pick the tree size (or none) that the measured speed favours
    spec_feature_ring: int | None = None  # positions the draft may lag behind plain decoding (default 128)
    enforce_eager: bool = False  # no CUDA graphs
    overlap_scheduling: bool = True  # decode/verify one step ahead: launch step k + 1 before reading step k's tokens
    cuda_graph_max_batch_size: int | None = None  # defaults to max_num_seqs
    # Comma-separated decode buckets to capture, e.g. "1,8,32", in place of 1, 2, 4, 8 and every 16 up to the largest:
    # batches in between pad up, past the largest run eagerly. A single-GPU engine captures them all in one stream
    # capture (`graph_split`), so their number does not slow them (a process's fourth capture did: sessions 32-33).
    cuda_graph_batch_sizes: str | None = None
    # PREFILL steps of up to this many tokens (up to 8 sequences, no image rows or prompt log-probs) replay a CUDA
    # graph of their token bucket (`engine.prefill_graph`; no bucket past max_model_len): a batch-1 prefill is
    # host-bound, ~60 µs of launches a kernel. 0: off.
    prefill_graph_max_tokens: int = 2048
    tensor_parallel_size: int = 1  # ranks (GPUs) one engine's model is split over (jetserve.distributed)
    data_parallel_size: int = 1  # engine replicas behind one server (jetserve.server.router)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be ≥ 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be ≥ 2, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages: must be ≥ 2 (page 0 is reserved), got {self.num_pages}")
        if self.num_slots is not None and self.num_slots < 2:
            raise ValueError(f"num_slots: must be ≥ 2 (slot 0 is reserved), got {self.num_slots}")
        self._check_speculation()
        if self.prefill_graph_max_tokens < 0:
            raise ValueError(f"prefill_graph_max_tokens: must be ≥ 0 (0: no prefill graphs), got "
                             f"{self.prefill_graph_max_tokens}")  # fmt: skip
        if self.cuda_graph_max_batch_size is not None and self.cuda_graph_max_batch_size < 1:
            raise ValueError(f"cuda_graph_max_batch_size: must be ≥ 1, got {self.cuda_graph_max_batch_size}")
        self._check_graph_batch_sizes()
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be ≥ 1, got {getattr(self, name)}")

    def _check_graph_batch_sizes(self) -> None:
        if self.cuda_graph_batch_sizes is None:
            return
        if self.cuda_graph_max_batch_size is not None:
            raise ValueError("cuda_graph_batch_sizes: set with cuda_graph_max_batch_size (give one of them)")
        sizes = self.graph_batch_sizes
        if sizes[-1] > self.max_num_seqs:
            raise ValueError(f"cuda_graph_batch_sizes: {sizes[-1]} is past max_num_seqs ({self.max_num_seqs})")

    @property
    def graph_batch_sizes(self) -> tuple[int, ...] | None:
        """`cuda_graph_batch_sizes` parsed: sorted, without repeats (None when not given)."""
        text = self.cuda_graph_batch_sizes
        if text is None:
            return None
        parts = text.split(",") if isinstance(text, str) else text  # from Python, a list of ints also does
        try:
            sizes = sorted({int(part) for part in parts})
        except (TypeError, ValueError):
            sizes = []
        if not sizes or sizes[0] < 1:
            raise ValueError(f"cuda_graph_batch_sizes: {text!r} must list positive integers, e.g. 1,8,32")
        return tuple(sizes)

    def _check_speculation(self) -> None:
        spec_fields = ("spec_topk", "spec_steps", "spec_num_draft_tokens", "spec_feature_ring")
        if not self.draft:
            given = [name for name in spec_fields if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{given[0]}: set without draft (speculative decoding needs a draft checkpoint)")
            return
        for name in ("spec_topk", "spec_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be ≥ 1, got {value}")
        if self.spec_feature_ring is not None and self.spec_feature_ring < 2:
            raise ValueError(f"spec_feature_ring: must be ≥ 2, got {self.spec_feature_ring}")
        topk, steps = self.speculation
        largest = max_tree_nodes(topk, steps)
        n = self.spec_num_draft_tokens
        if n is not None and not 2 <= n <= largest:
            raise ValueError(
                f"spec_num_draft_tokens: {n} must be in [2, {largest}] for spec_topk {topk} and spec_steps {steps} "
                f"(the root plus at most topk + (steps - 1) * topk^2 drafted candidates)"
            )
        if self.draft_tree_size > self.max_num_batched_tokens:
            raise ValueError(
                f"spec_num_draft_tokens: {self.draft_tree_size} exceeds max_num_batched_tokens "
                f"({self.max_num_batched_tokens}), so no verify step could run"
            )

    def prefill_graph_buckets(self, max_model_len: int) -> list[int]:
        """The token buckets of the prefill graphs a single-GPU engine captures (none with enforce_eager, or 0): none
        past `max_model_len`, so that a bucket's padding sequence stays within a sequence's positions and pages."""
        if self.enforce_eager or self.tensor_parallel_size > 1:
            return []
        return prefill_buckets(min(self.prefill_graph_max_tokens, max_model_len), self.max_num_batched_tokens)

    @property
    def speculation(self) -> tuple[int, int]:
        """(topk, steps) with defaults filled in (meaningful only with a draft)."""
        topk = self.spec_topk or 1
        return topk, self.spec_steps or DEFAULT_SPEC_STEPS[topk > 1]

    @property
    def feature_ring(self) -> int:
        """Positions of target features kept per sequence for the draft's deferred catch-up (default filled in)."""
        return self.spec_feature_ring or DEFAULT_FEATURE_RING

    @property
    def draft_tree_size(self) -> int:
        """Tree nodes of the largest verify step, root included (0 without a draft); sizes the SWA ring."""
        if not self.draft:
            return 0
        if self.spec_num_draft_tokens is not None:
            return self.spec_num_draft_tokens
        topk, steps = self.speculation
        return min(max_tree_nodes(topk, steps), 1 + topk * steps)


def max_tree_nodes(topk: int, steps: int) -> int:
    """The most nodes a draft of `steps` levels with `topk` children per node can offer: the root, topk at the first
    level and topk^2 candidates at each later one (every frontier node's top-k)."""
    return 1 + topk + (steps - 1) * topk * topk
