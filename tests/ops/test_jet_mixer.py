"""The fused JetBlock mixer decode (dynamic conv + gated delta rule in one launch) and the fused commit after a VERIFY
step (both states along the accepted path in one launch) against the two reference ops each replaces, in the
interpreter at awkward sizes and on the GPU at the 2B shape; and the dispatch that picks them."""

from __future__ import annotations

import pytest
import torch

from jetserve import envs
from jetserve.ops import jet_mixer
from jetserve.ops.backend import set_backend
from jetserve.ops.jet_mixer import commit, decode
from jetserve.ops.jet_mixer import reference as ref

SENTINEL = 1234.5  # fills slots the op must neither read nor write

needs_interpreter = pytest.mark.skipif(
    not envs.triton_interpret(), reason="Triton variants run here in the interpreter"
)


def make_case(n: int, heads: int, head_k: int, head_v: int, g: int, width: int, num_slots: int, dtype, seed: int):
    """Weights, A_log / dt_bias, and the two pools (conv windows in the model dtype, fp32 states), slot 0 NaN and
    every slot other than 1..n+1 SENTINEL."""
    gen = torch.Generator().manual_seed(seed)
    d = heads * head_v
    w2_weight = (torch.randn(d * width, g, generator=gen) / g**0.5).to(dtype)
    w2_bias = (torch.randn(d * width, generator=gen) * 0.3).to(dtype)
    A_log = torch.log(torch.rand(heads, generator=gen) * 0.5 + 0.02)
    dt_bias = torch.randn(heads, generator=gen) * 0.5
    conv_pool = torch.randn(num_slots, width - 1, d, generator=gen).to(dtype)
    state_pool = torch.randn(num_slots, heads, head_k, head_v, generator=gen) * 0.3
    for pool in (conv_pool, state_pool):
        pool[n + 2 :] = SENTINEL
        pool[0] = float("nan")
    return gen, (w2_weight, w2_bias), (A_log, dt_bias), conv_pool, state_pool


def make_token(gen: torch.Generator, n: int, heads: int, head_k: int, head_v: int, g: int, dtype):
    """u [N, H*V], h [N, G], q, k [N, H, K] as strided views of one projection row (as the model hands them over),
    a, b [N, H]."""
    d = heads * head_v
    row = torch.randn(n, d + g + 2 * heads * head_k + 2 * heads, generator=gen).to(dtype)
    u, h, q, k, a, b = row.split([d, g, heads * head_k, heads * head_k, heads, heads], dim=-1)
    return u, h, q.view(n, heads, head_k), k.view(n, heads, head_k), a, b


@needs_interpreter
@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize(
    ("width", "dtype", "block_sizes"),
    [(4, torch.float32, None), (3, torch.float32, None), (2, torch.float32, (32, 8, 32)), (4, torch.float16, None)],
)
def test_triton_fused_decode_matches_the_two_reference_ops(width: int, dtype: torch.dtype, block_sizes) -> None:
    """3 heads, K 20 (a 32 tile), V 6 (two tiles of 4, the second half masked), G 20 (two steps of 16), three
    sequences, one a padded row on slot 0, the slots a strided view; three steps, the state carried between them."""
    n, heads, head_k, head_v, g, num_slots = 3, 3, 20, 6, 20, 9
    gen, w2, gate_params, conv_pool, state_pool = make_case(n, heads, head_k, head_v, g, width, num_slots, dtype, width)
    slots = torch.tensor([[2, 7], [0, 7], [4, 7]], dtype=torch.int32)[:, 0]  # row 1 is padding
    real, live = torch.tensor([0, 2]), [2, 4]
    conv_pool[0], state_pool[0] = 0.25, 0.25  # padded rows read slot 0: finite, so their ignored outputs are finite
    conv_ref, state_ref = conv_pool.clone(), state_pool.clone()
    conv_before, state_before = conv_pool.clone(), state_pool.clone()
    tol = 2e-5 if dtype == torch.float32 else 3e-3
    for _ in range(3):
        u, h, q, k, a, b = make_token(gen, n, heads, head_k, head_v, g, dtype)
        want = ref.jet_mixer_decode(u, h, *w2, conv_ref, q, k, a, b, *gate_params, state_ref, slots)
        got = decode.jet_mixer_decode(
            u, h, *w2, conv_pool, q, k, a, b, *gate_params, state_pool, slots, block_sizes=block_sizes
        )
        assert got.dtype == dtype and got.shape == (n, heads, head_v)
        assert torch.isfinite(got[real]).all()
        torch.testing.assert_close(got[real].float(), want[real].float(), rtol=tol, atol=tol)
    assert torch.equal(conv_pool[live], conv_ref[live])  # the windows hold copies of inputs
    torch.testing.assert_close(state_pool[live], state_ref[live], rtol=tol, atol=tol)
    dead = list(range(n + 2, num_slots)) + [1, 3]
    assert torch.equal(conv_pool[dead], conv_before[dead]) and torch.equal(state_pool[dead], state_before[dead])


