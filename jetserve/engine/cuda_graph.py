"""GraphRunner: CUDA graphs of the decode step (ForwardBatch built on the device, model, logits), one per batch size."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from jetserve.engine.model_runner import ModelRunner


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to `max_batch_size` (which is always a bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size] + list(range(16, max_batch_size, 16))
    return sorted({*sizes, max_batch_size})


class GraphRunner:
    """Static input buffers `[B_max]` (token ids, positions, state slots) and one captured graph per bucket.

    A batch of N sequences replays the smallest bucket B ≥ N; rows N..B are padding: slot 0, position 0, token 0, so
    they write only the reserved slot 0 and nothing in the K/V caches (`slot_mapping` −1). Logits land in one static
    `[B_max, V]` buffer that every graph writes its first B rows of. All graphs share one memory pool.
    """

    def __init__(self, runner: ModelRunner, batch_sizes: list[int]) -> None:
        assert batch_sizes and min(batch_sizes) >= 1
        self.runner = runner
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch_size = self.batch_sizes[-1]
        device = runner.device
        B = self.max_batch_size
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=device)  # [B]
        self.positions = torch.zeros(B, dtype=torch.int64, device=device)  # [B]
        self.state_indices = torch.zeros(B, dtype=torch.int32, device=device)  # [B]
        self.logits = torch.zeros(B, runner.config.vocab_size, dtype=torch.float32, device=device)  # [B, V]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch_size

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.batch_sizes if b >= num_seqs)

    def _step(self, B: int) -> None:
        logits = self.runner.decode_logits(self.input_ids[:B], self.positions[:B], self.state_indices[:B])
        self.logits[:B].copy_(logits)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (so smaller graphs reuse the pool's blocks), on padding inputs."""
        self._pad(0)
        for B in reversed(self.batch_sizes):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the capture: lazy init, autotuning, workspaces
                self._step(B)
                self._step(B)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._step(B)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[B] = graph
        torch.cuda.synchronize()

    def _pad(self, start: int, end: int | None = None) -> None:
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.state_indices[start:end].zero_()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
        """[N] inputs (N ≤ max bucket) → logits [N, V], a view of the static buffer valid until the next replay."""
        N = input_ids.shape[0]
        B = self.bucket(N)
        self.input_ids[:N].copy_(input_ids)
        self.positions[:N].copy_(positions)
        self.state_indices[:N].copy_(state_indices)
        if B > N:
            self._pad(N, B)
        self.graphs[B].replay()
        return self.logits[:N]
