"""PrefillGraphs: CUDA graphs of PREFILL steps, one per token-count bucket (time to first token).

A batch-1 prefill step of the default model launches ~180 kernels and of the 2B ~680, at ~60 µs of host time each
(docs/performance.md, session 49): 12.6 ms against 0.47 ms of GPU work, and 39 ms against 8.7. Replayed as a graph,
the step's host work is one copy of its rows and a launch.

A step of T tokens in N sequences replays the smallest bucket T_b ≥ T, built for N_b = `max_seqs` + 1 rows
(`ModelRunner.prefill_host_rows` pads it): the real sequences, empty rows, and a padding sequence of the T_b − T pad
tokens, all padding in the reserved slot 0, writing no K/V. Each bucket has two graphs: the target's forward and its
logits (then the sampler runs eagerly, as in any step), and, speculating, the draft's catch-up on the step, which
takes the sampled tokens. Steps that do not fit (more tokens or sequences, image rows, prompt log-probs) run
eagerly.

On a device without graphs (the CPU tests) the same padded steps run eagerly: what the graphs replay, checked against
the unpadded step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from jetserve.ops.gated_delta_rule.chunk_table import CHUNK_SIZE

if TYPE_CHECKING:
    from jetserve.engine.model_runner import DraftPrefillInputs, ModelRunner, PrefillLayout
    from jetserve.engine.scheduler import Batch
    from jetserve.model.forward_batch import ForwardBatch

# Token buckets: powers of two up to 256, then steps of at most 1.5x (a step pads to less than 1.5x its tokens).
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
# Sequences a graphed prefill step holds (N_b − 1): admissions of a few prompts at once; more run eagerly.
PREFILL_GRAPH_MAX_SEQS = 8


def prefill_buckets(max_tokens: int, step_budget: int) -> list[int]:
    """The buckets up to `max_tokens` (itself a bucket, as is the step budget where it is smaller); none below the
    smallest bucket (16: a step budget or a context that short runs eagerly), none for 0."""
    limit = min(max_tokens, step_budget)
    if limit < PREFILL_GRAPH_TOKENS[0]:
        return []
    return sorted({*(t for t in PREFILL_GRAPH_TOKENS if t < limit), limit})


@dataclass
class _Bucket:
    """A bucket's forward batch and outputs, as its capture (or eager run) made them: what its replays refresh."""

    fb: ForwardBatch
    counters: torch.Tensor  # [N_b] sampling counter per row
    draft_inputs: DraftPrefillInputs | None
    logits: torch.Tensor  # [N_b, V]
    aux_hidden_states: list[torch.Tensor]  # the draft's target features, [T_b, H] each