def make_commit(n: int, num_nodes: int, heads: int, head_k: int, head_v: int, width: int, num_slots: int, dtype,
                seed: int):  # fmt: skip
    """A VERIFY step's saved inputs for a commit, as the JetBlock keeps them: u [T, H*V] and k [T, H, K], a, b [T, H]
    strided views of one projection row; v [T, H, V] (the conv's output) its own tensor. Plus the pools of
    `make_case` and, per sequence, a root-first accepted path of a random tree (lengths 0 .. num_nodes)."""
    gen, _, gate_params, conv_pool, state_pool = make_case(n, heads, head_k, head_v, 4, width, num_slots, dtype, seed)
    t, d = n * num_nodes, heads * head_v
    row = torch.randn(t, d + heads * head_k + 2 * heads + 3, generator=gen).to(dtype)
    u, k, a, b, _ = row.split([d, heads * head_k, heads, heads, 3], dim=-1)
    v = torch.randn(t, heads, head_v, generator=gen).to(dtype)
    accepted = torch.full((n, num_nodes), -1, dtype=torch.int32)
    num = torch.zeros(n, dtype=torch.int32)
    for i in range(n):
        parents = [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, num_nodes)]
        node, path = int(torch.randint(0, num_nodes, (1,), generator=gen)), []
        while node >= 0:
            path.append(node)
            node = parents[node]
        accepted[i, : len(path)] = torch.tensor(path[::-1], dtype=torch.int32)
        num[i] = len(path)
    return (u, k.view(t, heads, head_k), v, a, b), gate_params, conv_pool, state_pool, accepted, num


