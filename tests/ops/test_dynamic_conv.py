"""Dynamic conv: the reference against a direct per-token formulation, and the Triton kernels against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from jetserve.ops.dynamic_conv import reference as ref
from jetserve.ops.dynamic_conv.commit import dynamic_conv_commit
from jetserve.ops.dynamic_conv.decode import dynamic_conv_decode
from jetserve.ops.dynamic_conv.kernel_generator import Tiles
from jetserve.ops.dynamic_conv.prefill import dynamic_conv_prefill
from jetserve.ops.dynamic_conv.verify import dynamic_conv_verify

SENTINEL = 1234.5  # fills slots an op must neither read nor write


def naive_sequence(
    u: torch.Tensor, h: torch.Tensor, w2_weight: torch.Tensor, w2_bias: torch.Tensor, window: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """DESIGN.md §1 step 2 for one sequence, one token at a time in float64: (silu(v̂) [L, D], final window [W-1, D])."""
    width = window.shape[0] + 1
    history = [row.double() for row in window]  # oldest first
    outputs = []
    for t in range(u.shape[0]):
        history.append(u[t].double())
        kappa = (w2_weight.double() @ h[t].double() + w2_bias.double()).view(-1, width)  # [D, W], tap fastest
        v_hat = sum(kappa[:, j] * history[len(history) - width + j] for j in range(width))  # [D]
        outputs.append(F.silu(v_hat))
    out = torch.stack(outputs) if outputs else u.new_zeros(0, u.shape[1], dtype=torch.float64)
    return out, torch.stack(history[-(width - 1) :])


def make_weights(d: int, g: int, width: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w2_weight = (torch.randn(d * width, g, generator=gen) / g**0.5).to(dtype)  # [D*W, G]
    w2_bias = (torch.randn(d * width, generator=gen) * 0.3).to(dtype)  # [D*W]
    return w2_weight, w2_bias


def make_pool(num_slots: int, width: int, d: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_slots, width - 1, d, generator=gen).to(dtype)  # [S, W-1, D]


def random_tree(num_nodes: int, gen: torch.Generator, min_depth: int = 1) -> list[int]:
    """Parents of a random tree in topological order: node 0 is the root (parent -1); nodes below `min_depth` form a
    chain, so some path holds at least `min_depth` nodes."""
    return [j - 1 if j < min_depth else int(torch.randint(0, j, (1,), generator=gen)) for j in range(num_nodes)]


def ancestry(parents: list[int], node: int) -> list[int]:
    """Root-first path from node 0 to `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---------------------------------------------------------------------------------------------------------------------
# Reference against the direct formulation
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [4, 2, 3])
def test_reference_prefill_matches_naive(width: int) -> None:
    d, g, num_slots = 24, 8, 12
    lengths = [1, 2, width - 1, width, 63, 65, 1, 2]
    has_init = [True, False, True, False, True, False, True, True]
    slots = [3, 7, 1, 10, 5, 8, 2, 11]
    gen = torch.Generator().manual_seed(width)
    w2_weight, w2_bias = make_weights(d, g, width)
    pool = make_pool(num_slots, width, d)
    for s, init in zip(slots, has_init, strict=True):
        if not init:
            pool[s] = float("nan")  # a slot without initial state must not be read
    unused = [s for s in range(num_slots) if s not in slots]
    pool[unused] = SENTINEL
    before = pool.clone()
    total = sum(lengths)
    u = torch.randn(total, d, generator=gen)
    h = torch.randn(total, g, generator=gen)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)

    out = ref.dynamic_conv_prefill(
        u, h, w2_weight, w2_bias, pool, cu, torch.tensor(slots, dtype=torch.int32), torch.tensor(has_init)
    )

    assert out.shape == (total, d) and out.dtype == u.dtype and torch.isfinite(out).all()
    for i, (s, init) in enumerate(zip(slots, has_init, strict=True)):
        window = before[s] if init else torch.zeros(width - 1, d)
        expect_out, expect_window = naive_sequence(
            u[cu[i] : cu[i + 1]], h[cu[i] : cu[i + 1]], w2_weight, w2_bias, window
        )
        torch.testing.assert_close(out[cu[i] : cu[i + 1]].double(), expect_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[s].double(), expect_window, rtol=0, atol=0)
    assert_same_bits(pool[unused], before[unused])


def test_reference_prefill_short_sequence_keeps_old_window_rows() -> None:
    width, d, g = 4, 8, 4
    w2_weight, w2_bias = make_weights(d, g, width)
    pool = make_pool(4, width, d)
    before = pool.clone()
    u = torch.randn(3, d)
    h = torch.randn(3, g)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    ref.dynamic_conv_prefill(
        u, h, w2_weight, w2_bias, pool, cu, torch.tensor([2, 1], dtype=torch.int32), torch.tensor([True, True])
    )
    torch.testing.assert_close(pool[2], torch.cat([before[2, 1:], u[0:1]]), rtol=0, atol=0)
    torch.testing.assert_close(pool[1], torch.cat([before[1, 2:], u[1:3]]), rtol=0, atol=0)
    assert_same_bits(pool[[0, 3]], before[[0, 3]])


def test_reference_prefill_then_decode_equals_whole_prefill() -> None:
    width, d, g = 4, 16, 6
    gen = torch.Generator().manual_seed(3)
    w2_weight, w2_bias = make_weights(d, g, width)
    lengths = [5, 1, 2]
    num_decode = 4
    whole = [n + num_decode for n in lengths]
    seqs_u = [torch.randn(n, d, generator=gen) for n in whole]
    seqs_h = [torch.randn(n, g, generator=gen) for n in whole]
    slots = torch.tensor([2, 4, 1], dtype=torch.int32)
    no_init = torch.zeros(3, dtype=torch.bool)

    pool_whole = make_pool(5, width, d)
    cu_whole = torch.tensor([0] + torch.tensor(whole).cumsum(0).tolist(), dtype=torch.int32)
    out_whole = ref.dynamic_conv_prefill(
        torch.cat(seqs_u), torch.cat(seqs_h), w2_weight, w2_bias, pool_whole, cu_whole, slots, no_init
    )

    pool = make_pool(5, width, d)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    u_prefix = torch.cat([x[:n] for x, n in zip(seqs_u, lengths, strict=True)])
    h_prefix = torch.cat([x[:n] for x, n in zip(seqs_h, lengths, strict=True)])
    out_prefix = ref.dynamic_conv_prefill(u_prefix, h_prefix, w2_weight, w2_bias, pool, cu, slots, no_init)
    outs = [[out_prefix[cu[i] : cu[i + 1]]] for i in range(3)]
    for step in range(num_decode):
        u_step = torch.stack([x[n + step] for x, n in zip(seqs_u, lengths, strict=True)])
        h_step = torch.stack([x[n + step] for x, n in zip(seqs_h, lengths, strict=True)])
        out_step = ref.dynamic_conv_decode(u_step, h_step, w2_weight, w2_bias, pool, slots)
        for i in range(3):
            outs[i].append(out_step[i : i + 1])
    torch.testing.assert_close(torch.cat([torch.cat(o) for o in outs]), out_whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool[slots.long()], pool_whole[slots.long()], rtol=0, atol=0)


def _verify_case(num_seqs: int, num_nodes: int, width: int, d: int, g: int, seed: int, chain: bool = False):
    gen = torch.Generator().manual_seed(seed)
    w2_weight, w2_bias = make_weights(d, g, width, seed=seed)
    pool = make_pool(num_seqs + 3, width, d, seed=seed)
    slots = torch.randperm(num_seqs + 2, generator=gen)[:num_seqs].to(torch.int32) + 1
    parents = [list(range(-1, num_nodes - 1)) if chain else random_tree(num_nodes, gen) for _ in range(num_seqs)]
    u = torch.randn(num_seqs * num_nodes, d, generator=gen)
    h = torch.randn(num_seqs * num_nodes, g, generator=gen)
    return w2_weight, w2_bias, pool, slots, torch.tensor(parents, dtype=torch.int32), u, h


@pytest.mark.parametrize("width", [4, 3])
def test_reference_verify_equals_chain_prefill_of_each_ancestry(width: int) -> None:
    num_seqs, num_nodes, d, g = 3, 8, 24, 8
    w2_weight, w2_bias, pool, slots, parents, u, h = _verify_case(num_seqs, num_nodes, width, d, g, seed=width)
    before = pool.clone()
    out = ref.dynamic_conv_verify(u, h, w2_weight, w2_bias, pool, slots, parents)
    assert_same_bits(pool, before)
    assert torch.isfinite(out).all()
    for i in range(num_seqs):
        for j in range(num_nodes):
            path = [i * num_nodes + a for a in ancestry(parents[i].tolist(), j)]
            expect, _ = naive_sequence(u[path], h[path], w2_weight, w2_bias, before[slots[i]])
            torch.testing.assert_close(out[i * num_nodes + j].double(), expect[-1], rtol=1e-5, atol=1e-5)


def test_reference_verify_chain_equals_prefill() -> None:
    num_seqs, num_nodes, width, d, g = 2, 6, 4, 16, 8
    w2_weight, w2_bias, pool, slots, parents, u, h = _verify_case(num_seqs, num_nodes, width, d, g, seed=5, chain=True)
    out = ref.dynamic_conv_verify(u, h, w2_weight, w2_bias, pool, slots, parents)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32) * num_nodes
    out_prefill = ref.dynamic_conv_prefill(
        u, h, w2_weight, w2_bias, pool, cu, slots, torch.ones(num_seqs, dtype=torch.bool)
    )
    torch.testing.assert_close(out, out_prefill, rtol=1e-6, atol=1e-6)


def test_reference_commit_equals_prefill_of_accepted_tokens() -> None:
    num_seqs, num_nodes, width, d, g = 4, 8, 4, 24, 8
    w2_weight, w2_bias, pool, slots, parents, u, h = _verify_case(num_seqs, num_nodes, width, d, g, seed=7)
    gen = torch.Generator().manual_seed(8)
    accepted = torch.full((num_seqs, num_nodes), -1, dtype=torch.int32)
    num_accepted = torch.tensor([1, 0, 0, 0], dtype=torch.int32)
    accepted[0, 0] = 0
    for i in range(1, num_seqs):
        path = ancestry(parents[i].tolist(), int(torch.randint(1, num_nodes, (1,), generator=gen)))
        accepted[i, : len(path)] = torch.tensor(path)
        num_accepted[i] = len(path)
    num_accepted[1] = 0  # a padded row: its window stays as it was
    expect_pool = pool.clone()
    for i in range(num_seqs):
        rows = [i * num_nodes + int(a) for a in accepted[i, : num_accepted[i]]]
        if rows:
            _, window = naive_sequence(u[rows], h[rows], w2_weight, w2_bias, expect_pool[slots[i]])
            expect_pool[slots[i]] = window.float()
    ref.dynamic_conv_commit(u, pool, slots, accepted, num_accepted)
    assert_same_bits(pool, expect_pool)


@pytest.mark.parametrize("chain", [True, False])
def test_reference_verify_commit_rounds_equal_prefill_of_accepted(chain: bool) -> None:
    """Several rounds with acceptance 3, 1, 4, 1, 2: each round's verify output equals the prefill of the accepted
    history plus the node's path, and the final window equals one prefill of every accepted token."""
    num_nodes, width, d, g = 6, 4, 16, 8
    gen = torch.Generator().manual_seed(11)
    w2_weight, w2_bias = make_weights(d, g, width)
    pool = make_pool(3, width, d)
    slot = torch.tensor([2], dtype=torch.int32)
    start_window = pool[2].clone()
    history_u, history_h = [], []
    for count in [3, 1, 4, 1, 2]:
        parents = list(range(-1, num_nodes - 1)) if chain else random_tree(num_nodes, gen, min_depth=4)
        u = torch.randn(num_nodes, d, generator=gen)
        h = torch.randn(num_nodes, g, generator=gen)
        out = ref.dynamic_conv_verify(u, h, w2_weight, w2_bias, pool, slot, torch.tensor([parents], dtype=torch.int32))
        deepest = max(range(num_nodes), key=lambda j: len(ancestry(parents, j)))
        path = ancestry(parents, deepest)[:count]
        for j in path:
            rows = ancestry(parents, j)
            expect, _ = naive_sequence(
                torch.cat(history_u + [u[rows]]), torch.cat(history_h + [h[rows]]), w2_weight, w2_bias, start_window
            )
            torch.testing.assert_close(out[j].double(), expect[-1], rtol=1e-5, atol=1e-5)
        accepted = torch.full((1, num_nodes), -1, dtype=torch.int32)
        accepted[0, :count] = torch.tensor(path)
        ref.dynamic_conv_commit(u, pool, slot, accepted, torch.tensor([count], dtype=torch.int32))
        history_u.append(u[path])
        history_h.append(h[path])
    _, expect_window = naive_sequence(torch.cat(history_u), torch.cat(history_h), w2_weight, w2_bias, start_window)
    torch.testing.assert_close(pool[2].double(), expect_window, rtol=0, atol=0)


def test_reference_rejects_mismatched_shapes() -> None:
    w2_weight, w2_bias = make_weights(8, 4, 4)
    pool = make_pool(2, 3, 8)  # W = 3 does not match w2's D*W = 32
    with pytest.raises(ValueError, match="w2_weight"):
        ref.dynamic_conv_decode(
            torch.randn(1, 8), torch.randn(1, 4), w2_weight, w2_bias, pool, torch.tensor([1], dtype=torch.int32)
        )


# ---------------------------------------------------------------------------------------------------------------------
# Triton kernels (CPU interpreter) against the reference
# ---------------------------------------------------------------------------------------------------------------------


# tests/conftest.py turns the interpreter on before triton is imported, unless CUDA is present: then these kernels
# are compiled and the GPU module covers them.
interpreted = pytest.mark.skipif(
    not triton.knobs.runtime.interpret, reason="Triton kernels were compiled for the GPU, not interpreted"
)
# New outputs start as NaN (tests/ops/conftest.py), so one a kernel leaves unwritten fails.
poisoned = pytest.mark.usefixtures("poisoned_empty")


def poisoned_pool(num_slots: int, width: int, d: int, live: list[int], dtype: torch.dtype, seed: int = 1):
    """Random windows in the `live` slots, NaN in slot 0 and SENTINEL in every other slot."""
    pool = make_pool(num_slots, width, d, dtype, seed)
    dead = [s for s in range(num_slots) if s not in live]
    pool[dead] = SENTINEL
    pool[0] = float("nan")
    return pool, dead


def assert_pools_match(pool: torch.Tensor, expect: torch.Tensor, dead: list[int], before: torch.Tensor) -> None:
    """Live slots equal to the reference's bit for bit (windows are copies of inputs); dead slots untouched."""
    assert_same_bits(pool.nan_to_num(nan=-7.0), expect.nan_to_num(nan=-7.0))
    assert_same_bits(pool[dead], before[dead])


@pytest.mark.parametrize(
    ("width", "d", "g", "dtype"),
    [(4, 40, 20, torch.float32), (3, 24, 8, torch.float32), (2, 24, 16, torch.float32), (4, 24, 20, torch.float16)],
)
@interpreted
@poisoned
def test_triton_prefill_matches_reference(width: int, d: int, g: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(width * 100 + d)
    lengths = [1, 2, 3, 4, 5, 17, 0, 33, 2]
    has_init = torch.tensor([True, False, True, True, False, True, True, True, True])
    slots = [3, 7, 1, 9, 5, 8, 2, 4, 11]
    num_slots = 13
    pool, dead = poisoned_pool(num_slots, width, d, slots, dtype)
    pool[[7, 5]] = float("nan")  # no initial state: must not be read
    w2_weight, w2_bias = make_weights(d, g, width, dtype)
    total = sum(lengths)
    u = torch.randn(total, d, generator=gen).to(dtype)
    h = torch.randn(total, g, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    state_indices = torch.tensor(slots, dtype=torch.int32)
    before, expect_pool = pool.clone(), pool.clone()

    expect = ref.dynamic_conv_prefill(u, h, w2_weight, w2_bias, expect_pool, cu, state_indices, has_init)
    out = dynamic_conv_prefill(u, h, w2_weight, w2_bias, pool, cu, state_indices, has_init)

    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, expect, rtol=tol, atol=tol)
    assert_pools_match(pool, expect_pool, dead, before)


@interpreted
@poisoned
def test_triton_prefill_strided_inputs() -> None:
    """u and h may be column slices of a fused projection output (row stride > D)."""
    width, d, g = 4, 24, 12
    gen = torch.Generator().manual_seed(21)
    w2_weight, w2_bias = make_weights(d, g, width)
    fused = torch.randn(20, d + g + 5, generator=gen)
    u, h = fused[:, 3 : 3 + d], fused[:, 3 + d : 3 + d + g]
    cu = torch.tensor([0, 2, 20], dtype=torch.int32)
    state_indices = torch.tensor([2, 1], dtype=torch.int32)
    has_init = torch.tensor([True, False])
    pool = make_pool(3, width, d)
    expect_pool = pool.clone()
    expect = ref.dynamic_conv_prefill(u, h, w2_weight, w2_bias, expect_pool, cu, state_indices, has_init)
    out = dynamic_conv_prefill(u, h, w2_weight, w2_bias, pool, cu, state_indices, has_init)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    assert_same_bits(pool, expect_pool)


@interpreted
@poisoned
@pytest.mark.parametrize(
    ("width", "dtype", "gpu_tiles", "num_seqs"),
    [
        (4, torch.float32, None, 19),
        (3, torch.float32, None, 19),
        (4, torch.float16, None, 19),
        (3, torch.float32, None, 13),  # up to EARLY_LOADS_MAX_ROWS: the taps loaded before the GEMM
        (4, torch.float32, (16, 8, 128, 2, 3), 13),  # the GPU's tiles for up to 16 rows
        (4, torch.float32, (64, 16, 64, 4, 3), 19),  # ... and past 32 rows
    ],
)
def test_triton_decode_matches_reference(
    width: int, dtype: torch.dtype, gpu_tiles: tuple | None, num_seqs: int, monkeypatch
) -> None:
    """gpu_tiles: tiles the GPU takes (token rows, channels, K step over the generator, warps, stages), here over 13
    or 19 rows (the taps loaded before or after the kernel generator's GEMM), 40 channels and a generator width of 20
    (every edge masked)."""
    from jetserve.ops.dynamic_conv import decode

    assert (num_seqs <= decode.EARLY_LOADS_MAX_ROWS) == (num_seqs == 13)
    if gpu_tiles:
        monkeypatch.setattr(decode, "decode_tiles_for", lambda x, rows: Tiles(*gpu_tiles))
    d, g, num_steps = 40, 20, 3
    gen = torch.Generator().manual_seed(width)
    slots = torch.randperm(25, generator=gen)[:num_seqs] + 1
    slots[[4, 11]] = 0  # padded rows
    live = [int(s) for s in slots]
    pool, dead = poisoned_pool(27, width, d, live, dtype)
    pool[0] = 0.25  # padded rows read and clobber slot 0; a finite value keeps their (ignored) outputs finite
    w2_weight, w2_bias = make_weights(d, g, width, dtype)
    # a strided view of the slots (a dead slot between them): the kernel must read the slots, not their neighbours
    state_indices = torch.stack([slots, torch.full_like(slots, dead[0])], dim=1).to(torch.int32)[:, 0]
    real = torch.ones(num_seqs, dtype=torch.bool)
    real[[4, 11]] = False
    before, expect_pool = pool.clone(), pool.clone()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for _ in range(num_steps):
        u = torch.randn(num_seqs, d, generator=gen).to(dtype)
        h = torch.randn(num_seqs, g, generator=gen).to(dtype)
        expect = ref.dynamic_conv_decode(u, h, w2_weight, w2_bias, expect_pool, state_indices)
        out = dynamic_conv_decode(u, h, w2_weight, w2_bias, pool, state_indices)
        assert torch.isfinite(out[real]).all()
        torch.testing.assert_close(out[real], expect[real], rtol=tol, atol=tol)
    live_real = [s for s in live if s != 0]
    assert_same_bits(pool[live_real], expect_pool[live_real])
    assert_same_bits(pool[dead], before[dead])


@interpreted
@poisoned
@pytest.mark.parametrize(
    ("chain", "dtype", "tiles"),
    [
        (False, torch.float32, None),
        (True, torch.float32, None),
        (False, torch.float16, None),
        (False, torch.float32, Tiles(block_tokens=16, block_channels=8, block_g=32, num_warps=2)),  # 3 channel tiles
        (True, torch.float32, Tiles(16, 8, 128, num_warps=1)),  # the GPU's (verify_tiles_for) up to 16 rows ...
        (False, torch.float32, Tiles(64, 16, 64, num_warps=4)),  # ... and up to VERIFY_NARROW_MAX_ROWS
    ],
)
def test_triton_verify_matches_reference_and_reads_only(chain: bool, dtype: torch.dtype, tiles: Tiles | None) -> None:
    num_seqs, num_nodes, width, d, g = 3, 7, 4, 24, 20
    w2_weight, w2_bias, pool, slots, parents, u, h = _verify_case(
        num_seqs, num_nodes, width, d, g, seed=13, chain=chain
    )
    w2_weight, w2_bias, pool, u, h = (x.to(dtype) for x in (w2_weight, w2_bias, pool, u, h))
    pool[0] = float("nan")
    before = pool.clone()
    expect = ref.dynamic_conv_verify(u, h, w2_weight, w2_bias, pool, slots, parents)
    out = dynamic_conv_verify(u, h, w2_weight, w2_bias, pool, slots, parents, tiles=tiles)
    assert torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, expect, rtol=tol, atol=tol)
    assert_same_bits(pool, before)


@interpreted
@poisoned
@pytest.mark.parametrize("width", [4, 2])
def test_triton_commit_matches_reference(width: int) -> None:
    num_seqs, num_nodes, d = 5, 6, 40
    gen = torch.Generator().manual_seed(17)
    slots = [4, 0, 2, 6, 1]  # row 1 is padding: slot 0, nothing accepted
    pool, dead = poisoned_pool(8, width, d, slots, torch.float32)
    u = torch.randn(num_seqs * num_nodes, d, generator=gen)
    accepted = torch.full((num_seqs, num_nodes), -1, dtype=torch.int32)  # entries past num_accepted are garbage
    counts = [1, 0, num_nodes, 2, 3]
    for i, count in enumerate(counts):
        parents = random_tree(num_nodes, gen, min_depth=num_nodes if count == num_nodes else 3)
        deepest = max(range(num_nodes), key=lambda j: len(ancestry(parents, j)))
        accepted[i, :count] = torch.tensor(ancestry(parents, deepest)[:count], dtype=torch.int32)
    state_indices = torch.tensor(slots, dtype=torch.int32)
    num_accepted = torch.tensor(counts, dtype=torch.int32)
    before, expect_pool = pool.clone(), pool.clone()
    ref.dynamic_conv_commit(u, expect_pool, state_indices, accepted, num_accepted)
    dynamic_conv_commit(u, pool, state_indices, accepted, num_accepted)
    assert_pools_match(pool, expect_pool, dead, before)


@interpreted
@poisoned
def test_triton_verify_commit_rounds_equal_prefill() -> None:
    """Rounds accepting 3, 1, 4, 1, 2 nodes of random trees, on the Triton ops, end in the window and outputs of one
    reference prefill of every accepted token."""
    num_nodes, width, d, g = 6, 4, 24, 8
    gen = torch.Generator().manual_seed(19)
    w2_weight, w2_bias = make_weights(d, g, width)
    pool = make_pool(3, width, d)
    slot = torch.tensor([2], dtype=torch.int32)
    start_pool = pool.clone()
    accepted_u, accepted_h, accepted_out = [], [], []
    for count in [3, 1, 4, 1, 2]:
        parents = random_tree(num_nodes, gen, min_depth=4)
        u = torch.randn(num_nodes, d, generator=gen)
        h = torch.randn(num_nodes, g, generator=gen)
        out = dynamic_conv_verify(u, h, w2_weight, w2_bias, pool, slot, torch.tensor([parents], dtype=torch.int32))
        deepest = max(range(num_nodes), key=lambda j: len(ancestry(parents, j)))
        path = ancestry(parents, deepest)[:count]
        accepted = torch.full((1, num_nodes), -1, dtype=torch.int32)
        accepted[0, :count] = torch.tensor(path)
        dynamic_conv_commit(u, pool, slot, accepted, torch.tensor([count], dtype=torch.int32))
        accepted_u.append(u[path])
        accepted_h.append(h[path])
        accepted_out.append(out[path])
    expect = ref.dynamic_conv_prefill(
        torch.cat(accepted_u),
        torch.cat(accepted_h),
        w2_weight,
        w2_bias,
        start_pool,
        torch.tensor([0, 11], dtype=torch.int32),
        slot,
        torch.tensor([True]),
    )
    torch.testing.assert_close(torch.cat(accepted_out), expect, rtol=1e-5, atol=1e-5)
    assert_same_bits(pool, start_pool)


@interpreted
@poisoned
def test_public_functions_dispatch_on_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    import jetserve.ops.dynamic_conv as dynamic_conv
    from jetserve.ops import backend

    calls = []
    real = dynamic_conv._decode.dynamic_conv_decode
    monkeypatch.setattr(dynamic_conv._decode, "dynamic_conv_decode", lambda *a: calls.append(1) or real(*a))
    width, d, g = 4, 8, 4
    w2_weight, w2_bias = make_weights(d, g, width)
    u, h = torch.randn(2, d), torch.randn(2, g)
    state_indices = torch.tensor([1, 2], dtype=torch.int32)
    pool_triton, pool_ref = make_pool(3, width, d), make_pool(3, width, d)
    try:
        backend.set_backend("triton")
        out_triton = dynamic_conv.dynamic_conv_decode(u, h, w2_weight, w2_bias, pool_triton, state_indices)
        assert calls == [1]
        backend.set_backend("reference")
        out_ref = dynamic_conv.dynamic_conv_decode(u, h, w2_weight, w2_bias, pool_ref, state_indices)
        assert calls == [1]
    finally:
        backend.set_backend(None)
    torch.testing.assert_close(out_triton, out_ref, rtol=1e-5, atol=1e-5)
    assert_same_bits(pool_triton, pool_ref)


@interpreted
@poisoned
@pytest.mark.parametrize("variant", ["reference", "triton"])
def test_empty_batch_is_a_no_op(variant: str) -> None:
    ops = {
        "reference": (
            ref.dynamic_conv_prefill,
            ref.dynamic_conv_decode,
            ref.dynamic_conv_verify,
            ref.dynamic_conv_commit,
        ),
        "triton": (dynamic_conv_prefill, dynamic_conv_decode, dynamic_conv_verify, dynamic_conv_commit),
    }[variant]
    prefill, decode, verify, commit = ops
    width, d, g = 4, 24, 8
    w2_weight, w2_bias = make_weights(d, g, width)
    pool = make_pool(3, width, d)
    before = pool.clone()
    u, h = torch.randn(0, d), torch.randn(0, g)
    none = torch.zeros(0, dtype=torch.int32)
    assert prefill(u, h, w2_weight, w2_bias, pool, torch.zeros(1, dtype=torch.int32), none, none.bool()).shape == (0, d)
    assert decode(u, h, w2_weight, w2_bias, pool, none).shape == (0, d)
    assert verify(u, h, w2_weight, w2_bias, pool, none, torch.zeros(0, 4, dtype=torch.int32)).shape == (0, d)
    commit(u, pool, none, torch.zeros(0, 4, dtype=torch.int32), none)
    assert_same_bits(pool, before)