class PrefillGraphs:
    """The static rows a replay reads (`block`: `ModelRunner.prefill_host_rows`' [10 or 11, T_b + 1] rows of the
    largest bucket; `tokens` [N_b]: the step's samples, the draft's last inputs), and per bucket its graphs and what
    their capture left in place (`_Bucket`). Without `capture`, `run` and `catch_up` run the same padded steps."""

    def __init__(self, runner: ModelRunner, buckets: list[int], max_seqs: int, capture: bool) -> None:
        assert buckets and max_seqs >= 1
        self.runner = runner
        self.buckets = sorted(buckets)
        self.rows = max_seqs + 1  # N_b: the real rows and the padding sequence
        assert self.buckets[0] + 1 >= -(-self.buckets[0] // CHUNK_SIZE) + self.rows, "a bucket too small for its rows"
        num_rows = 10 + (runner.spec is not None)
        width = self.buckets[-1] + 1
        self.block = torch.zeros(num_rows, width + width % 2, dtype=torch.int64, device=runner.device)  # the rows
        self.tokens = torch.zeros(self.rows, dtype=torch.int64, device=runner.device)  # [N_b] the step's samples
        self.held: dict[int, _Bucket] = {}
        # bucket → the rows of padding alone (what the capture runs on) and their layout, every step's in that bucket
        self._pad_rows: dict[int, tuple[np.ndarray, PrefillLayout]] = {
            bucket: runner.prefill_host_rows(None, np.zeros(0, dtype=np.int64), padded=(bucket, self.rows))
            for bucket in self.buckets
        }
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        # The draft's catch-up runs in the step's `attn` K/V metadata (its pages are those layers'): a model without
        # `attn` layers prefills eagerly while it speculates.
        self.catches_up = runner.spec is not None and runner.has_attn
        self.is_graphed = capture
        if capture:
            self._capture()

    def bucket(self, batch: Batch) -> int | None:
        """The bucket a PREFILL batch replays, or None when it runs eagerly."""
        if len(batch.seqs) >= self.rows or batch.num_tokens > self.buckets[-1]:
            return None
        if self.runner.spec is not None and not self.catches_up:
            return None
        if any(s.images is not None or s.wants_prompt_logprobs for s in batch.seqs):
            return None
        return next(t for t in self.buckets if t >= batch.num_tokens)

    def _forward(self, bucket: int) -> None:
        """The target's forward and logits of the bucket's rows, from the static block (what graph A captures)."""
        runner = self.runner
        fb, counters, draft_inputs = runner.prefill_device_batch(self.block, self._pad_rows[bucket][1])
        hidden = runner.model(fb)  # [T_b, hidden]
        logits = runner.model.compute_logits(hidden[fb.last_indices])  # [N_b, V]
        self.held[bucket] = _Bucket(fb, counters, draft_inputs, logits, runner.model.aux_hidden_states)

    def sampled_tokens(self, num_seqs: int) -> torch.Tensor:
        """Where a step's sampler writes its [num_seqs] tokens when the draft catches up on them (`catch_up` reads them
        there: a greedy step's argmax lands in place, no copy launched). Valid until the next step samples."""
        return self.tokens[:num_seqs]

    def _catch_up(self, bucket: int) -> None:
        """The draft's catch-up on the bucket's tokens, the sampled ones from `tokens` (what graph B captures)."""
        held = self.held[bucket]
        inputs = held.draft_inputs
        next_ids = torch.where(inputs.next_ids < 0, self.tokens[inputs.owner], inputs.next_ids)  # [T_b]
        self.runner.spec.catch_up_prefill(next_ids, held.aux_hidden_states, held.fb, inputs.slots)

    def _capture(self) -> None:
        from jetserve.engine.cuda_graph import _capture_all

        steps = []
        for bucket in reversed(self.buckets):  # largest first: the smaller reuse the pool's blocks
            host = self._pad_rows[bucket][0]

            def forward(bucket=bucket, host=host) -> None:
                if not torch.cuda.is_current_stream_capturing():  # the run before the capture: rows of pad alone
                    self.block[:, : host.shape[1]].copy_(torch.from_numpy(host))
                self._forward(bucket)

            steps.append((("prefill", bucket), forward))
            if self.catches_up:
                steps.append((("catch_up", bucket), lambda bucket=bucket: self._catch_up(bucket)))
        # A pool of their own: between a bucket's two graphs the step may replay a speculative flush graph, whose
        # scratch in the decode graphs' pool could lie where this bucket's forward batch and features are kept (on
        # the GPU, a batch-8 run read such overwritten rows out of bounds). The memory plan reserves the largest
        # bucket's activations for it.
        self.pool = _capture_all(steps, self.graphs, None)
        torch.cuda.synchronize()

    def run(self, batch: Batch, slots: np.ndarray, bucket: int) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
        """Replay the bucket's forward for `batch`: returns its forward batch (the bucket's), sampling counters and
        logits, the real rows' [N] (views of the graph's outputs, valid until the next replay)."""
        host, _ = self.runner.prefill_host_rows(batch, slots, padded=(bucket, self.rows))
        # (10 rows where the graphs hold 11: speculation switched off since the capture; the draft's row goes unread)
        self.runner.uploads.copy_into(self.block[: host.shape[0], : host.shape[1]], host)
        if self.is_graphed:
            self.graphs[("prefill", bucket)].replay()
        else:
            self._forward(bucket)
        held, num_seqs = self.held[bucket], len(batch.seqs)
        return held.fb, held.counters[:num_seqs], held.logits[:num_seqs]

    def catch_up(self, bucket: int) -> None:
        """The draft's catch-up on the step just replayed (after `SpecDecoder.before_prefill`), from the tokens the
        step sampled into `sampled_tokens`."""
        if self.is_graphed:
            self.graphs[("catch_up", bucket)].replay()
        else:
            self._catch_up(bucket)
