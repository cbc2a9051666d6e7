"""Programmatic dependent launch (`jetserve.ops.pdl`): on by default, off with JETSERVE_PDL=0 and never off the GPU;
on an H200 a layer's chain of decode kernels launched with PDL, captured in a CUDA graph and replayed on new inputs,
computes bit for bit what it computes launched plainly (a kernel reading its predecessor's output before that
finished would not)."""

from __future__ import annotations

import pytest
import torch

from jetserve import envs
from jetserve.ops import pdl


def test_pdl_is_on_by_default_off_by_env_and_never_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(2)
    monkeypatch.delenv("JETSERVE_PDL", raising=False)
    assert envs.pdl()
    assert not pdl.uses_pdl(x) and pdl.pdl_launch(x) == {}  # a CPU tensor: the interpreter never sees PDL
    monkeypatch.setenv("JETSERVE_PDL", "0")
    assert not envs.pdl()
    monkeypatch.setenv("JETSERVE_PDL", "yes")
    with pytest.raises(ValueError, match="JETSERVE_PDL"):
        envs.pdl()


def layer_chain(x, p, conv_state, rec_state, slots):
    """The decode kernels of a 2B JetBlock layer in their order, each reading the one before: RMSNorm, the fused
    input GEMM (SiLU epilogue), dynamic conv, gated delta rule, o_proj (gated norm), RMSNorm, gate|up, down (SwiGLU)."""
    from jetserve.ops.dynamic_conv import dynamic_conv_decode
    from jetserve.ops.gated_delta_rule import gated_delta_rule_decode
    from jetserve.ops.linear import gated_norm_linear, linear, swiglu_linear
    from jetserve.ops.norm import rms_norm

    n = x.shape[0]
    h = rms_norm(x, p["norm"], 1e-6)
    proj = linear(h, p["w_in"], silu_cols=2 * 1152 + 384)
    q, k, g, u, a, b, gate = proj.split([1152, 1152, 384, 3072, 12, 12, 3072], dim=-1)
    v = dynamic_conv_decode(u, g, p["w2"], p["b2"], conv_state, slots)
    o = gated_delta_rule_decode(
        q.reshape(n, 12, 96), k.reshape(n, 12, 96), v.view(n, 12, 256), a, b, p["A_log"], p["dt_bias"], rec_state, slots
    )
    y = gated_norm_linear(o.reshape(n, 3072), gate, p["o_norm"], 1e-6, p["w_o"])
    h2, residual = rms_norm(y, p["norm"], 1e-6, x)
    return swiglu_linear(linear(h2, p["w_up"]), p["w_down"]) + residual


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 5, 64])
def test_pdl_chain_in_a_cuda_graph_equals_plain_launches(monkeypatch: pytest.MonkeyPatch, num_rows: int) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    gen = torch.Generator(device="cuda").manual_seed(num_rows)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    p = {"norm": rand(1536), "w_in": rand(8856, 1536, scale=1536**-0.5), "w2": rand(3072 * 4, 384, scale=384**-0.5),
         "b2": rand(3072 * 4, scale=0.3), "o_norm": rand(256), "w_o": rand(1536, 3072, scale=3072**-0.5),
         "w_up": rand(17920, 1536, scale=1536**-0.5), "w_down": rand(1536, 8960, scale=8960**-0.5),
         "A_log": rand(12).float(), "dt_bias": rand(12).float()}  # fmt: skip
    slots = (torch.randperm(80, device="cuda", generator=gen)[:num_rows] + 1).to(torch.int32)
    conv0 = rand(81, 3, 3072)
    rec0 = torch.randn(81, 12, 96, 256, device="cuda", generator=gen) * 0.1
    inputs = [rand(num_rows, 1536) for _ in range(3)]

    monkeypatch.setenv("JETSERVE_PDL", "0")
    conv_want, rec_want, want = conv0.clone(), rec0.clone(), []
    for x in inputs:
        want.append(layer_chain(x, p, conv_want, rec_want, slots))

    monkeypatch.setenv("JETSERVE_PDL", "1")
    assert pdl.uses_pdl(inputs[0])
    conv, rec, x = conv0.clone(), rec0.clone(), inputs[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) on scratch state
        layer_chain(x, p, conv.clone(), rec.clone(), slots)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer_chain(x, p, conv, rec, slots)
    for step, new in enumerate(inputs):
        x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want[step]), f"replay {step}"
    assert torch.equal(conv, conv_want) and torch.equal(rec, rec_want)  # the states the kernels update in place
