"""The fused SwiGLU MLP (`jetserve.ops.mlp`): the Triton kernels against the reference composition (gate|up GEMM,
silu_and_mul, down GEMM, then the residual add and RMSNorm) in the interpreter at awkward sizes through both modes
(one-row FMA tiles, tensor-core tiles) and several run layouts, with NaN-poisoned outputs and scratch; the dispatch;
the argument checks; and on a GPU the 2B/4B shapes in bf16, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from jetserve import envs
from jetserve.ops import mlp
from jetserve.ops.backend import set_backend
from jetserve.ops.mlp import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
EPS = 1e-6


@pytest.fixture
def kernels(poisoned_empty):
    """The Triton module, with every new floating-point tensor (outputs, partials, sums of squares) NaN-filled."""
    if DEVICE == "cpu" and not envs.triton_interpret():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from jetserve.ops.mlp import kernels as module

    return module


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def make_case(num_rows: int, hidden: int, inter: int, dtype: torch.dtype, seed: int, pad_rows: int = 3):
    """x (row stride hidden + 5: a view, as the model's normed input can be), the fused [gate; up; zero padding]
    weight, the down weight, and add_norm's (residual with a row stride of its own, norm weight, eps)."""
    x = randn(num_rows, hidden + 5, dtype=dtype, seed=seed)[:, 2 : hidden + 2]
    gate_up = randn(2 * inter + pad_rows, hidden, dtype=dtype, seed=seed + 1, scale=hidden**-0.5)
    gate_up[2 * inter :] = 0
    down = randn(hidden, inter, dtype=dtype, seed=seed + 2, scale=inter**-0.5)
    residual = randn(num_rows, hidden + 3, dtype=dtype, seed=seed + 3, scale=2.0)[:, 1 : hidden + 1]
    return x, gate_up, down, (residual, randn(hidden, dtype=dtype, seed=seed + 4), EPS)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape and torch.isfinite(got).all()
    tol = TOLERANCE[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


TILINGS = [
    None,  # the heuristic's pick for the rows
    dict(programs_per_sm=1, block_k=16, block_n=16, use_dot=False, num_warps=4, num_stages=1, align=1),
    dict(programs_per_sm=3, block_k=32, block_n=32, use_dot=False, num_warps=2, num_stages=1, align=8),
    dict(programs_per_sm=1, block_k=16, block_n=16, use_dot=True, align=16),
    dict(programs_per_sm=2, block_k=32, block_n=64, use_dot=True, align=8, sum_block_n=16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tiling", range(len(TILINGS)))
@pytest.mark.parametrize(("num_rows", "hidden", "inter"), [(1, 40, 100), (1, 64, 48), (3, 37, 70), (16, 48, 33)])
def test_triton_mlp_matches_the_reference(kernels, dtype, tiling, num_rows, hidden, inter) -> None:
    """Hidden sizes a K step does (64) and does not (37, 40, 48) divide; intermediate sizes whose runs are cut short
    (100 over 4 × 2 programs of 16-channel units, 33 over 3 units); 16 rows, a full tensor-core tile."""
    spec = TILINGS[tiling]
    if spec is not None and num_rows > 1 and not spec["use_dot"]:
        spec = {**spec, "use_dot": True, "num_stages": 2}  # several rows: tensor-core tiles
    t = kernels.MlpTiling(**spec) if spec else None
    x, gate_up, down, add = make_case(num_rows, hidden, inter, dtype, seed=tiling)
    assert_close(kernels.swiglu_mlp(x, gate_up, down, tiling=t), ref.swiglu_mlp(x, gate_up, down))
    want = ref.swiglu_mlp(x, gate_up, down, add_norm=add)
    for _ in range(2):  # again: the ticket counter is back to 0 after a launch
        got = kernels.swiglu_mlp(x, gate_up, down, tiling=t, add_norm=add)
        for a, b in zip(got, want, strict=True):
            assert_close(a, b)
    assert int(kernels.ticket_counter(x.device)) == 0


@pytest.mark.parametrize("num_rows", [1, 3])
def test_a_transposed_down_weight_gives_the_same_values(kernels, num_rows) -> None:
    """The down weight stored [I, D] (viewed as [D, I]: unit stride along D) is read as it lies."""
    x, gate_up, down, add = make_case(num_rows, 40, 70, torch.float32, seed=11)
    down_t = down.t().contiguous().t()
    assert down_t.stride() == (1, 40)
    want = ref.swiglu_mlp(x, gate_up, down, add_norm=add)
    for a, b in zip(kernels.swiglu_mlp(x, gate_up, down_t, add_norm=add), want, strict=True):
        assert_close(a, b)


def test_rows_past_one_launch_run_as_several(kernels) -> None:
    """MAX_BLOCK_M + 3 rows with leading dims: two launches, the second of 3 rows."""
    x, gate_up, down, (residual, norm_weight, eps) = make_case(kernels.MAX_BLOCK_M + 3, 24, 40, torch.float32, 7)
    x3, r3 = x.reshape(1, -1, 24), residual.reshape(1, -1, 24)
    got = kernels.swiglu_mlp(x3, gate_up, down, add_norm=(r3, norm_weight, eps))
    want = ref.swiglu_mlp(x3, gate_up, down, add_norm=(r3, norm_weight, eps))
    for a, b in zip(got, want, strict=True):
        assert a.shape == (1, kernels.MAX_BLOCK_M + 3, 24)
        assert_close(a, b)


def test_runs_cover_the_channels_once_each(kernels) -> None:
    """The launch plan: every program a run, runs differing by at most one unit, the tile holding the longest."""
    t = kernels.MlpTiling(programs_per_sm=2, block_k=64, block_n=64, use_dot=False, align=16)
    for inter, num_sms in [(8960, 132), (11008, 132), (33, 4), (100, 4), (16, 64)]:
        plan = kernels.plan_launch(t, inter, num_sms)
        units = -(-inter // 16)
        bounds = [min(inter, (p * units // plan.programs) * 16) for p in range(plan.programs + 1)]
        runs = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        assert plan.programs <= min(units, 2 * num_sms) and bounds[0] == 0 and bounds[-1] == inter
        assert min(runs) > 0 and max(runs) - min(runs) <= 16 and max(runs) <= plan.block_i


def test_fused_mlp_dispatch(monkeypatch) -> None:
    """The public op takes the kernels for 1..FUSED_MAX_ROWS rows on the Triton backend with the flag on, and the two
    GEMMs otherwise (more rows, JETSERVE_FUSED_MLP=0, the reference backend, autograd) — the same values each way."""
    if not envs.triton_interpret():
        pytest.skip("the Triton backend runs here in the interpreter")
    from jetserve.ops.mlp import kernels as module

    calls = []
    original = module.swiglu_mlp
    monkeypatch.setattr(module, "swiglu_mlp", lambda *a, **k: calls.append(a[0].shape[0]) or original(*a, **k))
    try:
        set_backend("triton")
        for num_rows, flag, expect in [(1, "1", [1]), (mlp.FUSED_MAX_ROWS, "1", [mlp.FUSED_MAX_ROWS]),
                                       (mlp.FUSED_MAX_ROWS + 1, "1", []), (2, "0", [])]:  # fmt: skip
            monkeypatch.setenv("JETSERVE_FUSED_MLP", flag)
            calls.clear()
            x, gate_up, down, add = make_case(num_rows, 24, 40, torch.float32, num_rows)
            got = mlp.swiglu_mlp(x, gate_up, down, add_norm=add)
            assert calls == expect
            for a, b in zip(got, ref.swiglu_mlp(x, gate_up, down, add_norm=add), strict=True):
                assert_close(a, b)
        monkeypatch.setenv("JETSERVE_FUSED_MLP", "1")
        calls.clear()
        x, gate_up, down, _ = make_case(2, 24, 40, torch.float32, 9)
        gate_up.requires_grad_(True)
        mlp.swiglu_mlp(x, gate_up, down)  # autograd needs the product: the GEMMs, not the kernels (no backward)
        assert calls == []
        set_backend("reference")
        mlp.swiglu_mlp(x, gate_up.detach(), down)
        assert calls == []
    finally:
        set_backend(None)


def test_fused_mlp_flag_is_checked(monkeypatch) -> None:
    monkeypatch.setenv("JETSERVE_FUSED_MLP", "yes")
    with pytest.raises(ValueError, match="JETSERVE_FUSED_MLP"):
        envs.fused_mlp()


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((2, 8), (20, 8), (8, 10)), None),  # fits: 2I = 20 rows
        (((2, 8), (19, 8), (8, 10)), "gate_up_weight"),  # fewer than 2I rows
        (((2, 8), (20, 7), (8, 10)), "gate_up_weight"),  # hidden differs
        (((2, 8), (20, 8), (9, 10)), "down_weight"),
        (((2, 8), (20, 8), (8,)), "down_weight"),
    ],
)
def test_bad_shapes_are_refused(shapes, match) -> None:
    x, gate_up, down = (torch.zeros(s) for s in shapes)
    if match is None:
        ref.check_swiglu_mlp(x, gate_up, down)
        return
    with pytest.raises(ValueError, match=match):
        mlp.swiglu_mlp(x, gate_up, down)


def test_a_dtype_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        mlp.swiglu_mlp(torch.zeros(1, 8), torch.zeros(20, 8, dtype=torch.float16), torch.zeros(8, 10))


# --- GPU: the real shapes in bf16 ------------------------------------------------------------------------------------

SHAPES = {"2b": (1536, 8960), "4b": (2048, 11008)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["2b", "4b"])
@pytest.mark.parametrize("num_rows", [1, 2, 7, 8, 16])
def test_gpu_mlp_at_the_model_shapes(kernels, model, num_rows) -> None:
    """bf16 against the reference composition on the same bf16 inputs, eagerly and replayed from a CUDA graph (the
    partial buffer comes from the graph's pool and the ticket counter is reused by every replay)."""
    hidden, inter = SHAPES[model]
    x, gate_up, down, add = make_case(num_rows, hidden, inter, torch.bfloat16, seed=num_rows, pad_rows=0)
    want = ref.swiglu_mlp(x, gate_up, down, add_norm=add)
    got = kernels.swiglu_mlp(x, gate_up, down, add_norm=add)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.swiglu_mlp(x, gate_up, down, add_norm=add)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernels.swiglu_mlp(x, gate_up, down, add_norm=add)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, got, strict=True):
        assert torch.equal(a, b)  # deterministic: the same sums in the same order
