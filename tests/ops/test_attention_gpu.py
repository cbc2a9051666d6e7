"""Attention Triton kernels against the reference at the real 2B/4B shapes in bf16 (H 12/16, HK 2, Dh 128)."""

from __future__ import annotations

import pytest
import torch
import triton

from jetserve.ops.attention import decode, kv_store, prefill, reference, rope

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("poisoned_empty"),  # new outputs start as NaN (tests/ops/conftest.py)
]

HK, DH, PAGE = 2, 128, 16
SCALE = DH**-0.5
DTYPE = torch.bfloat16


class Pool:
    """Random paged K/V for N sequences (page 0 NaN and never handed out), with vectorised slot lookup."""

    def __init__(self, num_seqs: int, capacity_tokens: int, ring: int = 0, seed: int = 0):
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.ring = ring
        pages = triton.cdiv(ring or capacity_tokens, PAGE)
        num_pages = 1 + num_seqs * pages + 1
        perm = torch.randperm(num_seqs * pages, generator=self.gen, device="cuda") + 1
        self.block_tables = perm.view(num_seqs, pages).to(torch.int32)  # [N, P]
        self.k = self.randn(num_pages, PAGE, HK, DH)
        self.v = self.randn(num_pages, PAGE, HK, DH)
        for cache in (self.k, self.v):
            cache[0] = float("nan")
            cache[-1] = float("nan")  # nobody's page

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device="cuda").to(DTYPE)

    def slots(self, seqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logical = positions % self.ring if self.ring else positions
        pages = self.block_tables[seqs, logical // PAGE].long()
        return pages * PAGE + logical % PAGE

    def clone(self) -> Pool:
        other = object.__new__(Pool)
        other.__dict__.update(self.__dict__, k=self.k.clone(), v=self.v.clone())
        return other


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("num_heads", [12, 16])
def test_rope_real_shapes(num_heads):
    gen = torch.Generator(device="cuda").manual_seed(1)
    table = reference.rope_cos_sin(8192, DH, 1e6).cuda()
    q = torch.randn(333, num_heads, DH, generator=gen, device="cuda").to(DTYPE)
    k = torch.randn(333, HK, DH, generator=gen, device="cuda").to(DTYPE)
    positions = torch.randint(0, 8192, (333,), generator=gen, device="cuda")
    for got, want in zip(
        rope.apply_rope(q, k, positions, table), reference.apply_rope(q, k, positions, table), strict=True
    ):
        assert_close(got, want)


@pytest.mark.parametrize(
    "num_seqs,context,num_heads,window,ring",
    [
        (1, 4096, 12, 0, 0),
        (64, 4096, 16, 0, 0),
        (256, 4096, 12, 0, 0),
        (64, 4096, 12, 1152, 1152 + 16),
        (256, 4096, 16, 2048, 2048 + 16),
        (1, 3000, 16, 2048, 0),
        (1, 16384, 12, 0, 0),  # 64 splits of 128-key tiles
        (16, 2000, 12, 1152, 1152 + 16),  # 8 splits of 64-key tiles
    ],
)
def test_decode_real_shapes(num_seqs, context, num_heads, window, ring):
    pool = Pool(num_seqs, context + 16, ring)
    ctx = torch.randint(context // 2, context + 1, (num_seqs,), generator=pool.gen, device="cuda").to(torch.int32)
    ctx[0] = context
    q, k, v = pool.randn(num_seqs, num_heads, DH), pool.randn(num_seqs, HK, DH), pool.randn(num_seqs, HK, DH)
    seqs = torch.arange(num_seqs, device="cuda")
    slots = pool.slots(seqs, ctx.long() - 1)
    mine = pool.clone()
    kwargs = dict(scale=SCALE, window_tokens=window, ring_tokens=ring)
    want = reference.attention_decode(q, k, v, pool.k, pool.v, ctx, pool.block_tables, slots, **kwargs)
    got = decode.attention_decode(q, k, v, mine.k, mine.v, ctx, mine.block_tables, slots, **kwargs)
    assert_close(got, want)
    assert same_bits(mine.k, pool.k) and same_bits(mine.v, pool.v)


@pytest.mark.parametrize(
    "prefix_lens,new_lens,num_heads,window,ring",
    [
        ([0], [4096], 12, 0, 0),
        ([3000, 0, 17], [1096, 700, 1], 16, 0, 0),
        ([0, 2500], [4096, 1000], 12, 1152, 1152 + 16),
        ([0, 100], [4096, 2000], 16, 2048, 2048 + 16),
    ],
)
def test_prefill_real_shapes(prefix_lens, new_lens, num_heads, window, ring):
    num_seqs = len(prefix_lens)
    pool = Pool(num_seqs, max(p + n for p, n in zip(prefix_lens, new_lens, strict=True)) + 16, ring, seed=2)
    t = sum(new_lens)
    q, k, v = pool.randn(t, num_heads, DH), pool.randn(t, HK, DH), pool.randn(t, HK, DH)
    lens = torch.tensor(new_lens, device="cuda")
    cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)
    ctx = torch.tensor([p + n for p, n in zip(prefix_lens, new_lens, strict=True)], device="cuda", dtype=torch.int32)
    seqs = torch.repeat_interleave(torch.arange(num_seqs, device="cuda"), lens)
    positions = torch.arange(t, device="cuda") - cu[seqs] + (ctx - lens)[seqs]
    slots = pool.slots(seqs, positions)
    mine = pool.clone()
    kwargs = dict(scale=SCALE, window_tokens=window, ring_tokens=ring, max_seqlen_q=max(new_lens))
    want = reference.attention_prefill(q, k, v, pool.k, pool.v, cu, ctx, pool.block_tables, slots, **kwargs)
    got = prefill.attention_prefill(q, k, v, mine.k, mine.v, cu, ctx, mine.block_tables, slots, **kwargs)
    assert_close(got, want)
    assert same_bits(mine.k, pool.k) and same_bits(mine.v, pool.v)


def tree_masks(num_seqs: int, num_nodes: int, chain: bool, gen: torch.Generator) -> torch.Tensor:
    parents = [list(range(-1, num_nodes - 1))] * num_seqs
    if not chain:
        parents = [
            [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, num_nodes)] for _ in range(num_seqs)
        ]
    mask = torch.zeros(num_seqs, num_nodes, num_nodes, dtype=torch.bool)
    for i, par in enumerate(parents):
        for j in range(num_nodes):
            a = j
            while a >= 0:
                mask[i, j, a] = True
                a = par[a]
    return mask.cuda()


@pytest.mark.parametrize(
    "num_seqs,num_nodes,chain,num_heads,window,ring",
    [
        (1, 6, True, 12, 0, 0),
        (64, 6, True, 16, 0, 0),
        (1, 8, False, 16, 0, 0),
        (32, 8, False, 12, 1152, 1152 + 16),
        (32, 8, False, 16, 2048, 2048 + 16),
    ],
)
def test_verify_and_commit_real_shapes(num_seqs, num_nodes, chain, num_heads, window, ring):
    pool = Pool(num_seqs, 4096 + num_nodes + 16, ring, seed=3)
    cpu_gen = torch.Generator().manual_seed(3)
    mask = tree_masks(num_seqs, num_nodes, chain, cpu_gen)
    prefix = torch.randint(1000, 4097, (num_seqs,), generator=pool.gen, device="cuda")
    ctx = (prefix + num_nodes).to(torch.int32)
    t = num_seqs * num_nodes
    q, k, v = pool.randn(t, num_heads, DH), pool.randn(t, HK, DH), pool.randn(t, HK, DH)
    seqs = torch.arange(num_seqs, device="cuda").repeat_interleave(num_nodes)
    slots = pool.slots(seqs, prefix[seqs] + torch.arange(num_nodes, device="cuda").repeat(num_seqs))
    mine = pool.clone()
    kwargs = dict(scale=SCALE, window_tokens=window, ring_tokens=ring)
    want = reference.attention_verify(q, k, v, pool.k, pool.v, mask, ctx, pool.block_tables, slots, **kwargs)
    got = decode.attention_verify(q, k, v, mine.k, mine.v, mask, ctx, mine.block_tables, slots, **kwargs)
    assert_close(got, want)
    assert same_bits(mine.k, pool.k) and same_bits(mine.v, pool.v)

    # Accept the deepest path of each tree (node indices root first), some rows fewer.
    depth = mask.sum(-1)  # [N, T_d]
    deepest = depth.argmax(-1)  # [N]
    path_mask = mask[torch.arange(num_seqs), deepest]  # [N, T_d]: nodes on that path, in index order
    accepted = torch.where(path_mask, torch.arange(num_nodes, device="cuda"), num_nodes).sort(-1).values
    accepted = torch.where(accepted == num_nodes, -1, accepted).to(torch.int32)
    num_accepted = path_mask.sum(-1).to(torch.int32)
    num_accepted[::3] = torch.clamp(num_accepted[::3] - 1, min=0)
    prefix32 = prefix.to(torch.int32)
    reference.kv_cache_commit(pool.k, pool.v, pool.block_tables, prefix32, accepted, num_accepted, ring_tokens=ring)
    kv_store.kv_cache_commit(mine.k, mine.v, mine.block_tables, prefix32, accepted, num_accepted, ring_tokens=ring)
    assert same_bits(mine.k, pool.k) and same_bits(mine.v, pool.v)
