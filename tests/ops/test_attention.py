"""Attention: the reference against a dense per-sequence formulation, and the Triton kernels against the reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton

from jetserve import envs
from jetserve.ops.attention import reference as ref


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float):
    """softmax(q kᵀ · scale, masked) v in float64 for one sequence: q [Lq, H, Dh], keys/values [Lk, HK, Dh],
    mask [Lq, Lk] bool; query head h reads KV head h // (H // HK)."""
    group = q.shape[1] // keys.shape[1]
    kh = keys.double().repeat_interleave(group, dim=1)  # [Lk, H, Dh]
    vh = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kh) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vh)  # [Lq, H, Dh]


def window_mask(q_pos: list[int], k_pos: list[int], window: int) -> torch.Tensor:
    """Key at position b is visible to a query at a iff b <= a and (no window or b > a - window)."""
    return torch.tensor([[b <= a and (window == 0 or b > a - window) for b in k_pos] for a in q_pos], dtype=torch.bool)


class PagedCache:
    """A NaN-filled paged K/V cache with per-sequence block tables of shuffled pages (page 0 never handed out)."""

    def __init__(self, num_seqs, pages_per_seq, page_size, num_kv_heads, head_dim, *, ring=0, dtype=torch.float32):
        gen = torch.Generator().manual_seed(7)
        num_pages = 1 + num_seqs * pages_per_seq + 3  # spare pages nobody owns
        self.page_size, self.ring = page_size, ring
        perm = torch.randperm(num_pages - 1, generator=gen)[: num_seqs * pages_per_seq] + 1
        self.block_tables = perm.view(num_seqs, pages_per_seq).to(torch.int32)  # [N, P]
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.full(shape, float("nan"), dtype=dtype)
        self.v = torch.full(shape, float("nan"), dtype=dtype)

    def slot(self, seq: int, pos: int) -> int:
        logical = pos % self.ring if self.ring else pos
        return int(self.block_tables[seq, logical // self.page_size]) * self.page_size + logical % self.page_size

    def write(self, seq: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows [L, HK, Dh] of positions start.. (later positions overwrite earlier ones in a ring)."""
        for j in range(k.shape[0]):
            s = self.slot(seq, start + j)
            self.k.view(-1, *self.k.shape[2:])[s] = k[j]
            self.v.view(-1, *self.v.shape[2:])[s] = v[j]

    def read(self, seq: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.slot(seq, pos)
        return self.k.view(-1, *self.k.shape[2:])[s], self.v.view(-1, *self.v.shape[2:])[s]

    def slots(self, seq: int, start: int, count: int) -> list[int]:
        return [self.slot(seq, start + j) for j in range(count)]

    def clone(self) -> PagedCache:
        other = object.__new__(PagedCache)
        other.__dict__.update(self.__dict__, k=self.k.clone(), v=self.v.clone())
        return other


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def randn(gen: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


H, HK, DH, PAGE = 4, 2, 16, 4
SCALE = DH**-0.5


def run_prefill(cache, q, k, v, prefix_lens, new_lens, *, window=0, impl=ref, slot_mapping=None):
    cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor([p + n for p, n in zip(prefix_lens, new_lens, strict=True)], dtype=torch.int32)
    if slot_mapping is None:
        slot_mapping = torch.tensor(
            [s for i, (p, n) in enumerate(zip(prefix_lens, new_lens, strict=True)) for s in cache.slots(i, p, n)],
            dtype=torch.long,
        )
    return impl.attention_prefill(
        q, k, v, cache.k, cache.v, cu, ctx, cache.block_tables, slot_mapping,
        scale=SCALE, window_tokens=window, ring_tokens=cache.ring, max_seqlen_q=max(new_lens),
    )  # fmt: skip


def run_decode(cache, q, k, v, context_lens, *, window=0, impl=ref):
    slots = torch.tensor([cache.slot(i, c - 1) for i, c in enumerate(context_lens)], dtype=torch.long)
    return impl.attention_decode(
        q, k, v, cache.k, cache.v, torch.tensor(context_lens, dtype=torch.int32), cache.block_tables, slots,
        scale=SCALE, window_tokens=window, ring_tokens=cache.ring,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------- RoPE


def test_rope_table_and_rotation_match_angles():
    dh, theta = 32, 1e6
    table = ref.rope_cos_sin(50, dh, theta)
    inv = [theta ** (-2 * i / dh) for i in range(dh // 2)]
    angles = torch.tensor([[p * f for f in inv] for p in range(50)], dtype=torch.float64)
    torch.testing.assert_close(table.double(), torch.cat([angles.cos(), angles.sin()], -1), atol=2e-5, rtol=0)

    gen = torch.Generator().manual_seed(0)
    q, k = randn(gen, 6, 4, dh), randn(gen, 6, 2, dh)
    positions = torch.tensor([0, 1, 7, 7, 33, 49])
    q_rot, k_rot = ref.apply_rope(q, k, positions, table)
    for x, x_rot in ((q, q_rot), (k, k_rot)):
        # Rotate-half pairs dim i with dim i + Dh/2: as a complex number (x_i + j x_{i+Dh/2}) times e^{j·angle}.
        z = torch.complex(x[..., : dh // 2].double(), x[..., dh // 2 :].double())
        z = z * torch.polar(torch.ones_like(angles[positions]), angles[positions])[:, None, :]
        torch.testing.assert_close(x_rot.double(), torch.cat([z.real, z.imag], -1), atol=1e-4, rtol=1e-4)
    assert not q_rot.data_ptr() == q.data_ptr()


# ----------------------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("window", [0, 7])
def test_prefill_matches_dense_on_mixed_batch(window):
    gen = torch.Generator().manual_seed(1)
    prefix_lens, new_lens = [0, 3, 17, 5, 9], [5, 1, 17, 33, 2]
    cache = PagedCache(len(new_lens), 13, PAGE, HK, DH)
    hist_k = [randn(gen, p + n, HK, DH) for p, n in zip(prefix_lens, new_lens, strict=True)]
    hist_v = [randn(gen, p + n, HK, DH) for p, n in zip(prefix_lens, new_lens, strict=True)]
    for i, p in enumerate(prefix_lens):
        cache.write(i, 0, hist_k[i][:p], hist_v[i][:p])
    before = cache.clone()
    q = randn(gen, sum(new_lens), H, DH)
    k = torch.cat([hk[p:] for hk, p in zip(hist_k, prefix_lens, strict=True)])
    v = torch.cat([hv[p:] for hv, p in zip(hist_v, prefix_lens, strict=True)])
    out = run_prefill(cache, q, k, v, prefix_lens, new_lens, window=window)

    assert out.dtype == q.dtype and out.shape == q.shape
    offset = 0
    written = set()
    for i, (p, n) in enumerate(zip(prefix_lens, new_lens, strict=True)):
        mask = window_mask(list(range(p, p + n)), list(range(p + n)), window)
        expect = dense_attention(q[offset : offset + n], hist_k[i], hist_v[i], mask, SCALE)
        torch.testing.assert_close(out[offset : offset + n].double(), expect, atol=1e-5, rtol=1e-5)
        for j in range(p + n):  # every position of the sequence is now in the cache
            kk, vv = cache.read(i, j)
            assert same_bits(kk, hist_k[i][j]) and same_bits(vv, hist_v[i][j])
        written.update(cache.slots(i, p, n))
        offset += n
    untouched = torch.ones(cache.k.shape[0] * PAGE, dtype=torch.bool)
    untouched[list(written)] = False
    assert same_bits(cache.k.view(-1, HK, DH)[untouched], before.k.view(-1, HK, DH)[untouched])
    assert same_bits(cache.v.view(-1, HK, DH)[untouched], before.v.view(-1, HK, DH)[untouched])


@pytest.mark.parametrize("ring", [0, 8])
def test_window_sees_exactly_window_keys(ring):
    # With q = 0 every visible key has the same score, so channel 0 of the output is the mean of the visible keys'
    # positions: p - (w-1)/2 once p >= w-1, i.e. exactly the w keys [p-w+1, p].
    window, total = 5, 23
    cache = PagedCache(1, 6, PAGE, HK, DH, ring=ring)
    gen = torch.Generator().manual_seed(2)
    k = randn(gen, total, HK, DH)
    v = torch.arange(total, dtype=torch.float32)[:, None, None].expand(total, HK, DH).clone()
    q = torch.zeros(total, H, DH)
    first = 11  # a cached prefix, then the rest in one chunk
    run_prefill(cache, q[:first], k[:first], v[:first], [0], [first], window=window)
    out = run_prefill(cache, q[first:], k[first:], v[first:], [first], [total - first], window=window)
    for j in range(total - first):
        p = first + j
        seen = min(p + 1, window)
        assert out[j, :, 0].allclose(torch.full((H,), p - (seen - 1) / 2)), (p, out[j, :, 0])


def test_gqa_equals_mha_with_repeated_kv_heads():
    gen = torch.Generator().manual_seed(3)
    prefix_lens, new_lens = [6, 0], [5, 9]
    group = H // HK
    hist_k = [randn(gen, p + n, HK, DH) for p, n in zip(prefix_lens, new_lens, strict=True)]
    hist_v = [randn(gen, p + n, HK, DH) for p, n in zip(prefix_lens, new_lens, strict=True)]
    q = randn(gen, sum(new_lens), H, DH)
    outs = []
    for kv_heads, rep in ((HK, 1), (H, group)):
        cache = PagedCache(2, 4, PAGE, kv_heads, DH)
        for i, p in enumerate(prefix_lens):
            cache.write(i, 0, hist_k[i][:p].repeat_interleave(rep, 1), hist_v[i][:p].repeat_interleave(rep, 1))
        k = torch.cat([hk[p:] for hk, p in zip(hist_k, prefix_lens, strict=True)]).repeat_interleave(rep, 1)
        v = torch.cat([hv[p:] for hv, p in zip(hist_v, prefix_lens, strict=True)]).repeat_interleave(rep, 1)
        outs.append(run_prefill(cache, q, k, v, prefix_lens, new_lens, window=4))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)


def feed(cache, k_all, v_all, q_all, schedule, window):
    """Run one sequence's tokens through the cache as a schedule of prefill chunk lengths (1 = a decode step);
    returns the outputs of every token [L, H, Dh]."""
    outs, pos = [], 0
    for n in schedule:
        sl = slice(pos, pos + n)
        if n == 1:
            outs.append(run_decode(cache, q_all[sl], k_all[sl], v_all[sl], [pos + 1], window=window))
        else:
            outs.append(run_prefill(cache, q_all[sl], k_all[sl], v_all[sl], [pos], [n], window=window))
        pos += n
    return torch.cat(outs)


@pytest.mark.parametrize("window", [0, 6])
def test_prefill_then_decode_equals_one_prefill(window):
    gen = torch.Generator().manual_seed(4)
    total = 21
    q, k, v = randn(gen, total, H, DH), randn(gen, total, HK, DH), randn(gen, total, HK, DH)
    whole = feed(PagedCache(1, 6, PAGE, HK, DH), k, v, q, [total], window)
    stepped = feed(PagedCache(1, 6, PAGE, HK, DH), k, v, q, [13, 1, 1, 5, 1], window)
    torch.testing.assert_close(stepped, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ring", [8, 12])
def test_ring_cache_equals_plain_cache(ring):
    # window 7 fits a ring of 8 or 12 tokens; the 19-token chunk is longer than either ring.
    gen = torch.Generator().manual_seed(5)
    window, total = 7, 40
    q, k, v = randn(gen, total, H, DH), randn(gen, total, HK, DH), randn(gen, total, HK, DH)
    schedule = [3, 1, 19, 1, 1, 9, 1, 5]
    plain = feed(PagedCache(1, 10, PAGE, HK, DH), k, v, q, schedule, window)
    ringed = feed(PagedCache(1, ring // PAGE, PAGE, HK, DH, ring=ring), k, v, q, schedule, window)
    torch.testing.assert_close(ringed, plain, atol=1e-5, rtol=1e-5)
    expect = torch.cat(
        [dense_attention(q[p : p + 1], k, v, window_mask([p], list(range(total)), window), SCALE) for p in range(total)]
    )
    torch.testing.assert_close(plain.double(), expect, atol=1e-5, rtol=1e-5)


def test_padded_rows_write_nothing():
    gen = torch.Generator().manual_seed(6)
    cache = PagedCache(2, 4, PAGE, HK, DH)
    cache.write(0, 0, randn(gen, 5, HK, DH), randn(gen, 5, HK, DH))
    before = cache.clone()
    q, k, v = randn(gen, 2, H, DH), randn(gen, 2, HK, DH), randn(gen, 2, HK, DH)
    # Sequence 1 is padding: its slot is -1 and its table points at page 0; only sequence 0's new slot may change.
    cache.block_tables[1] = 0
    slots = torch.tensor([cache.slot(0, 5), -1])
    ctx = torch.tensor([6, 1], dtype=torch.int32)
    ref.attention_decode(q, k, v, cache.k, cache.v, ctx, cache.block_tables, slots, scale=SCALE)
    changed = (cache.k.view(-1, HK, DH) != before.k.view(-1, HK, DH)).any(-1).any(-1)
    changed &= ~(cache.k.view(-1, HK, DH).isnan().all(-1).all(-1) & before.k.view(-1, HK, DH).isnan().all(-1).all(-1))
    assert changed.nonzero().view(-1).tolist() == [cache.slot(0, 5)]
    assert same_bits(cache.k.view(-1, HK, DH)[0], before.k.view(-1, HK, DH)[0])


# ------------------------------------------------------------------------------------------------ verify/commit


def random_tree(num_nodes: int, gen: torch.Generator) -> list[int]:
    """Parents in topological order: node 0 is the root (parent -1), nodes 1 and 2 chain so some path has depth 2."""
    return [j - 1 if j < 3 else int(torch.randint(0, j, (1,), generator=gen)) for j in range(num_nodes)]


def ancestry(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_mask_of(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for j in range(n):
        mask[j, ancestry(parents, j)] = True
    return mask


def verify_case(gen, prefix_lens, num_nodes, ring, trees=None):
    cache = PagedCache(len(prefix_lens), 8, PAGE, HK, DH, ring=ring)
    hist = [(randn(gen, p, HK, DH), randn(gen, p, HK, DH)) for p in prefix_lens]
    for i, (hk, hv) in enumerate(hist):
        cache.write(i, 0, hk, hv)
    trees = trees or [random_tree(num_nodes, gen) for _ in prefix_lens]
    t = len(prefix_lens) * num_nodes
    q, k, v = randn(gen, t, H, DH), randn(gen, t, HK, DH), randn(gen, t, HK, DH)
    return cache, hist, trees, q, k, v


def run_verify(cache, q, k, v, prefix_lens, trees, window, impl=ref):
    num_nodes = len(trees[0])
    mask = torch.stack([tree_mask_of(p) for p in trees])
    ctx = torch.tensor([p + num_nodes for p in prefix_lens], dtype=torch.int32)
    slots = torch.tensor([s for i, p in enumerate(prefix_lens) for s in cache.slots(i, p, num_nodes)])
    return impl.attention_verify(
        q, k, v, cache.k, cache.v, mask, ctx, cache.block_tables, slots,
        scale=SCALE, window_tokens=window, ring_tokens=cache.ring,
    )  # fmt: skip


@pytest.mark.parametrize("window,ring", [(0, 0), (5, 0), (5, 16)])
def test_verify_equals_decode_along_ancestry(window, ring):
    gen = torch.Generator().manual_seed(8)
    prefix_lens, num_nodes = [9, 3, 14], 7
    cache, hist, trees, q, k, v = verify_case(gen, prefix_lens, num_nodes, ring)
    out = run_verify(cache, q, k, v, prefix_lens, trees, window)
    for i, p in enumerate(prefix_lens):
        for j in range(num_nodes):
            path = ancestry(trees[i], j)
            rows = [i * num_nodes + a for a in path]
            keys = torch.cat([hist[i][0], k[rows]])
            values = torch.cat([hist[i][1], v[rows]])
            positions = list(range(p + len(path)))
            expect = dense_attention(q[rows[-1:]], keys, values, window_mask(positions[-1:], positions, window), SCALE)
            torch.testing.assert_close(out[rows[-1]].double(), expect[0], atol=1e-5, rtol=1e-5)
        for j in range(num_nodes):  # node j is stored at position prefix + j
            kk, vv = cache.read(i, p + j)
            assert same_bits(kk, k[i * num_nodes + j]) and same_bits(vv, v[i * num_nodes + j])


@pytest.mark.parametrize("window,ring", [(0, 0), (6, 16)])
def test_commit_then_decode_equals_prefill_of_accepted_path(window, ring):
    gen = torch.Generator().manual_seed(9)
    prefix_lens, num_nodes = [10, 4, 7], 6
    # Sequence 0 accepts the branch 0-2-3-5 (three moves, each onto the previous one's source), 1 only the root,
    # 2 nothing (a padded row).
    trees = [[-1, 0, 0, 2, 1, 3], random_tree(num_nodes, gen), random_tree(num_nodes, gen)]
    cache, hist, trees, q, k, v = verify_case(gen, prefix_lens, num_nodes, ring, trees)
    run_verify(cache, q, k, v, prefix_lens, trees, window)
    paths = [[0, 2, 3, 5], [0], []]
    accepted = torch.zeros(3, num_nodes, dtype=torch.int32)
    for i, path in enumerate(paths):
        accepted[i, : len(path)] = torch.tensor(path, dtype=torch.int32)
        accepted[i, len(path) :] = -1
    num_accepted = torch.tensor([len(p) for p in paths], dtype=torch.int32)
    ref.kv_cache_commit(
        cache.k, cache.v, cache.block_tables, torch.tensor(prefix_lens, dtype=torch.int32), accepted, num_accepted,
        ring_tokens=ring,
    )  # fmt: skip
    q_next, k_next, v_next = randn(gen, 2, H, DH), randn(gen, 2, HK, DH), randn(gen, 2, HK, DH)
    lens = [p + len(path) + 1 for p, path in zip(prefix_lens[:2], paths[:2], strict=True)]
    sub = PagedCache(2, 8, PAGE, HK, DH, ring=ring)
    sub.block_tables, sub.k, sub.v = cache.block_tables[:2], cache.k, cache.v
    out = run_decode(sub, q_next, k_next, v_next, lens, window=window)

    for i in range(2):
        rows = [i * num_nodes + a for a in paths[i]]
        fresh = PagedCache(1, 8, PAGE, HK, DH, ring=ring)
        fresh.write(0, 0, hist[i][0], hist[i][1])
        fresh.write(0, prefix_lens[i], k[rows], v[rows])
        expect = run_decode(fresh, q_next[i : i + 1], k_next[i : i + 1], v_next[i : i + 1], [lens[i]], window=window)
        torch.testing.assert_close(out[i : i + 1], expect, atol=1e-6, rtol=1e-6)
        for j in range(len(rows)):
            assert same_bits(cache.read(i, prefix_lens[i] + j)[0], k[rows[j]])
    # The row that accepted nothing keeps its tree where verify stored it.
    for j in range(num_nodes):
        assert same_bits(cache.read(2, prefix_lens[2] + j)[0], k[2 * num_nodes + j])


# --- Triton kernels against the reference (the interpreter on the CPU: fp32/fp16 only, tiny grids) ---

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def triton_attention(poisoned_empty):
    """The Triton variants, with every new floating-point tensor NaN-filled while a test runs."""
    if DEVICE == "cpu" and not envs.triton_interpret():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from jetserve.ops.attention import decode, kv_store, prefill, rope

    return SimpleNamespace(
        apply_rope=rope.apply_rope,
        attention_prefill=prefill.attention_prefill,
        attention_decode=decode.attention_decode,
        attention_verify=decode.attention_verify,
        kv_cache_commit=kv_store.kv_cache_commit,
    )


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    tol = TOLERANCE[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def filled_cache(gen, prefix_lens, pages_per_seq, page_size, head_dim, ring, dtype):
    cache = PagedCache(len(prefix_lens), pages_per_seq, page_size, HK, head_dim, ring=ring, dtype=dtype)
    for i, p in enumerate(prefix_lens):
        cache.write(i, 0, randn(gen, p, HK, head_dim, dtype=dtype), randn(gen, p, HK, head_dim, dtype=dtype))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_rope(triton_attention, dtype):
    gen = torch.Generator().manual_seed(20)
    table = ref.rope_cos_sin(64, 32, 1e6)
    q, k = randn(gen, 7, H, 32, dtype=dtype), randn(gen, 7, HK, 32, dtype=dtype)
    q = torch.cat([q, q], dim=1)[:, ::2]  # a strided head dim
    positions = torch.tensor([0, 1, 2, 17, 33, 63, 5])
    got = triton_attention.apply_rope(q, k, positions, table)
    want = ref.apply_rope(q, k, positions, table)
    assert_matches(got[0], want[0])
    assert_matches(got[1], want[1])


# (window, ring, page_size, head_dim, dtype); lengths 1, 2, 5, 17, 33 over cached prefixes
PREFILL_CASES = [
    (0, 0, 4, 16, torch.float32),
    (7, 0, 16, 32, torch.float32),
    (7, 8, 4, 16, torch.float32),
    (5, 16, 16, 16, torch.float32),
    (0, 0, 16, 32, torch.float16),
]


@pytest.mark.parametrize("window,ring,page_size,head_dim,dtype", PREFILL_CASES)
def test_triton_prefill(triton_attention, window, ring, page_size, head_dim, dtype):
    gen = torch.Generator().manual_seed(21)
    prefix_lens, new_lens = [0, 3, 17, 2, 9], [5, 1, 17, 33, 2]
    pages = triton.cdiv(ring, page_size) if ring else triton.cdiv(50, page_size)
    cache = filled_cache(gen, prefix_lens, pages, page_size, head_dim, ring, dtype)
    mine = cache.clone()
    t = sum(new_lens)
    q, k, v = (
        randn(gen, t, H, head_dim, dtype=dtype),
        randn(gen, t, HK, head_dim, dtype=dtype),
        randn(gen, t, HK, head_dim, dtype=dtype),
    )
    slots = torch.tensor(
        [s for i, (p, n) in enumerate(zip(prefix_lens, new_lens, strict=True)) for s in cache.slots(i, p, n)]
    )
    slots[5] = -1  # a padded row
    scale = head_dim**-0.5

    def call(impl, c):
        cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
        ctx = torch.tensor([p + n for p, n in zip(prefix_lens, new_lens, strict=True)], dtype=torch.int32)
        return impl.attention_prefill(
            q, k, v, c.k, c.v, cu, ctx, c.block_tables, slots,
            scale=scale, window_tokens=window, ring_tokens=ring, max_seqlen_q=max(new_lens),
        )  # fmt: skip

    assert_matches(call(triton_attention, mine), call(ref, cache))
    assert same_bits(mine.k, cache.k) and same_bits(mine.v, cache.v)


# (context lens, window, ring, page_size, head_dim, dtype); one row of each batch is padding (slot -1)
DECODE_CASES = [
    ([1, 2, 5, 17, 33], 0, 0, 4, 16, torch.float32),
    ([40, 17], 0, 0, 16, 32, torch.float32),
    ([70], 9, 0, 4, 16, torch.float32),
    ([70, 3], 9, 12, 4, 16, torch.float32),
    ([33, 5, 1], 0, 0, 16, 32, torch.float16),
]


@pytest.mark.parametrize("context_lens,window,ring,page_size,head_dim,dtype", DECODE_CASES)
def test_triton_decode(triton_attention, context_lens, window, ring, page_size, head_dim, dtype):
    gen = torch.Generator().manual_seed(22)
    pages = triton.cdiv(ring, page_size) if ring else triton.cdiv(80, page_size)
    cache = filled_cache(gen, [c - 1 for c in context_lens], pages, page_size, head_dim, ring, dtype)
    mine = cache.clone()
    n = len(context_lens)
    q, k, v = (
        randn(gen, n, H, head_dim, dtype=dtype),
        randn(gen, n, HK, head_dim, dtype=dtype),
        randn(gen, n, HK, head_dim, dtype=dtype),
    )
    slots = torch.tensor([cache.slot(i, c - 1) for i, c in enumerate(context_lens)])
    slots[-1] = -1
    ctx = torch.tensor(context_lens, dtype=torch.int32)

    def call(impl, c):
        return impl.attention_decode(
            q, k, v, c.k, c.v, ctx, c.block_tables, slots,
            scale=head_dim**-0.5, window_tokens=window, ring_tokens=ring,
        )  # fmt: skip

    assert_matches(call(triton_attention, mine), call(ref, cache))
    assert same_bits(mine.k, cache.k) and same_bits(mine.v, cache.v)


def test_triton_decode_splits_cover_the_merge():
    from jetserve.ops.attention import decode

    cpu = torch.device("cpu")
    assert decode.decode_plan(2, 80, cpu) == (4, 16, 1, 1)  # one sequence: the key range is split and merged
    assert decode.decode_plan(10, 80, cpu) == (1, 16, 1, 1)  # five sequences: one program each
    assert decode.decode_plan(2, 20, cpu) == (2, 16, 1, 1)  # no more splits than key tiles
    assert decode.decode_plan(2, 80, cpu, verify=True) == (4, 16, 1, 1)


def test_decode_plan_on_an_h200(monkeypatch):
    """The GPU rule (session 24's sweep) without a GPU: 132 SMs, splits rounded down to two programs per SM."""
    from jetserve.ops.attention import decode

    monkeypatch.setattr(decode, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert decode.decode_plan(512, 4096, cuda) == (1, 128, 4, 2)  # batch 256: one split, 128-key tiles
    assert decode.decode_plan(128, 4096, cuda) == (2, 128, 4, 2)  # batch 64: 256 programs, not 384
    assert decode.decode_plan(128, 1152, cuda) == (2, 128, 4, 2)  # a 1152-token window still keeps two tiles a split
    assert decode.decode_plan(32, 1152, cuda) == (8, 64, 4, 2)  # ... but not in eight splits
    assert decode.decode_plan(2, 4096, cuda) == (64, 64, 4, 2)  # batch 1: 64 splits of 64-key tiles
    assert decode.decode_plan(2, 16384, cuda) == (64, 128, 4, 2)
    assert decode.decode_plan(2, 100, cuda) == (2, 64, 4, 2)  # never more splits than tiles
    assert decode.decode_plan(128, 4096, cuda, verify=True) == (2, 64, 4, 2)  # verify: 64-key tiles always
    assert decode.decode_plan(2, 4096, cuda, verify=True) == (64, 64, 4, 2)


# (prefix lens, tree nodes, chain, window, ring, dtype): 9 nodes x 2 heads per group is two row blocks in the
# interpreter; a chain of 9 under a window of 4 drops both prefix keys and ancestors
VERIFY_CASES = [
    ([5, 30], 7, False, 0, 0, torch.float32),
    ([12, 0], 9, False, 6, 0, torch.float32),
    ([12, 3], 9, True, 4, 0, torch.float32),
    ([40, 9], 6, False, 5, 16, torch.float32),
    ([21], 9, False, 0, 0, torch.float16),
]


@pytest.mark.parametrize("prefix_lens,num_nodes,chain,window,ring,dtype", VERIFY_CASES)
def test_triton_verify(triton_attention, prefix_lens, num_nodes, chain, window, ring, dtype):
    gen = torch.Generator().manual_seed(23)
    pages = triton.cdiv(ring, PAGE) if ring else 13
    cache = filled_cache(gen, prefix_lens, pages, PAGE, DH, ring, dtype)
    mine = cache.clone()
    trees = [list(range(-1, num_nodes - 1)) if chain else random_tree(num_nodes, gen) for _ in prefix_lens]
    t = len(prefix_lens) * num_nodes
    q, k, v = randn(gen, t, H, DH, dtype=dtype), randn(gen, t, HK, DH, dtype=dtype), randn(gen, t, HK, DH, dtype=dtype)
    mask = torch.stack([tree_mask_of(p) for p in trees])
    ctx = torch.tensor([p + num_nodes for p in prefix_lens], dtype=torch.int32)
    slots = torch.tensor([s for i, p in enumerate(prefix_lens) for s in cache.slots(i, p, num_nodes)])

    def call(impl, c):
        return impl.attention_verify(
            q, k, v, c.k, c.v, mask, ctx, c.block_tables, slots,
            scale=SCALE, window_tokens=window, ring_tokens=ring,
        )  # fmt: skip

    assert_matches(call(triton_attention, mine), call(ref, cache))
    assert same_bits(mine.k, cache.k) and same_bits(mine.v, cache.v)


@pytest.mark.parametrize("ring", [0, 16])
def test_triton_commit(triton_attention, ring):
    gen = torch.Generator().manual_seed(24)
    prefix_lens, num_nodes = [10, 4, 7, 13], 6
    cache = filled_cache(gen, [p + num_nodes for p in prefix_lens], 8, PAGE, DH, ring, torch.float32)
    mine = cache.clone()
    paths = [[0, 2, 3, 5], [0], [], [0, 1, 2]]  # moves onto earlier sources, root only, nothing, a chain
    accepted = torch.full((4, num_nodes), -1, dtype=torch.int32)
    for i, path in enumerate(paths):
        accepted[i, : len(path)] = torch.tensor(path, dtype=torch.int32)
    num_accepted = torch.tensor([len(p) for p in paths], dtype=torch.int32)
    prefix = torch.tensor(prefix_lens, dtype=torch.int32)
    ref.kv_cache_commit(cache.k, cache.v, cache.block_tables, prefix, accepted, num_accepted, ring_tokens=ring)
    triton_attention.kv_cache_commit(
        mine.k, mine.v, mine.block_tables, prefix, accepted, num_accepted, ring_tokens=ring
    )
    assert same_bits(mine.k, cache.k) and same_bits(mine.v, cache.v)


def test_triton_rope_reads_positions_through_their_stride(triton_attention):
    """Positions handed as views (a column of a matrix, an expanded scalar — the draft's tree levels make the
    latter) rotate as their values say, not as the memory beside them does."""
    gen = torch.Generator().manual_seed(22)
    table = ref.rope_cos_sin(64, 32, 1e6)
    q, k = randn(gen, 5, H, 32), randn(gen, 5, HK, 32)
    wanted = torch.tensor([3, 9, 0, 40, 63])
    column = torch.stack([wanted, torch.full_like(wanted, 50)], dim=1)[:, 0]  # stride 2; 50s in between
    expanded = torch.tensor([7]).expand(5)  # stride 0
    for positions in (column, expanded):
        assert not positions.is_contiguous()
        got = triton_attention.apply_rope(q, k, positions, table)
        want = ref.apply_rope(q, k, positions.contiguous(), table)
        assert_matches(got[0], want[0])
        assert_matches(got[1], want[1])
