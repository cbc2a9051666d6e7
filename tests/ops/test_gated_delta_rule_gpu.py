"""Gated delta rule Triton variants against the reference on CUDA at the real Jet-Nemotron 2B and 4B shapes."""

from __future__ import annotations

import pytest
import torch
from test_gated_delta_rule import (
    assert_rel_close,
    make_params,
    make_tokens,
    random_acceptance,
    random_parents,
    run_prefill,
)

from jetserve.ops.gated_delta_rule import decode, reference, tree

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("poisoned_empty"),  # new outputs start as NaN (tests/ops/conftest.py)
]

SHAPES = {"2b": (12, 96, 256), "4b": (16, 128, 256)}  # H, K, V
DEVICE = "cuda"
# bf16 outputs are compared after rounding both sides to bf16; states stay fp32 in every variant.
OUT_REL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
STATE_REL = {torch.bfloat16: 1e-4, torch.float32: 1e-5}


def setup(shape: str, num_tokens: int, num_slots: int, seed: int, dtype: torch.dtype):
    H, K, V = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    A_log, dt_bias = make_params(H, gen)
    tokens = {n: x.to(DEVICE) for n, x in make_tokens(num_tokens, H, K, V, gen, dtype).items()}
    pool = (torch.randn(num_slots, H, K, V, generator=gen) * 0.1).to(DEVICE)
    return tokens, A_log.to(DEVICE), dt_bias.to(DEVICE), pool


