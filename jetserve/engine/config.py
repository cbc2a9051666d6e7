"""EngineConfig: the frozen knobs of one engine instance (scheduling limits, cache sizing, graphs, device)."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """What the user chose; sizes found at start-up (pages, slots) live in a separate `MemoryPlan`.

    `max_num_batched_tokens` is the token budget of one step (decode tokens first, then prefill chunks).
    `num_pages` / `num_slots` override the memory plan (each counts the reserved page 0 / slot 0); on a device
    without a memory query (the CPU) the plan sizes the caches from `cpu_cache_bytes` instead.
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
    max_draft_tokens: int = 0  # speculative tokens per step (issue 5); sizes the SWA ring
    enforce_eager: bool = False  # no CUDA graphs
    cuda_graph_max_batch_size: int | None = None  # defaults to max_num_seqs

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
        if self.max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens: must be ≥ 0, got {self.max_draft_tokens}")
        if self.cuda_graph_max_batch_size is not None and self.cuda_graph_max_batch_size < 1:
            raise ValueError(f"cuda_graph_max_batch_size: must be ≥ 1, got {self.cuda_graph_max_batch_size}")
