"""CUDA graphs, one per batch-size bucket: GraphRunner captures the decode step (ForwardBatch built on the device,
model, logits, and the draft's target features into its catch-up ring when speculating); SpecGraphRunner the
speculative steps (the draft's catch-up on what plain steps skipped, drafting, and verify with acceptance, commit and
the draft's catch-up on the accepted tokens)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import numpy as np
import torch

from jetserve import envs
from jetserve.engine import graph_split
from jetserve.engine.speculative import flush_block_size, flush_block_views, takes_first_guesses
from jetserve.ops.decode_inputs import advance_decode_inputs
from jetserve.ops.sampling import argmax
from jetserve.spec.tree import DraftTree, chain_buffers

if TYPE_CHECKING:
    from jetserve.engine.config import EngineConfig
    from jetserve.engine.model_runner import ModelRunner
    from jetserve.engine.speculative import SpecDecoder

# Speculative steps are captured up to this batch size (a verify step's logits are T_d rows per sequence, and the
# stochastic acceptance keeps a few [N, T_d, V] tensors: at larger batches they run eagerly).
SPEC_GRAPH_MAX_BATCH = 64
# A catch-up of at most this many positions a row replays a flush graph of rows this wide instead of a ring's (128
# positions by default): a shadow exploration (`SpecDecoder.shadow_draft`) catches the draft up on one position a
# step. Built in session 55 on the guess that a ring-wide row cost a whole 128-token draft forward; measured in session
# 56 (H100, the default pair, `bench/spec_graphs.py`): a catch-up graph is launch-bound, ~90 µs at batch 1 at either
# width, and the short rows save ~37 µs only at batch 8 (73–75 against 111–112 µs).
SHORT_FLUSH_WIDTH = 4
logger = logging.getLogger(__name__)


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to `max_batch_size` (which is always a bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size] + list(range(16, max_batch_size, 16))
    return sorted({*sizes, max_batch_size})


def capture_batch_sizes(config: EngineConfig, num_slots: int) -> list[int]:
    """The decode buckets an engine captures: `config.cuda_graph_batch_sizes` when given, else `default_batch_sizes`
    up to `cuda_graph_max_batch_size` (default max_num_seqs); either way no bucket past the state slots the memory
    plan found (`num_slots`, slot 0 reserved for padding)."""
    limit = num_slots - 1
    sizes = config.graph_batch_sizes
    if sizes is None:
        return default_batch_sizes(min(config.cuda_graph_max_batch_size or config.max_num_seqs, limit))
    return sorted({min(b, limit) for b in sizes})


class GraphRunner:
    """One graph per bucket, all from one stream capture where the driver allows (`_capture_all`), each reading its
    own static input block of three int64 rows (token ids, positions, and the state slots as int32 in the third row's
    first half: `inputs`), so that a step's inputs from the host reach it in one copy (`run_host`).

    A batch of N sequences replays the smallest bucket B ≥ N; rows N..B are padding: slot 0, position 0, token 0, so
    they write only the reserved slot 0 and nothing in the K/V caches (`slot_mapping` −1). Logits land in one static
    `[B_max, V]` buffer that every graph writes its first B rows of, and their argmax in `greedy` [B_max]: an
    all-greedy step takes its tokens from there instead of launching the sampler (whose two Triton launches were the
    largest part of a small model's host work per step, session 45). Each graph ends by turning its inputs into the
    next step's for the same rows (`advance_decode_inputs`: tokens from `greedy`, positions one on, the step's own
    positions kept in `used_positions`), so an all-greedy step launched ahead replays with no copy (`run_next`). All
    graphs share one memory pool.
    """

    def __init__(self, runner: ModelRunner, batch_sizes: list[int]) -> None:
        assert batch_sizes and min(batch_sizes) >= 1
        self.runner = runner
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch_size = self.batch_sizes[-1]
        device = runner.device
        B = self.max_batch_size
        # [3, b rounded up to even]: each row 16-byte aligned, as Triton specializes a kernel on its pointers'
        # alignment (an odd bucket's rows would otherwise build a second variant of every kernel they reach)
        self.blocks = {b: torch.zeros(3, b + b % 2, dtype=torch.int64, device=device) for b in self.batch_sizes}
        self._host_blocks = {b: np.zeros((3, b + b % 2), dtype=np.int64) for b in self.batch_sizes}  # `run_host`'s
        # each bucket's (token ids, positions, slots) views of its block, made once (`inputs`: every step reads them)
        self._views = {b: (blk[0, :b], blk[1, :b], blk[2].view(torch.int32)[:b]) for b, blk in self.blocks.items()}
        self.logits = torch.zeros(B, runner.config.vocab_size, dtype=torch.float32, device=device)  # [B, V]
        self.greedy = torch.zeros(B, dtype=torch.int64, device=device)  # [B]: each row's argmax of `logits`
        self.used_positions = torch.zeros(B, dtype=torch.int64, device=device)  # [B]: the last replay's positions
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        # The rows the static inputs hold since the last `run` or `run_host`: their slots (the very tensor given or
        # returned), padding zeroed past them — after a replay, the inputs of the step after for the same rows
        # (`run_next`) — with that step's views of the buffers and its graph.
        self._held: _HeldInputs | None = None

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch_size

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.batch_sizes if b >= num_seqs)

    def inputs(self, B: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bucket B's static token ids [B] int64, positions [B] int64 and state slots [B] int32 (the int32 the model's
        ops take: int64 slots would cost the graph a cast): views of its block."""
        return self._views[B]

    def _step(self, B: int) -> None:
        input_ids, positions, state_indices = self.inputs(B)
        self.runner.decode_logits(input_ids, positions, state_indices, self.logits[:B])
        argmax(self.logits[:B], out=self.greedy[:B])
        spec = self.runner.spec
        if spec is not None:  # the draft's target features, into its catch-up ring (padding rows: slot 0)
            spec.store_features(positions, state_indices, self.runner.model.aux_hidden_states)
        advance_decode_inputs(self.greedy[:B], positions, state_indices, input_ids, self.used_positions[:B])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (so smaller graphs reuse the pool's blocks), on padding inputs."""
        for block in self.blocks.values():
            block.zero_()
        self._held = None
        steps = [(B, lambda B=B: self._step(B)) for B in reversed(self.batch_sizes)]
        self.pool = _capture_all(steps, self.graphs, self.pool)
        torch.cuda.synchronize()

    def _hold(self, state_indices: torch.Tensor, N: int, B: int) -> _HeldInputs:
        input_ids, positions, _ = self.inputs(B)
        held = _HeldInputs(state_indices, input_ids[:N], positions[:N], self.used_positions[:N], self.logits[:N],
                           self.graphs[B])  # fmt: skip
        self._held = held
        return held

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
        """[N] inputs on the device (N ≤ max bucket) → logits [N, V], a view of the static buffer valid until the
        next replay (as is `greedy[:N]`, their argmax)."""
        N = input_ids.shape[0]
        B = self.bucket(N)
        held = self._hold(state_indices, N, B)
        held.input_ids.copy_(input_ids)
        held.positions.copy_(positions)
        slots = self.inputs(B)[2]
        slots[:N].copy_(state_indices)
        if B > N:
            self.blocks[B][:2, N:].zero_()
            slots[N:].zero_()
        held.graph.replay()
        return held.logits

    def run_host(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step's inputs from the host, rows [3, N] int64 (token ids, positions, slots; N ≤ max bucket), laid out
        as the bucket's block (padding zero, the slots as int32) and loaded by one copy through the runner's upload
        ring, then the replay. Returns (logits [N, V], positions [N] int64, state slots [N] int32): views of the
        static buffers, valid until the next replay."""
        N = rows.shape[1]
        B = self.bucket(N)
        host = self._host_blocks[B]  # reused: `copy_into` stages it in the ring before returning
        host.fill(0)
        host[:2, :N] = rows[:2]
        host[2].view(np.int32)[:N] = rows[2]
        self.runner.uploads.copy_into(self.blocks[B], host)
        held = self._hold(self.inputs(B)[2][:N], N, B)  # a new view each call: `holds` tells launches apart by it
        held.graph.replay()
        return held.logits, held.used_positions, held.state_indices

    def holds(self, state_indices: torch.Tensor) -> bool:
        """Whether the static inputs hold the rows of the last replay for exactly these slots (the same tensor)."""
        return self._held is not None and self._held.state_indices is state_indices

    def rewind(self, B: int) -> None:
        """Put bucket B's static positions back to those its graph's last replay used (the last replay must be B's),
        so that replaying it again redoes that step on the same pages: benchmarks replaying one step back to back. The
        tokens stay that step's argmax."""
        self.blocks[B][1, :B].copy_(self.used_positions[:B])

    def run_next(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step after the last replay, for the same rows (`holds`): their tokens `input_ids` [N] (the last
        step's), each position one further, the same slots. The last replay left exactly these inputs behind, with
        its argmax as the tokens: an all-greedy step (`input_ids` is `greedy[:N]`) only replays, any other copies its
        tokens in first — where `run` makes three copies and, in a padded bucket, three fills. Returns (logits [N, V],
        positions [N]): views of the static buffers, valid until the next replay."""
        held = self._held
        if input_ids.shape != held.input_ids.shape:
            raise ValueError(f"run_next: {tuple(input_ids.shape)} tokens for {held.input_ids.shape[0]} held rows")
        if input_ids.data_ptr() != self.greedy.data_ptr():  # sampled: not the argmax the graph wrote in
            held.input_ids.copy_(input_ids)
        held.graph.replay()
        return held.logits, held.used_positions


@dataclasses.dataclass(frozen=True, slots=True)
class _HeldInputs:
    """The rows a decode graph's static inputs hold after `GraphRunner.run` or `run_host`: their slots (the tensor
    given, or the view returned) and the views and graph of that step, for `run_next`."""

    state_indices: torch.Tensor  # [N]
    input_ids: torch.Tensor  # [N] view of the bucket's static token ids
    positions: torch.Tensor  # [N] view of its static positions (the next step's, after a replay)
    used_positions: torch.Tensor  # [N] view of the positions the last replay used
    logits: torch.Tensor  # [N, V] view of the static logits
    graph: object  # the bucket's graph


def _capture_all(steps: list[tuple[Hashable, Callable[[], None]]], graphs: dict, pool: object) -> object:
    """Each (key, step) run once on the current stream, then captured into `graphs[key]`: all in one stream capture
    split per step (`graph_split`: a process's fourth capture slows every graph of it) unless JETSERVE_ONE_CAPTURE=0,
    the driver cannot, or the process is one rank of several (NCCL's kernels in a split capture have not run on GPUs
    yet), else one capture each (`_capture`). Returns the memory pool."""
    if envs.one_capture() and graph_split.available() and not _is_multi_rank():
        for _, step in steps:
            step()
        try:
            split, pool = graph_split.capture_split(steps, pool)
        except (RuntimeError, ValueError) as e:
            logger.warning("%d graphs from one capture failed (%s): capturing each on its own", len(steps), e)
        else:
            graphs.update(split)
            return pool
    for key, step in steps:
        pool = _capture(key, graphs, pool, step)
    return pool


def _is_multi_rank() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _capture(graph_key: object, graphs: dict, pool: object, step) -> object:
    """Run `step` once on the current stream (outside the capture: lazy init, workspaces), then capture it into
    `graphs[graph_key]` (a stream capture of its own); returns the memory pool.

    Not on a side stream: on an H200 (session 32, `bench/graph_trigger.py`) warm-ups on a new side stream slowed every
    graph of the process by 3-4% from the second graph on; on the current stream, from the fourth capture (session
    33: captures count, not graphs instantiated — hence `_capture_all`)."""
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    graphs[graph_key] = graph
    return graph.pool() if pool is None else pool


class SpecGraphRunner:
    """Graphs of the speculative steps for buckets up to SPEC_GRAPH_MAX_BATCH, sharing the decode graphs' pool:

    - draft `(B, shape)`: the tree of each row into static tree buffers (per shape);
    - verify `(B, shape, greedy)`: target verify of those trees, acceptance, commit, the draft's catch-up on the
      accepted tokens, and the [B, T_d + 2] result the host reads.

    Padded rows (slot 0, position 0, token 0) write only slot 0, the draft's page 0 and nothing in the target's K/V.
    """

    def __init__(self, spec: SpecDecoder, batch_sizes: list[int]) -> None:
        self.spec = spec
        runner = spec.runner
        self.decode_graphs = runner.graph_runner
        assert self.decode_graphs is not None, "capture the decode graphs first (the graphs share their pool)"
        sizes = [b for b in batch_sizes if b <= SPEC_GRAPH_MAX_BATCH]
        self.batch_sizes = sorted(set(sizes)) or [min(batch_sizes)]
        self.max_batch_size = self.batch_sizes[-1]
        device = runner.device
        B = self.max_batch_size
        self.inputs = torch.zeros(3, B, dtype=torch.int64, device=device)  # [3, B]: loaded with one copy
        self.tokens, self.positions, self.slots = self.inputs.unbind(0)  # [B] each: tree roots, cached prefix, slots
        self.trees: list[DraftTree] = []
        self.results: list[torch.Tensor] = []
        for shape in spec.shapes:
            T = shape.num_draft_tokens
            # A chain is drafted into its static tree in place (`chain_buffers`); a tree is copied in.
            self.trees.append(chain_buffers(B, T, device) if shape.topk == 1 else _static_tree(B, T, device))
            self.results.append(torch.zeros(B, T + 2, dtype=torch.int64, device=device))  # [B, T_d + 2]
        # The catch-up (`SpecDecoder.flush_rows`) per captured (bucket B, width C): rows of `spec.ring` tokens (or
        # the first SHORT_FLUSH_WIDTH of them), their start, valid count and slot, in one block that one copy from
        # the host loads whole (`flush_block_views`); and the rows' first guesses out.
        self.flush_widths = sorted({min(SHORT_FLUSH_WIDTH, spec.ring), spec.ring})
        flushes = [(b, w) for b in self.batch_sizes for w in self.flush_widths if self.captures_flush(b, w)]
        self.flush_blocks = {(b, w): torch.zeros(flush_block_size(b, w), dtype=torch.int64, device=device)
                             for b, w in flushes}  # fmt: skip
        self.flush_guesses = {(b, w): torch.zeros(b, w, dtype=torch.int64, device=device) for b, w in flushes}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = self.decode_graphs.pool
        self.ahead: tuple[int, np.ndarray] | None = None  # (shape, inputs [3, N]) of the trees drafted ahead
        self.num_drafts_ahead = [0, 0]  # drafted ahead: [used by the next step, discarded]

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch_size

    def flush_width(self, num_seqs: int, longest: int) -> int | None:
        """The width of the flush graph that catches up `num_seqs` rows of at most `longest` positions: the narrowest
        captured for their bucket that holds them (`captures_flush`); None where none is."""
        if not self.fits(num_seqs):
            return None
        B = self.bucket(num_seqs)
        return next((w for w in self.flush_widths if longest <= w and self.captures_flush(B, w)), None)

    def captures_flush(self, B: int, width: int | None = None) -> bool:
        """A flush graph of rows `width` wide (default: a ring's) is captured for bucket B when its rows stay within
        the catch-up's token limit (`SpecDecoder.max_flush_tokens`)."""
        return B * (width or self.spec.ring) <= self.spec.max_flush_tokens

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.batch_sizes if b >= num_seqs)

    # ---- the captured bodies ----

    def _draft(self, B: int, shape: int) -> None:
        self.spec.draft_tree(
            shape, self.tokens[:B], self.positions[:B], self.slots[:B], _tree_rows(self.trees[shape], B)
        )

    def _verify(self, B: int, shape: int, greedy: bool) -> None:
        spec, prefix, slots = self.spec, self.positions[:B], self.slots[:B]
        sampling = None if greedy else spec.runner.sampler.rows(slots, prefix + 1)
        # The inputs of a next verify step of the same rows, for `draft_ahead`, left in the static inputs: the bonus
        # token as the root, cached past the accepted path. (Padded rows accept nothing and keep their zeros.)
        next_inputs = (self.tokens[:B], prefix)
        result = spec.verify(shape, _tree_rows(self.trees[shape], B), prefix, slots, sampling, next_inputs)
        self.results[shape][:B].copy_(result)

    def _flush(self, B: int, width: int) -> None:
        guesses = self.flush_guesses[B, width] if takes_first_guesses(B, width) else None
        self.spec.flush_rows(*flush_block_views(self.flush_blocks[B, width], B, width), guesses)

    def steps(self) -> list[tuple[tuple, Callable[[], None]]]:
        """The (graph key, captured body) of every speculative graph, largest bucket first."""
        steps: list[tuple[tuple, Callable[[], None]]] = []
        for B in reversed(self.batch_sizes):
            for width in self.flush_widths:
                if self.captures_flush(B, width):
                    steps.append((("flush", B, width), lambda B=B, w=width: self._flush(B, w)))
            for shape in range(len(self.spec.shapes)):
                steps.append((("draft", B, shape), lambda B=B, s=shape: self._draft(B, s)))
                for greedy in (True, False):
                    steps.append((("verify", B, shape, greedy), lambda B=B, s=shape, g=greedy: self._verify(B, s, g)))
        return steps

    @torch.inference_mode()
    def capture(self) -> None:
        """Every speculative graph on padding inputs, in one stream capture beside the decode graphs' one where the
        driver allows (`_capture_all`): a speculating process then makes two captures, under the four that slow it."""
        self._pad(0)
        self.pool = _capture_all(self.steps(), self.graphs, self.pool)
        torch.cuda.synchronize()

    def _pad(self, start: int, end: int | None = None) -> None:
        self.inputs[:, start:end].zero_()

    def _load(self, inputs: torch.Tensor) -> int:
        """Copy the rows' [3, N] (roots, cached prefix, slots) into the static inputs; returns the bucket."""
        N = inputs.shape[1]
        B = self.bucket(N)
        self.inputs[:, :N].copy_(inputs)
        if B > N:
            self._pad(N, B)
        return B

    # ---- replay ----

    def flush(self, block: np.ndarray, num_rows: int, width: int) -> torch.Tensor | None:
        """The draft's catch-up of a bucket's `num_rows` rows (B), `block` [flush_block_size] int64 on the host
        (`flush_block_views`: ids [B, C] for a captured width C (`flush_width`), starts / valid / slots [B]; padding
        rows zero), loaded by one copy. Returns the rows' first guesses [B, C] (the graph's static buffer, valid until
        its next replay), or None where its graph takes none."""
        self.spec.runner.uploads.copy_into(self.flush_blocks[num_rows, width], block)
        self.graphs[("flush", num_rows, width)].replay()
        return self.flush_guesses[num_rows, width] if takes_first_guesses(num_rows, width) else None

    def draft(self, shape: int, inputs: torch.Tensor, inputs_host: np.ndarray | None = None) -> DraftTree:
        """Draft the trees of N rows: inputs [3, N] int64 (each row's root token, cached prefix and slot), or take
        the trees `draft_ahead` drafted when `inputs_host` (inputs' host copy) are the ones it drafted them for."""
        N = inputs.shape[1]
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            is_same = inputs_host is not None and ahead[0] == shape and np.array_equal(ahead[1], inputs_host)
            self.num_drafts_ahead[0 if is_same else 1] += 1
            if is_same:
                return _tree_rows(self.trees[shape], N)
        B = self._load(inputs)
        self.graphs[("draft", B, shape)].replay()
        return _tree_rows(self.trees[shape], N)

    def draft_ahead(self, shape: int, next_inputs: np.ndarray) -> None:
        """Draft the trees of a next verify step of the rows `verify` just verified, from the inputs its graph left
        in the static buffers (`next_inputs` [3, N]: their host copy), so that the draft runs while the host
        postprocesses. Drafting writes nothing but the static trees; `draft` takes them only for these inputs, and
        otherwise drafts again (the rows changed, or the step is not a verify step of this shape)."""
        self.draft_next(shape, next_inputs.shape[1])
        self.ahead = (shape, next_inputs)

    def draft_next(self, shape: int, num_seqs: int) -> None:
        """Draft the trees of the verify step after the one `verify` just replayed, for its `num_seqs` rows, from the
        inputs its graph left in the static buffers: a verify step launched before the host read that one's result
        (`SpecDecoder.launch_verify_next`); `verify` follows."""
        self.ahead = None
        self.graphs[("draft", self.bucket(num_seqs), shape)].replay()

    def verify(self, shape: int, num_seqs: int, greedy: bool) -> torch.Tensor:
        """The verify step of the trees `draft` just made (same rows); returns the [N, T_d + 2] result view."""
        self.graphs[("verify", self.bucket(num_seqs), shape, greedy)].replay()
        return self.results[shape][:num_seqs]


def _static_tree(B: int, T: int, device: torch.device) -> DraftTree:
    return DraftTree(
        tokens=torch.zeros(B, T, dtype=torch.int64, device=device),
        parents=torch.full((B, T), -1, dtype=torch.int32, device=device),
        depths=torch.zeros(B, T, dtype=torch.int32, device=device),
        mask=torch.eye(T, dtype=torch.bool, device=device).expand(B, -1, -1).contiguous(),
        positions=torch.zeros(B, T, dtype=torch.int64, device=device),
        scores=torch.zeros(B, T, dtype=torch.float32, device=device),
    )


def _tree_rows(tree: DraftTree, n: int) -> DraftTree:
    """The first `n` rows of every tensor of `tree` (views)."""
    return DraftTree(*(getattr(tree, f.name)[:n] for f in dataclasses.fields(DraftTree)))