def distinct_slots(n: int, num_slots: int, seed: int) -> torch.Tensor:
    """n distinct slots in 1..num_slots-1, shuffled, int32 on the device."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randperm(num_slots - 1, generator=gen)[:n] + 1).to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", [1, 64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode(shape, batch, dtype):
    num_slots = batch + 8
    tokens, A_log, dt_bias, pool = setup(shape, batch + 2, num_slots, batch, dtype)
    slots = torch.cat([distinct_slots(batch, num_slots, batch), torch.zeros(2, dtype=torch.int32, device=DEVICE)])
    pool_ref, before = pool.clone(), pool.clone()
    args = [tokens[n] for n in "qkvab"] + [A_log, dt_bias]
    o = decode.gated_delta_rule_decode(*args, pool, slots)
    o_ref = reference.gated_delta_rule_decode(*args, pool_ref, slots)
    assert_rel_close(o[:batch], o_ref[:batch], OUT_REL[dtype])
    assert torch.isfinite(o).all()
    touched = slots[:batch].long()
    assert_rel_close(pool[touched], pool_ref[touched], STATE_REL[dtype])
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots.long()] = False
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", [48, 256])
def test_decode_norm(shape, batch):
    """The output norm in the decode's launch (one program a head), bf16, the gate a column slice of a wider
    projection, against the decode reference followed by `gated_rms_norm`."""
    H, K, V = SHAPES[shape]
    num_slots = batch + 8
    tokens, A_log, dt_bias, pool = setup(shape, batch, num_slots, batch + 1, torch.bfloat16)
    slots = distinct_slots(batch, num_slots, batch + 1)
    gen = torch.Generator().manual_seed(batch)
    projected = torch.randn(batch, 40 + H * V, generator=gen).to(torch.bfloat16).to(DEVICE)
    gate = projected[:, 40:].view(batch, H, V)
    weight = (torch.rand(V, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE)
    pool_ref = pool.clone()
    args = [tokens[n] for n in "qkvab"] + [A_log, dt_bias]
    y = decode.gated_delta_rule_decode(*args, pool, slots, norm=(gate, weight, 1e-6))
    y_ref = reference.gated_delta_rule_decode_norm(*args, pool_ref, slots, gate, weight, 1e-6)
    assert_rel_close(y, y_ref, OUT_REL[torch.bfloat16])
    touched = slots.long()
    assert_rel_close(pool[touched], pool_ref[touched], STATE_REL[torch.bfloat16])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "lengths",
    [[1], [63], [64], [65], [1000], [4096], [4096, 1, 700, 65, 0, 129]],
    ids=lambda lengths: "+".join(map(str, lengths)),
)
def test_prefill(shape, lengths):
    from jetserve.ops.gated_delta_rule import chunk

    num_slots = len(lengths) + 3
    tokens, A_log, dt_bias, pool = setup(shape, sum(lengths), num_slots, sum(lengths), torch.bfloat16)
    slots = distinct_slots(len(lengths), num_slots, 0).tolist()
    has_init = [i % 2 == 0 for i in range(len(lengths))]
    pool_ref, before = pool.clone(), pool.clone()
    o = run_prefill(chunk.chunk_gated_delta_rule_prefill, tokens, A_log, dt_bias, pool, lengths, slots, has_init)
    o_ref = run_prefill(reference.gated_delta_rule_prefill, tokens, A_log, dt_bias, pool_ref, lengths, slots, has_init)
    # fla keeps its per-chunk states in bf16 and multiplies in bf16/TF32
    assert_rel_close(o, o_ref, 3e-2)
    assert_rel_close(pool, pool_ref, 1e-2)
    untouched = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("shape", ["2b"])
def test_prefill_fp32_tf32_tolerance(shape):
    from jetserve.ops.gated_delta_rule import chunk

    lengths = [300, 65]
    tokens, A_log, dt_bias, pool = setup(shape, sum(lengths), 4, 5, torch.float32)
    pool_ref = pool.clone()
    args = (tokens, A_log, dt_bias)
    o = run_prefill(chunk.chunk_gated_delta_rule_prefill, *args, pool, lengths, [1, 3], [True, False])
    o_ref = run_prefill(reference.gated_delta_rule_prefill, *args, pool_ref, lengths, [1, 3], [True, False])
    # measured on an H200: 1.7e-3 of the largest output
    assert_rel_close(o, o_ref, 5e-3)
    assert_rel_close(pool, pool_ref, 5e-3)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("nodes,chain", [(7, True), (8, False)], ids=["chain6", "tree8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_verify_and_commit(shape, batch, nodes, chain, dtype):
    num_slots = batch + 4
    tokens, A_log, dt_bias, pool = setup(shape, batch * nodes, num_slots, batch * nodes, dtype)
    gen = torch.Generator().manual_seed(batch)
    parents = random_parents(batch, nodes, gen, chain=chain)
    accepted, num = random_acceptance(parents, gen)
    if batch > 1:
        num[0] = 0  # nothing accepted: the slot must stay as it was
    parents, accepted, num = parents.to(DEVICE), accepted.to(DEVICE), num.to(DEVICE)
    slots = distinct_slots(batch, num_slots, nodes)
    pool_ref, before = pool.clone(), pool.clone()

    o = tree.gated_delta_rule_verify(*(tokens[n] for n in "qkvab"), A_log, dt_bias, pool, slots, parents,
                                     is_chain=chain)  # fmt: skip
    o_ref = reference.gated_delta_rule_verify(*(tokens[n] for n in "qkvab"), A_log, dt_bias, pool, slots, parents)
    torch.cuda.synchronize()
    assert torch.equal(pool, before)
    assert_rel_close(o, o_ref, OUT_REL[dtype])

    args = [tokens[n] for n in "kvab"] + [A_log, dt_bias]
    tree.gated_delta_rule_commit(*args, pool, slots, accepted, num)
    reference.gated_delta_rule_commit(*args, pool_ref, slots, accepted, num)
    assert_rel_close(pool, pool_ref, STATE_REL[dtype])
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots[num > 0].long()] = False
    assert torch.equal(pool[untouched], before[untouched])


def test_decode_verify_commit_replay_in_cuda_graphs():
    """The decode, verify and commit launches have no host sync and capture into CUDA graphs."""
    batch, nodes = 16, 8
    tokens, A_log, dt_bias, pool = setup("2b", batch * nodes, batch + 1, 3, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    parents = random_parents(batch, nodes, gen).to(DEVICE)
    accepted, num = (x.to(DEVICE) for x in random_acceptance(parents.cpu(), gen))
    slots = distinct_slots(batch, batch + 1, 1)
    step = {n: x[:batch] for n, x in tokens.items()}
    pool_ref = pool.clone()

    def run(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o_dec = decode.gated_delta_rule_decode(*(step[n] for n in "qkvab"), A_log, dt_bias, p, slots)
        o_ver = tree.gated_delta_rule_verify(*(tokens[n] for n in "qkvab"), A_log, dt_bias, p, slots, parents)
        tree.gated_delta_rule_commit(*(tokens[n] for n in "kvab"), A_log, dt_bias, p, slots, accepted, num)
        return o_dec, o_ver

    run(pool.clone())  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_dec, o_ver = run(pool)
    pool.copy_(pool_ref)
    graph.replay()
    o_dec_ref, o_ver_ref = run(pool_ref)
    torch.cuda.synchronize()
    assert torch.equal(o_dec, o_dec_ref) and torch.equal(o_ver, o_ver_ref)
    assert torch.equal(pool, pool_ref)
