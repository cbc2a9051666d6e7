"""Dynamic conv Triton kernels against the reference on the GPU, at the real Jet-Nemotron 2B and 4B shapes in bf16."""

from __future__ import annotations

import pytest
import torch

from jetserve.ops.dynamic_conv import reference as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("poisoned_empty"),  # new outputs start as NaN (tests/ops/conftest.py)
]

WIDTH = 4
SHAPES = {"2B": (3072, 384), "4B": (4096, 512)}  # (D = D_v, G = D_g)
NUM_SLOTS = 300
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}


def setup(shape: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    d, g = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w2_weight = (torch.randn(d * WIDTH, g, device="cuda", generator=gen) / g**0.5).to(dtype)  # [D*W, G]
    w2_bias = (torch.randn(d * WIDTH, device="cuda", generator=gen) * 0.3).to(dtype)  # [D*W]
    pool = torch.randn(NUM_SLOTS, WIDTH - 1, d, device="cuda", generator=gen).to(dtype)  # [S, W-1, D]
    pool[0] = float("nan")
    return d, g, gen, w2_weight, w2_bias, pool


def live_slots(num_seqs: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randperm(NUM_SLOTS - 1, device="cuda", generator=gen)[:num_seqs] + 1).to(torch.int32)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("shape", ["2B", "4B"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_real_shapes(shape: str, dtype: torch.dtype) -> None:
    from jetserve.ops.dynamic_conv.prefill import dynamic_conv_prefill

    d, g, gen, w2_weight, w2_bias, pool = setup(shape, dtype)
    lengths = [1, 2, 3, 4, 5, 63, 65, 1000, 2500, 0, 17]
    has_init = torch.tensor([True, False, True, True, False, True, False, True, False, True, True], device="cuda")
    total = sum(lengths)
    u = torch.randn(total, d, device="cuda", generator=gen).to(dtype)
    h = torch.randn(total, g, device="cuda", generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    slots = live_slots(len(lengths), gen)
    expect_pool = pool.clone()
    expect = ref.dynamic_conv_prefill(u, h, w2_weight, w2_bias, expect_pool, cu, slots, has_init)
    out = dynamic_conv_prefill(u, h, w2_weight, w2_bias, pool, cu, slots, has_init)
    assert torch.isfinite(out).all()
    tol = BF16_TOL if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out.float(), expect.float(), **tol)
    assert_same_bits(pool.nan_to_num(nan=-7.0), expect_pool.nan_to_num(nan=-7.0))


@pytest.mark.parametrize("shape", ["2B", "4B"])
@pytest.mark.parametrize("batch", [1, 5, 16, 17, 64, 256])
def test_decode_real_shapes(shape: str, batch: int) -> None:
    from jetserve.ops.dynamic_conv.decode import dynamic_conv_decode

    d, g, gen, w2_weight, w2_bias, pool = setup(shape)
    slots = live_slots(batch, gen)
    if batch > 1:
        slots[-3:] = 0  # padded rows
    real = slots != 0
    pool[0] = 0.5
    expect_pool = pool.clone()
    for _ in range(3):
        u = torch.randn(batch, d, device="cuda", generator=gen).to(torch.bfloat16)
        h = torch.randn(batch, g, device="cuda", generator=gen).to(torch.bfloat16)
        expect = ref.dynamic_conv_decode(u, h, w2_weight, w2_bias, expect_pool, slots)
        out = dynamic_conv_decode(u, h, w2_weight, w2_bias, pool, slots)
        assert torch.isfinite(out[real]).all()
        torch.testing.assert_close(out[real].float(), expect[real].float(), **BF16_TOL)
    assert_same_bits(pool[1:], expect_pool[1:])


@pytest.mark.parametrize("shape", ["2B", "4B"])
@pytest.mark.parametrize(("num_nodes", "chain"), [(6, True), (8, False)])
@pytest.mark.parametrize("batch", [1, 16, 64])  # verify_tiles_for's three tilings: <= 16 rows, <= 128, more
def test_verify_and_commit_real_shapes(shape: str, num_nodes: int, chain: bool, batch: int) -> None:
    from jetserve.ops.dynamic_conv.commit import dynamic_conv_commit
    from jetserve.ops.dynamic_conv.verify import dynamic_conv_verify

    d, g, gen, w2_weight, w2_bias, pool = setup(shape, seed=num_nodes)
    cpu = torch.Generator().manual_seed(batch)
    parents = torch.empty(batch, num_nodes, dtype=torch.int32)
    for i in range(batch):
        for j in range(num_nodes):
            parents[i, j] = j - 1 if chain or j < 2 else int(torch.randint(0, j, (1,), generator=cpu))
    u = torch.randn(batch * num_nodes, d, device="cuda", generator=gen).to(torch.bfloat16)
    h = torch.randn(batch * num_nodes, g, device="cuda", generator=gen).to(torch.bfloat16)
    slots = live_slots(batch, gen)
    parents = parents.cuda()
    before = pool.clone()
    expect = ref.dynamic_conv_verify(u, h, w2_weight, w2_bias, pool, slots, parents)
    out = dynamic_conv_verify(u, h, w2_weight, w2_bias, pool, slots, parents)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expect.float(), **BF16_TOL)
    assert_same_bits(pool.nan_to_num(nan=-7.0), before.nan_to_num(nan=-7.0))

    # Accept a path to node num_nodes-1 (its ancestry), cut to a per-row count in [0, depth].
    accepted = torch.full((batch, num_nodes), -1, dtype=torch.int32)
    counts = torch.zeros(batch, dtype=torch.int32)
    for i in range(batch):
        path, node = [], num_nodes - 1
        while node >= 0:
            path.append(node)
            node = int(parents[i, node])
        path = path[::-1][: int(torch.randint(0, len(path) + 1, (1,), generator=cpu))]
        accepted[i, : len(path)] = torch.tensor(path, dtype=torch.int32)
        counts[i] = len(path)
    accepted, counts = accepted.cuda(), counts.cuda()
    expect_pool = pool.clone()
    ref.dynamic_conv_commit(u, expect_pool, slots, accepted, counts)
    dynamic_conv_commit(u, pool, slots, accepted, counts)
    assert_same_bits(pool.nan_to_num(nan=-7.0), expect_pool.nan_to_num(nan=-7.0))


def test_decode_replays_in_cuda_graph() -> None:
    from jetserve.ops.dynamic_conv.decode import dynamic_conv_decode

    d, g, gen, w2_weight, w2_bias, pool = setup("2B")
    batch = 8
    slots = live_slots(batch, gen)
    u = torch.randn(batch, d, device="cuda", generator=gen).to(torch.bfloat16)
    h = torch.randn(batch, g, device="cuda", generator=gen).to(torch.bfloat16)
    expect_pool = pool.clone()
    dynamic_conv_decode(u, h, w2_weight, w2_bias, pool.clone(), slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dynamic_conv_decode(u, h, w2_weight, w2_bias, pool, slots)
    for _ in range(2):
        graph.replay()
        expect = ref.dynamic_conv_decode(u, h, w2_weight, w2_bias, expect_pool, slots)
        torch.testing.assert_close(out.float(), expect.float(), **BF16_TOL)
    assert_same_bits(pool[1:], expect_pool[1:])