@needs_interpreter
@pytest.mark.parametrize(
    ("width", "num_nodes", "dtype", "block_v"),
    [(4, 5, torch.float32, None), (4, 2, torch.float32, 4), (3, 6, torch.float32, 4), (2, 3, torch.float16, None)],
)
def test_triton_fused_commit_matches_the_two_reference_commits(width, num_nodes, dtype, block_v) -> None:
    """3 heads, K 20, V 6 (a V tile of 4 leaves the second half masked), four sequences: one accepting nothing, one a
    whole path; paths longer and shorter than the window (W - 1 rows), so new windows mix old rows and accepted
    inputs. Slots a strided view; every slot the op must not touch keeps its NaN or sentinel, bit for bit."""
    n, heads, head_k, head_v, num_slots = 4, 3, 20, 6, 9
    (u, k, v, a, b), gate_params, conv_pool, state_pool, accepted, num = make_commit(
        n, num_nodes, heads, head_k, head_v, width, num_slots, dtype, 10 * width + num_nodes
    )
    num[1] = 0
    accepted[1] = -1
    slots = torch.tensor([[3, 0], [5, 0], [1, 0], [4, 0]], dtype=torch.int32)[:, 0]
    conv_ref, state_ref = conv_pool.clone(), state_pool.clone()
    conv_before, state_before = conv_pool.clone(), state_pool.clone()
    commit.jet_mixer_commit(u, conv_pool, k, v, a, b, *gate_params, state_pool, slots, accepted, num, block_v=block_v)
    ref.jet_mixer_commit(u, conv_ref, k, v, a, b, *gate_params, state_ref, slots, accepted, num)
    live = [3, 1, 4]
    assert torch.equal(conv_pool[live], conv_ref[live])  # the windows hold copies of inputs
    assert not torch.equal(conv_pool[live], conv_before[live])
    tol = 2e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(state_pool[live], state_ref[live], rtol=tol, atol=tol)
    untouched = [0, 2, 5, 6, 7, 8]  # slot 5's row accepted nothing
    assert torch.equal(conv_pool[untouched].nan_to_num(7.0), conv_before[untouched].nan_to_num(7.0))
    assert torch.equal(state_pool[untouched].nan_to_num(7.0), state_before[untouched].nan_to_num(7.0))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_commit_dispatch_and_bad_shapes(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """The Triton backend takes the fused commit, the reference backend the two reference commits; u whose channels
    are not the heads' values is refused either way."""
    if backend == "triton" and not envs.triton_interpret():
        pytest.skip("Triton variants run here in the interpreter")
    calls = []
    original = commit.jet_mixer_commit
    monkeypatch.setattr(commit, "jet_mixer_commit", lambda *args, **kw: calls.append(1) or original(*args, **kw))
    (u, k, v, a, b), gate_params, conv_pool, state_pool, accepted, num = make_commit(2, 3, 2, 8, 4, 4, 5,
                                                                                     torch.float32, 1)  # fmt: skip
    slots = torch.tensor([1, 2], dtype=torch.int32)
    conv_ref, state_ref = conv_pool.clone(), state_pool.clone()
    set_backend(backend)
    try:
        jet_mixer.jet_mixer_commit(u, conv_pool, k, v, a, b, *gate_params, state_pool, slots, accepted, num)
        with pytest.raises(ValueError, match="u .* must be \\[T, H\\*V\\]"):
            jet_mixer.jet_mixer_commit(u[:, :6], conv_pool, k, v, a, b, *gate_params, state_pool, slots, accepted, num)
    finally:
        set_backend(None)
    assert bool(calls) == (backend == "triton")
    ref.jet_mixer_commit(u, conv_ref, k, v, a, b, *gate_params, state_ref, slots, accepted, num)
    assert torch.equal(conv_pool.nan_to_num(7.0), conv_ref.nan_to_num(7.0))
    torch.testing.assert_close(state_pool[1:3], state_ref[1:3], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    ("backend", "flag", "rows", "fused"),
    [
        ("triton", None, 1, True),
        ("triton", "1", 1, True),
        ("triton", "1", 2, False),
        ("triton", "0", 1, False),
        ("reference", "1", 1, False),
    ],
)
def test_dispatch_takes_the_fused_kernel_only_when_asked_for_and_small(
    monkeypatch: pytest.MonkeyPatch, backend: str, flag: str | None, rows: int, fused: bool
) -> None:
    """The fused kernel runs for at most FUSED_MAX_ROWS sequences on the Triton backend unless JETSERVE_FUSED_MIXER=0
    (unset: on); otherwise the two public ops run. Either way the result is the reference's."""
    if backend == "triton" and not envs.triton_interpret():
        pytest.skip("Triton variants run here in the interpreter")
    if flag is None:
        monkeypatch.delenv("JETSERVE_FUSED_MIXER", raising=False)
    else:
        monkeypatch.setenv("JETSERVE_FUSED_MIXER", flag)
    calls = []
    original = decode.jet_mixer_decode
    monkeypatch.setattr(decode, "jet_mixer_decode", lambda *args, **kw: calls.append(1) or original(*args, **kw))
    heads, head_k, head_v, g, width = 2, 8, 4, 16, 4
    gen, w2, gate_params, conv_pool, state_pool = make_case(rows, heads, head_k, head_v, g, width, 6, torch.float32, 7)
    slots = torch.arange(1, rows + 1, dtype=torch.int32)
    conv_ref, state_ref = conv_pool.clone(), state_pool.clone()
    u, h, q, k, a, b = make_token(gen, rows, heads, head_k, head_v, g, torch.float32)
    set_backend(backend)
    try:
        got = jet_mixer.jet_mixer_decode(u, h, *w2, conv_pool, q, k, a, b, *gate_params, state_pool, slots)
    finally:
        set_backend(None)
    assert bool(calls) == fused
    want = ref.jet_mixer_decode(u, h, *w2, conv_ref, q, k, a, b, *gate_params, state_ref, slots)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(state_pool[1 : rows + 1], state_ref[1 : rows + 1], rtol=2e-5, atol=2e-5)


def test_bad_flag_and_shapes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETSERVE_FUSED_MIXER", "on")
    with pytest.raises(ValueError, match="JETSERVE_FUSED_MIXER"):
        envs.fused_mixer()
    gen, w2, gate_params, conv_pool, state_pool = make_case(1, 2, 8, 4, 16, 4, 4, torch.float32, 3)
    u, h, q, k, a, b = make_token(gen, 1, 2, 8, 4, 16, torch.float32)
    slots = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="u .* must be"):
        ref.jet_mixer_decode(u[:, :6], h, *w2, conv_pool, q, k, a, b, *gate_params, state_pool, slots)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 3])
