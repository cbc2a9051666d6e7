"""Gated delta rule: the reference against a direct per-token loop, and its prefill/decode/verify/commit identities."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from jetserve import envs
from jetserve.ops import gated_delta_rule as ops
from jetserve.ops.backend import set_backend
from jetserve.ops.gated_delta_rule import chunk, decode, prefill_inputs, tree
from jetserve.ops.gated_delta_rule import reference as ref
from jetserve.ops.gated_delta_rule.chunk_table import CHUNK_SIZE, DeltaRuleChunks
from jetserve.ops.norm import reference as norm_ref

H, K, V = 3, 16, 8
NUM_SLOTS = 7


def make_params(num_heads: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log, dt_bias `[H]` fp32 with decays from slow to fast, so states neither vanish nor stay constant."""
    A_log = torch.log(torch.rand(num_heads, generator=gen) * 0.5 + 0.02)
    dt_bias = torch.randn(num_heads, generator=gen) * 0.5
    return A_log, dt_bias


def make_tokens(
    T: int, num_heads: int, k_dim: int, v_dim: int, gen: torch.Generator, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Raw q, k `[T, H, K]`, v `[T, H, V]`, a, b `[T, H]`."""
    return {
        "q": torch.randn(T, num_heads, k_dim, generator=gen).to(dtype),
        "k": torch.randn(T, num_heads, k_dim, generator=gen).to(dtype),
        "v": torch.randn(T, num_heads, v_dim, generator=gen).to(dtype),
        "a": (torch.randn(T, num_heads, generator=gen) * 2).to(dtype),
        "b": (torch.randn(T, num_heads, generator=gen) * 2).to(dtype),
    }


def make_pool(num_slots: int, num_heads: int, k_dim: int, v_dim: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(num_slots, num_heads, k_dim, v_dim, generator=gen)


def select(tokens: dict[str, torch.Tensor], idx) -> dict[str, torch.Tensor]:
    return {name: x[idx] for name, x in tokens.items()}


def concat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Max abs error within `rel` times the max magnitude of `expected`, and every element finite."""
    assert actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    err = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    bound = rel * max(expected.double().abs().max().item() if expected.numel() else 0.0, 1e-30)
    assert err <= bound, f"max abs error {err:.3e} > {bound:.3e}"


def random_parents(N: int, T_d: int, gen: torch.Generator, chain: bool = False) -> torch.Tensor:
    parents = torch.full((N, T_d), -1, dtype=torch.int32)
    for j in range(1, T_d):
        parents[:, j] = j - 1 if chain else torch.randint(0, j, (N,), generator=gen)
    return parents


def ancestry(parents: torch.Tensor, node: int) -> list[int]:
    """Nodes from the root to `node` inclusive, for one sequence's parents `[T_d]`."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


# ---- an independent direct loop of DESIGN.md §1 steps 3–4, float64, one head at a time ----


def naive_sequence(tokens: dict[str, torch.Tensor], A_log, dt_bias, h0: torch.Tensor, scale: float):
    """One sequence: returns o `[T, H, V]` and the final state `[H, K, V]`, both float64."""
    q, k, v, a, b = (tokens[n].double() for n in "qkvab")
    T, num_heads, _ = q.shape
    o = torch.zeros(T, num_heads, v.shape[-1], dtype=torch.float64)
    finals = []
    for h in range(num_heads):
        S = h0[h].double().clone()
        for t in range(T):
            qt = q[t, h] / math.sqrt(float(q[t, h] @ q[t, h]) + 1e-6) * scale
            kt = k[t, h] / math.sqrt(float(k[t, h] @ k[t, h]) + 1e-6)
            gt = -math.exp(float(A_log[h])) * math.log1p(math.exp(float(a[t, h]) + float(dt_bias[h])))
            bt = 1.0 / (1.0 + math.exp(-float(b[t, h])))
            S = math.exp(gt) * S
            e = bt * (v[t, h] - S.T @ kt)
            S = S + torch.outer(kt, e)
            o[t, h] = S.T @ qt
        finals.append(S)
    return o, torch.stack(finals)


def run_prefill(fn, tokens, A_log, dt_bias, pool, lengths, slots, has_init, scale=None, **kwargs) -> torch.Tensor:
    return fn(
        tokens["q"],
        tokens["k"],
        tokens["v"],
        tokens["a"],
        tokens["b"],
        A_log,
        dt_bias,
        pool,
        cu_seqlens_of(lengths).to(pool.device),
        torch.tensor(slots, dtype=torch.int32, device=pool.device),
        torch.tensor(has_init, dtype=torch.bool, device=pool.device),
        scale=scale,
        **kwargs,
    )


@pytest.mark.parametrize("prefill", [ref.gated_delta_rule_prefill, ref.chunk_gated_delta_rule_prefill])
def test_prefill_matches_naive_loop(prefill):
    gen = torch.Generator().manual_seed(0)
    A_log, dt_bias = make_params(H, gen)
    lengths, slots, has_init = [5, 1, 0, 17], [3, 1, 6, 5], [True, False, True, True]
    tokens = make_tokens(sum(lengths), H, K, V, gen)
    pool = make_pool(NUM_SLOTS, H, K, V, gen)
    before = pool.clone()
    scale = 0.37
    o = run_prefill(prefill, tokens, A_log, dt_bias, pool, lengths, slots, has_init, scale=scale)
    start = 0
    for n, slot, init in zip(lengths, slots, has_init, strict=True):
        h0 = before[slot] if init else torch.zeros(H, K, V)
        o_ref, final_ref = naive_sequence(select(tokens, slice(start, start + n)), A_log, dt_bias, h0, scale)
        assert_rel_close(o[start : start + n], o_ref, 1e-5)
        assert_rel_close(pool[slot], final_ref, 1e-5)
        start += n
    for slot in set(range(NUM_SLOTS)) - set(slots):
        assert torch.equal(pool[slot], before[slot])


def test_default_scale_is_inverse_sqrt_head_dim():
    gen = torch.Generator().manual_seed(1)
    A_log, dt_bias = make_params(H, gen)
    tokens = make_tokens(4, H, K, V, gen)
    pool = make_pool(2, H, K, V, gen)
    pool2 = pool.clone()
    o = run_prefill(ref.gated_delta_rule_prefill, tokens, A_log, dt_bias, pool, [4], [1], [True])
    o2 = run_prefill(ref.gated_delta_rule_prefill, tokens, A_log, dt_bias, pool2, [4], [1], [True], scale=K**-0.5)
    assert torch.equal(o, o2)


@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("has_init", [False, True])
def test_chunked_matches_recurrent(length, has_init):
    gen = torch.Generator().manual_seed(length)
    A_log, dt_bias = make_params(H, gen)
    tokens = make_tokens(length, H, K, V, gen)
    pool = make_pool(3, H, K, V, gen)
    pool_chunk = pool.clone()
    o = run_prefill(ref.gated_delta_rule_prefill, tokens, A_log, dt_bias, pool, [length], [2], [has_init])
    o_chunk = run_prefill(
        ref.chunk_gated_delta_rule_prefill, tokens, A_log, dt_bias, pool_chunk, [length], [2], [has_init]
    )
    assert_rel_close(o_chunk, o, 1e-5)
    assert_rel_close(pool_chunk, pool, 1e-5)


def test_chunked_matches_recurrent_mixed_batch():
    gen = torch.Generator().manual_seed(2)
    A_log, dt_bias = make_params(H, gen)
    lengths, slots, has_init = [65, 1, 130, 64, 0], [4, 2, 1, 6, 3], [True, False, True, False, True]
    tokens = make_tokens(sum(lengths), H, K, V, gen)
    pool = make_pool(NUM_SLOTS, H, K, V, gen)
    before = pool.clone()
    pool_chunk = pool.clone()
    o = run_prefill(ref.gated_delta_rule_prefill, tokens, A_log, dt_bias, pool, lengths, slots, has_init)
    o_chunk = run_prefill(
        ref.chunk_gated_delta_rule_prefill, tokens, A_log, dt_bias, pool_chunk, lengths, slots, has_init
    )
    assert_rel_close(o_chunk, o, 1e-5)
    assert_rel_close(pool_chunk, pool, 1e-5)
    assert torch.equal(pool[3], before[3])  # an empty sequence with an initial state keeps it
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[5], before[5])


def test_prefill_then_decode_matches_whole_prefill():
    gen = torch.Generator().manual_seed(3)
    A_log, dt_bias = make_params(H, gen)
    prompt_lens, num_steps = [4, 9, 1], 3
    slots = [5, 2, 3]
    N = len(prompt_lens)
    pool = make_pool(NUM_SLOTS, H, K, V, gen)
    pool_whole = pool.clone()
    before = pool.clone()
    prompts = [make_tokens(n, H, K, V, gen) for n in prompt_lens]
    steps = [make_tokens(N, H, K, V, gen) for _ in range(num_steps)]
    run_prefill(ref.gated_delta_rule_prefill, concat(prompts), A_log, dt_bias, pool, prompt_lens, slots, [False] * N)
    outs = []
    for step in steps:
        outs.append(
            ref.gated_delta_rule_decode(
                *(step[n] for n in "qkvab"), A_log, dt_bias, pool, torch.tensor(slots, dtype=torch.int32)
            )
        )
    whole = [concat([prompts[i]] + [select(s, slice(i, i + 1)) for s in steps]) for i in range(N)]
    whole_lens = [n + num_steps for n in prompt_lens]
    o_whole = run_prefill(
        ref.gated_delta_rule_prefill, concat(whole), A_log, dt_bias, pool_whole, whole_lens, slots, [False] * N
    )
    ends = cu_seqlens_of(whole_lens)[1:].long()
    for s, out in enumerate(outs):
        assert_rel_close(out, o_whole[ends - num_steps + s], 1e-5)
    assert_rel_close(pool, pool_whole, 1e-5)
    for slot in set(range(NUM_SLOTS)) - set(slots):
        assert torch.equal(pool[slot], before[slot])


def chain_prefill_of_path(tokens, A_log, dt_bias, pool, slot: int, token_ids: list[int]):
    """Output of the last token and the final state of a prefill of `token_ids` from `pool[slot]` (pool untouched)."""
    scratch = pool[slot : slot + 1].clone()
    o = run_prefill(
        ref.gated_delta_rule_prefill, select(tokens, token_ids), A_log, dt_bias, scratch, [len(token_ids)], [0], [True]
    )
    return o[-1], scratch[0]


@pytest.mark.parametrize("chain", [True, False])
def test_verify_matches_chain_prefill_of_each_path(chain):
    gen = torch.Generator().manual_seed(4)
    A_log, dt_bias = make_params(H, gen)
    N, T_d = 3, 7
    slots = [4, 1, 4]  # two sequences may read the same slot in verify
    parents = random_parents(N, T_d, gen, chain=chain)
    tokens = make_tokens(N * T_d, H, K, V, gen)
    pool = make_pool(NUM_SLOTS, H, K, V, gen)
    before = pool.clone()
    o = ref.gated_delta_rule_verify(
        *(tokens[n] for n in "qkvab"), A_log, dt_bias, pool, torch.tensor(slots, dtype=torch.int32), parents
    )
    assert torch.equal(pool, before)
    for i in range(N):
        for j in range(T_d):
            path = [i * T_d + node for node in ancestry(parents[i], j)]
            o_path, _ = chain_prefill_of_path(tokens, A_log, dt_bias, before, slots[i], path)
            assert_rel_close(o[i * T_d + j], o_path, 1e-5)


def random_acceptance(parents: torch.Tensor, gen: torch.Generator, lengths: list[int] | None = None):
    """A root-first accepted path per sequence (`lengths[i]` nodes deep if given, else a random node's path), padded
    with -1: returns accepted_nodes `[N, T_d]`, num_accepted `[N]`."""
    N, T_d = parents.shape
    accepted = torch.full((N, T_d), -1, dtype=torch.int32)
    num = torch.zeros(N, dtype=torch.int32)
    for i in range(N):
        if lengths is None:
            path = ancestry(parents[i], int(torch.randint(0, T_d, (1,), generator=gen)))
        else:
            candidates = [j for j in range(T_d) if len(ancestry(parents[i], j)) == lengths[i]]
            path = ancestry(parents[i], candidates[0]) if lengths[i] else []
        accepted[i, : len(path)] = torch.tensor(path, dtype=torch.int32)
        num[i] = len(path)
    return accepted, num


def test_commit_matches_prefill_of_accepted():
    gen = torch.Generator().manual_seed(5)
    A_log, dt_bias = make_params(H, gen)
    N, T_d = 4, 6
    slots = [2, 6, 3, 1]
    parents = random_parents(N, T_d, gen)
    accepted, num = random_acceptance(parents, gen)
    num[3] = 0  # nothing accepted: the slot must not change
    tokens = make_tokens(N * T_d, H, K, V, gen)
    pool = make_pool(NUM_SLOTS, H, K, V, gen)
    before = pool.clone()
    ref.gated_delta_rule_commit(
        *(tokens[n] for n in "kvab"), A_log, dt_bias, pool, torch.tensor(slots, dtype=torch.int32), accepted, num
    )
    for i in range(N - 1):
        path = [i * T_d + int(node) for node in accepted[i, : num[i]]]
        _, final = chain_prefill_of_path(tokens, A_log, dt_bias, before, slots[i], path)
        assert_rel_close(pool[slots[i]], final, 1e-5)
    for slot in set(range(NUM_SLOTS)) - set(slots[:3]):
        assert torch.equal(pool[slot], before[slot])


def test_verify_commit_rounds_match_prefill_of_accepted_tokens():
    gen = torch.Generator().manual_seed(6)
    A_log, dt_bias = make_params(H, gen)
    N, T_d = 2, 5
    slots = torch.tensor([3, 1], dtype=torch.int32)
    # accepted path lengths per round; includes a 1 after >= 2 and a full-depth chain acceptance
    acceptance = [[3, 1], [1, 2], [2, 5], [1, 1]]
    prompt_lens = [6, 3]
    pool = make_pool(NUM_SLOTS, H, K, V, gen)
    before = pool.clone()
    prompts = [make_tokens(n, H, K, V, gen) for n in prompt_lens]
    run_prefill(ref.gated_delta_rule_prefill, concat(prompts), A_log, dt_bias, pool, prompt_lens, [3, 1], [False] * N)
    history = [[p] for p in prompts]
    accepted_outputs: list[list[torch.Tensor]] = [[], []]
    for round_lengths in acceptance:
        chain = round_lengths == [1, 1]
        parents = random_parents(N, T_d, gen, chain=chain)
        parents[1, 1:] = torch.arange(T_d - 1)  # sequence 1 always has a deep enough chain
        tokens = make_tokens(N * T_d, H, K, V, gen)
        o = ref.gated_delta_rule_verify(*(tokens[n] for n in "qkvab"), A_log, dt_bias, pool, slots, parents)
        lengths = [min(n, max(len(ancestry(parents[i], j)) for j in range(T_d))) for i, n in enumerate(round_lengths)]
        accepted, num = random_acceptance(parents, gen, lengths)
        ref.gated_delta_rule_commit(*(tokens[n] for n in "kvab"), A_log, dt_bias, pool, slots, accepted, num)
        for i in range(N):
            ids = [i * T_d + int(node) for node in accepted[i, : num[i]]]
            history[i].append(select(tokens, ids))
            accepted_outputs[i].append(o[ids])
    whole = [concat(h) for h in history]
    whole_lens = [w["q"].shape[0] for w in whole]
    pool_whole = before.clone()
    o_whole = run_prefill(
        ref.gated_delta_rule_prefill, concat(whole), A_log, dt_bias, pool_whole, whole_lens, [3, 1], [False] * N
    )
    starts = cu_seqlens_of(whole_lens)[:-1].tolist()
    for i in range(N):
        o_seq = o_whole[starts[i] : starts[i] + whole_lens[i]]
        assert_rel_close(torch.cat(accepted_outputs[i]), o_seq[prompt_lens[i] :], 1e-5)
    assert_rel_close(pool, pool_whole, 1e-5)


def test_bad_shapes_raise():
    gen = torch.Generator().manual_seed(7)
    A_log, dt_bias = make_params(H, gen)
    tokens = make_tokens(4, H, K, V, gen)
    pool = make_pool(2, H, K, V, gen)
    slots = torch.tensor([1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="N \\* T_d"):
        ref.gated_delta_rule_verify(
            *(tokens[n] for n in "qkvab"), A_log, dt_bias, pool, slots, random_parents(2, 3, gen)
        )
    with pytest.raises(ValueError, match="fp32"):
        ref.gated_delta_rule_decode(*(tokens[n][:2] for n in "qkvab"), A_log, dt_bias, pool.double(), slots)
    with pytest.raises(ValueError, match="same shape"):
        ref.gated_delta_rule_decode(
            tokens["q"][:2, :, :8], *(tokens[n][:2] for n in "kvab"), A_log, dt_bias, pool, slots
        )


# ---- Triton variants under the interpreter (fp32, small awkward shapes; on a GPU the _gpu tests cover them) ----

needs_interpreter = pytest.mark.skipif(
    not envs.triton_interpret(), reason="Triton variants run here in the interpreter"
)
TK, TV, BLOCK_V = 20, 24, 16  # K pads to 32 in-kernel; V = 1.5 tiles


@needs_interpreter
@pytest.mark.parametrize("chunks", [1, 2, 3])  # 2: one program walks both V tiles; 3: a third tile wholly past V
def test_triton_decode_matches_reference(poisoned_empty, chunks):
    gen = torch.Generator().manual_seed(10)
    A_log, dt_bias = make_params(H, gen)
    # rows 1 and 4 are padding; the slots come as a strided view (the kernel must not read the 2s between them)
    slots = torch.tensor([[3, 2], [0, 2], [5, 2], [1, 2], [0, 2]], dtype=torch.int32)[:, 0]
    tokens = make_tokens(len(slots), H, TK, TV, gen)
    pool = make_pool(NUM_SLOTS, H, TK, TV, gen)
    pool_ref, before = pool.clone(), pool.clone()
    args = [tokens[n] for n in "qkvab"] + [A_log, dt_bias]
    o = decode.gated_delta_rule_decode(*args, pool, slots, block_v=BLOCK_V, chunks=chunks)
    o_ref = ref.gated_delta_rule_decode(*args, pool_ref, slots)
    check_decoded(o, o_ref, pool, pool_ref, before)


def check_decoded(o, o_ref, pool, pool_ref, before) -> None:
    """Rows 0, 2, 3 (slots 3, 5, 1) against the reference; padding rows finite; slots 2, 4, 6 untouched."""
    real = torch.tensor([0, 2, 3])
    assert_rel_close(o[real], o_ref[real], 1e-5)
    assert torch.isfinite(o).all()
    assert_rel_close(pool[[3, 5, 1]], pool_ref[[3, 5, 1]], 1e-5)
    for slot in (2, 4, 6):
        assert torch.equal(pool[slot], before[slot])


@needs_interpreter
@pytest.mark.parametrize(
    "chain,is_chain,N,T_d,block_v,warps",
    [
        (True, True, 3, 6, BLOCK_V, None),  # the chain body: parents not read
        (True, True, 3, 6, 8, 2),  # 8-wide tiles: V in three, several warps a program
        (True, True, 2, 1, None, None),  # the root alone; the launch's own tiles
        (True, False, 3, 6, BLOCK_V, None),  # a chain through the tree body
        (False, False, 3, 6, BLOCK_V, None),
        (False, False, 3, 6, 32, 2),  # one tile past V
        (False, False, 2, 1, None, None),
        (False, False, 2, 7, None, None),
        (True, False, 2, 17, BLOCK_V, 1),  # 32 node rows, 17 deep: the inverse's every row
    ],
)
def test_triton_verify_matches_reference(chain, is_chain, N, T_d, block_v, warps, poisoned_empty):
    gen = torch.Generator().manual_seed(11)
    parents = random_parents(N, T_d, gen, chain=chain)
    check_triton_verify(parents, gen, is_chain=is_chain, block_v=block_v, num_warps=warps)


@needs_interpreter
def test_triton_tree_verify_takes_any_tree_shape(poisoned_empty):
    """Deep and wide trees whose node order is not depth-first (node 10's parent is 1), a root with ten children,
    and gates whose path sums underflow: a raised by 300 makes each g -41 to -75 here, so e^{G} of a node 3 deep is 0 in
    fp32 where the one-step ratios e^{G_j − G_a} are not."""
    gen = torch.Generator().manual_seed(12)
    parents = torch.tensor([[-1, 0, 1, 2, 3, 3, 2, 0, 7, 7, 1], [-1] + [0] * 10], dtype=torch.int32)
    check_triton_verify(parents, gen)
    check_triton_verify(parents, gen, a_shift=300.0)


def check_triton_verify(parents: torch.Tensor, gen: torch.Generator, a_shift: float = 0.0, **options) -> None:
    """The Triton verify against the reference on random tokens (a raised by `a_shift`: faster decay) for trees
    `parents` `[N, T_d]`, slots 4, 1, 4, ...: same outputs, state pool untouched."""
    A_log, dt_bias = make_params(H, gen)
    N, T_d = parents.shape
    slots = torch.tensor([(4, 1)[i % 2] for i in range(N)], dtype=torch.int32)
    tokens = make_tokens(N * T_d, H, TK, TV, gen)
    tokens["a"] = tokens["a"] + a_shift
    pool = make_pool(NUM_SLOTS, H, TK, TV, gen)
    before = pool.clone()
    args = [tokens[n] for n in "qkvab"] + [A_log, dt_bias, pool, slots, parents]
    o = tree.gated_delta_rule_verify(*args, **options)
    assert torch.equal(pool, before)
    assert_rel_close(o, ref.gated_delta_rule_verify(*args), 1e-5)


def test_tree_kernel_tiles_follow_the_measured_picks():
    """The 2B shape (12 heads, V 256) on an H200's 132 SMs: the tiles sessions 26 and 38 measured fastest (tree.py's
    table)."""
    assert {n: tree.chain_tiles(n * 12, 256, 132) for n in (1, 16, 64)} == {1: (8, 1), 16: (32, 1), 64: (32, 1)}
    assert {n: tree.tree_tiles(n * 12, 256, 132) for n in (1, 16, 64)} == {1: (32, 4), 16: (32, 2), 64: (32, 2)}
    assert {n: tree.commit_tiles(n * 12, 256, 132) for n in (1, 16, 64)} == {1: (16, 1), 16: (32, 1), 64: (64, 4)}
    assert tree.chain_tiles(1, 4, 132) == (4, 1)  # never wider than V's power of two
    assert tree.tree_tiles(1, 4, 132) == (16, 4)  # but a tree's tiles are at least tl.dot's 16
    assert tree.commit_tiles(1, 4, 132) == (4, 1)


@needs_interpreter
@pytest.mark.parametrize("block_v,warps", [(BLOCK_V, None), (None, None), (8, 4)])
def test_triton_commit_matches_reference(block_v, warps):
    gen = torch.Generator().manual_seed(12)
    A_log, dt_bias = make_params(H, gen)
    N, T_d = 4, 5
    slots = torch.tensor([2, 6, 3, 1], dtype=torch.int32)
    parents = random_parents(N, T_d, gen)
    accepted, num = random_acceptance(parents, gen)
    num[2] = 0
    tokens = make_tokens(N * T_d, H, TK, TV, gen)
    pool = make_pool(NUM_SLOTS, H, TK, TV, gen)
    pool_ref, before = pool.clone(), pool.clone()
    args = [tokens[n] for n in "kvab"] + [A_log, dt_bias]
    tree.gated_delta_rule_commit(*args, pool, slots, accepted, num, block_v=block_v, num_warps=warps)
    ref.gated_delta_rule_commit(*args, pool_ref, slots, accepted, num)
    assert_rel_close(pool, pool_ref, 1e-5)
    for slot in (0, 3, 4, 5):
        assert torch.equal(pool[slot], before[slot])


@pytest.mark.parametrize("lengths", [[1, 65, 0, 4], [64], [128, 1, 63], [0, 0], []])
def test_chunk_table_matches_fla(lengths):
    """The engine's host-built chunk table is the one fla builds from cu_seqlens (zero-length sequences included)."""
    from fla.ops.utils.index import prepare_chunk_indices

    rows = DeltaRuleChunks.host_rows(np.asarray(lengths, dtype=np.int64))  # [2, NT]
    want = prepare_chunk_indices(cu_seqlens_of(lengths).long(), CHUNK_SIZE)  # [NT, 2]
    assert torch.equal(torch.from_numpy(rows).t(), want)


def strided_tokens(tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values as views with padded rows, as the JetBlock passes them (slices of its fused projection)."""
    out = {}
    for name, x in tokens.items():
        wide = torch.full((x.shape[0], 2 * x[0].numel()), float("nan"), dtype=x.dtype)
        wide[:, : x[0].numel()] = x.reshape(x.shape[0], -1)
        out[name] = wide[:, : x[0].numel()].view(x.shape)
    return out


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 37, 70])
def test_prefill_inputs_match_reference(poisoned_empty, dtype, T):
    """The chunked prefill's inputs in one launch: strided q/k/a/b (the JetBlock's projection slices), K not a power
    of two, a partial last block of tokens; every output written (NaN-poisoned)."""
    gen = torch.Generator().manual_seed(15)
    num_heads, k_dim = 3, 24
    A_log, dt_bias = make_params(num_heads, gen)
    tokens = strided_tokens(make_tokens(T, num_heads, k_dim, 8, gen, dtype))
    args = [tokens[n] for n in "qkab"] + [A_log, dt_bias]
    got = prefill_inputs.prefill_inputs(*args)
    want = ref.prefill_inputs(*args)
    for x, y in zip(got, want, strict=True):
        assert x.dtype == y.dtype and x.is_contiguous()
        assert_rel_close(x.float(), y.float(), 2e-3 if dtype == torch.float16 else 1e-5)


@needs_interpreter
@pytest.mark.parametrize("table", ["built here", "given (host rows)", "given, fresh", "padded to a bucket"])
@pytest.mark.parametrize("layout", ["dense", "strided rows"])
def test_fla_chunk_prefill_matches_reference(poisoned_empty, table, layout):
    """The chunk table built by the op or given as the engine builds it; "fresh": no sequence has an initial state,
    and the table says so (the kernels start from zeros without reading the slots, whose states are random); "padded
    to a bucket": a prefill graph's rows (`ModelRunner.prefill_host_rows`) — an empty row and a padding sequence in
    slot 0, the table padded to ceil(T_b / 64) + N_b rows with chunks past the padding sequence's end."""
    gen = torch.Generator().manual_seed(13)
    num_heads, k_dim, v_dim = 2, 16, 16
    A_log, dt_bias = make_params(num_heads, gen)
    lengths, slots, has_init = [1, 65, 0, 4], [3, 1, 5, 2], [True, False, True, True]
    if table == "given, fresh":
        has_init = [False] * len(lengths)
    if table == "padded to a bucket":
        lengths, slots, has_init = lengths + [0, 9], slots + [0, 0], has_init + [False, False]
    tokens = make_tokens(sum(lengths), num_heads, k_dim, v_dim, gen)
    pool = make_pool(NUM_SLOTS, num_heads, k_dim, v_dim, gen)
    pool_ref, before = pool.clone(), pool.clone()
    kwargs = {}
    if table != "built here":
        rows = DeltaRuleChunks.host_rows(np.asarray(lengths, dtype=np.int64))  # [2, NT]
        if table == "padded to a bucket":  # 5 chunks, padded to 2 + 6
            past = np.stack([np.full(3, len(lengths) - 1), np.arange(1, 4)])
            rows = np.concatenate([rows, past], axis=1)
        fresh = not any(has_init)
        rows = torch.from_numpy(rows)
        kwargs["chunks"] = DeltaRuleChunks(cu_seqlens_of(lengths).long(), rows.t().contiguous(), fresh=fresh)
    inputs = strided_tokens(tokens) if layout == "strided rows" else tokens
    o = run_prefill(chunk.chunk_gated_delta_rule_prefill, inputs, A_log, dt_bias, pool, lengths, slots, has_init,
                    **kwargs)  # fmt: skip
    o_ref = run_prefill(ref.gated_delta_rule_prefill, tokens, A_log, dt_bias, pool_ref, lengths, slots, has_init)
    assert_rel_close(o, o_ref, 1e-5)
    if table == "padded to a bucket":  # two rows write slot 0 (the padding slot) in turn
        pool[0], pool_ref[0] = before[0], before[0]
    assert_rel_close(pool, pool_ref, 1e-5)
    for slot in (0, 4, 6):
        assert torch.equal(pool[slot], before[slot])
    if has_init[2]:
        assert torch.equal(pool[5], before[5])  # empty sequence with an initial state


@needs_interpreter
def test_public_ops_dispatch_to_triton():
    """prefill → decode → verify → commit through the public functions: the triton backend equals the reference."""
    gen = torch.Generator().manual_seed(14)
    num_heads, k_dim, v_dim = 2, 16, 24
    A_log, dt_bias = make_params(num_heads, gen)
    lengths, slots = [3, 5], torch.tensor([2, 1], dtype=torch.int32)
    N, T_d = 2, 3
    prompt = make_tokens(sum(lengths), num_heads, k_dim, v_dim, gen)
    step = make_tokens(N, num_heads, k_dim, v_dim, gen)
    draft = make_tokens(N * T_d, num_heads, k_dim, v_dim, gen)
    parents = random_parents(N, T_d, gen)
    accepted, num = random_acceptance(parents, gen)
    pool0 = make_pool(3, num_heads, k_dim, v_dim, gen)
    results = {}
    for backend in ("reference", "triton"):
        set_backend(backend)
        try:
            pool = pool0.clone()
            outs = [run_prefill(ops.gated_delta_rule_prefill, prompt, A_log, dt_bias, pool, lengths, [2, 1], [0, 1])]
            outs.append(ops.gated_delta_rule_decode(*(step[n] for n in "qkvab"), A_log, dt_bias, pool, slots))
            outs.append(ops.gated_delta_rule_verify(*(draft[n] for n in "qkvab"), A_log, dt_bias, pool, slots, parents))
            ops.gated_delta_rule_commit(*(draft[n] for n in "kvab"), A_log, dt_bias, pool, slots, accepted, num)
            results[backend] = outs + [pool]
        finally:
            set_backend(None)
    for got, want in zip(results["triton"], results["reference"], strict=True):
        assert_rel_close(got, want, 1e-5)


def test_decode_tiles_by_batch():
    """Below 512 (sequence, head) pairs one 32-wide V tile a program; past it two 64-wide tiles a program (the 2B's
    V = 256: two programs a head); a given block_v keeps one tile a program unless chunks is given."""
    assert decode.decode_tiles(12, 256, None) == (32, 1)
    assert decode.decode_tiles(768, 256, None) == (64, 2)
    assert decode.decode_tiles(768, 48, None) == (64, 1)
    assert decode.decode_tiles(768, 256, 16) == (16, 1)
    assert decode.decode_tiles(768, 256, 16, 3) == (16, 3)


@needs_interpreter
@pytest.mark.parametrize("block_v", [16, None])  # 16: a head in two tiles, the second half past V; None: one tile
def test_triton_decode_norm_matches_reference(poisoned_empty, block_v):
    """The JetBlock's output norm in the decode's launch: the same slots, state and normed output as the decode
    reference followed by `gated_rms_norm`, with the gate a strided view (a column slice of the fused projection)."""
    gen = torch.Generator().manual_seed(12)
    A_log, dt_bias = make_params(H, gen)
    slots = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    tokens = make_tokens(len(slots), H, TK, TV, gen)
    pool = make_pool(NUM_SLOTS, H, TK, TV, gen)
    pool_ref, before = pool.clone(), pool.clone()
    projected = torch.randn(len(slots), 5 + H * TV, generator=gen)
    gate = projected[:, 5:].view(len(slots), H, TV)  # [N, H, V], rows strided
    weight = torch.rand(TV, generator=gen) + 0.5
    args = [tokens[n] for n in "qkvab"] + [A_log, dt_bias]
    y = decode.gated_delta_rule_decode(*args, pool, slots, block_v=block_v, norm=(gate, weight, 1e-6))
    y_ref = ref.gated_delta_rule_decode_norm(*args, pool_ref, slots, gate, weight, 1e-6)
    check_decoded(y, y_ref, pool, pool_ref, before)
    # the public op on this backend takes the same path
    pool_again = before.clone()
    y_op = ops.gated_delta_rule_decode_norm(*args, pool_again, slots, gate, weight, 1e-6)
    check_decoded(y_op, y_ref, pool_again, pool_ref, before)


def test_decode_norm_reference_is_decode_then_gated_norm():
    gen = torch.Generator().manual_seed(13)
    A_log, dt_bias = make_params(H, gen)
    slots = torch.tensor([2, 4], dtype=torch.int32)
    tokens = make_tokens(2, H, K, V, gen)
    pool = make_pool(NUM_SLOTS, H, K, V, gen)
    pool_ref = pool.clone()
    gate, weight = torch.randn(2, H, V, generator=gen), torch.rand(V, generator=gen)
    args = [tokens[n] for n in "qkvab"] + [A_log, dt_bias]
    y = ref.gated_delta_rule_decode_norm(*args, pool, slots, gate, weight, 1e-5)
    o = ref.gated_delta_rule_decode(*args, pool_ref, slots)
    torch.testing.assert_close(y, norm_ref.gated_rms_norm(o, weight, gate, 1e-5), rtol=0, atol=0)
    assert torch.equal(pool, pool_ref)
    with pytest.raises(ValueError, match="gate must match"):
        ref.gated_delta_rule_decode_norm(*args, pool, slots, gate[:, :, :4], weight, 1e-5)


def test_decode_takes_norm_by_pairs(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.setattr(ops, "use_triton", lambda t: True)
    assert ops.decode_takes_norm(43, 12, x)  # 516 pairs: the 2B from batch 43
    assert not ops.decode_takes_norm(42, 12, x)
    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    assert not ops.decode_takes_norm(256, 12, x)  # the reference backend keeps the two ops