def test_gpu_fused_decode_matches_the_unfused_kernels_at_the_2b_shape(rows: int) -> None:
    """bf16, 2B shape (12 heads, K 96, V 256, G 384, W 4): the fused kernel against the conv and gated-delta-rule
    Triton kernels one after the other, over four steps."""
    from jetserve.ops.dynamic_conv import dynamic_conv_decode
    from jetserve.ops.gated_delta_rule import gated_delta_rule_decode

    heads, head_k, head_v, g, width = 12, 96, 256, 384, 4
    gen, w2, gate_params, conv_pool, state_pool = make_case(rows, heads, head_k, head_v, g, width, 8, torch.bfloat16, 5)
    w2, gate_params = [x.cuda() for x in w2], [x.cuda() for x in gate_params]
    conv_pool, state_pool = conv_pool.cuda(), state_pool.cuda()
    conv_ref, state_ref = conv_pool.clone(), state_pool.clone()
    slots = torch.arange(1, rows + 1, dtype=torch.int32, device="cuda")
    for _ in range(4):
        u, h, q, k, a, b = (x.cuda() for x in make_token(gen, rows, heads, head_k, head_v, g, torch.bfloat16))
        v = dynamic_conv_decode(u, h, *w2, conv_ref, slots).view(rows, heads, head_v)
        want = gated_delta_rule_decode(q, k, v, a, b, *gate_params, state_ref, slots)
        got = decode.jet_mixer_decode(u, h, *w2, conv_pool, q, k, a, b, *gate_params, state_pool, slots)
        scale = want.float().abs().max()
        assert torch.isfinite(got).all()
        assert (got.float() - want.float()).abs().max() <= 2e-2 * scale
    assert torch.equal(conv_pool[1 : rows + 1], conv_ref[1 : rows + 1])
    torch.testing.assert_close(state_pool[1 : rows + 1], state_ref[1 : rows + 1], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 16])
def test_gpu_fused_commit_matches_the_two_commit_kernels_at_the_2b_shape(rows: int) -> None:
    """bf16, 2B shape (12 heads, K 96, V 256, W 4), trees of 8 nodes: the fused commit against the conv and
    gated-delta-rule commit kernels one after the other."""
    from jetserve.ops.dynamic_conv import dynamic_conv_commit
    from jetserve.ops.gated_delta_rule import gated_delta_rule_commit

    (u, k, v, a, b), gate_params, conv_pool, state_pool, accepted, num = make_commit(
        rows, 8, 12, 96, 256, 4, rows + 3, torch.bfloat16, 6
    )
    u, k, v, a, b, accepted, num = (x.cuda() for x in (u, k, v, a, b, accepted, num))
    gate_params, conv_pool, state_pool = [x.cuda() for x in gate_params], conv_pool.cuda(), state_pool.cuda()
    conv_ref, state_ref = conv_pool.clone(), state_pool.clone()
    slots = torch.arange(1, rows + 1, dtype=torch.int32, device="cuda")
    commit.jet_mixer_commit(u, conv_pool, k, v, a, b, *gate_params, state_pool, slots, accepted, num)
    dynamic_conv_commit(u, conv_ref, slots, accepted, num)
    gated_delta_rule_commit(k, v, a, b, *gate_params, state_ref, slots, accepted, num)
    assert torch.equal(conv_pool[1 : rows + 1], conv_ref[1 : rows + 1])
    assert torch.equal(state_pool[1 : rows + 1], state_ref[1 : rows + 1])  # the same walk, the same tiles
