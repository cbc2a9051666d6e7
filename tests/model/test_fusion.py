"""Fused input projections (`jetserve.model.fusion`): the loaders' fused models compute what unfused ones do in every
phase (reference ops and Triton in the interpreter), keep their names and state_dict, fuse idempotently, stay correct
when parameters are replaced after fusion, and let autograd reach every weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_helpers import random_tokens
from safetensors.torch import load_file

from jetserve import envs
from jetserve.checkpoint import make_checkpoint
from jetserve.config import ModelConfig
from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine
from jetserve.model.fusion import OUTPUT_ROW_ALIGN, InputProjections, fuse_projections
from jetserve.model.jet_nemotron import JetNemotronForCausalLM, cast_model
from jetserve.model.loader import load_model
from jetserve.model.static_cache import StaticCache
from jetserve.ops.backend import set_backend
from jetserve.spec.eagle3 import load_draft_model, make_draft_checkpoint

TREE_PARENTS = [-1, 0, 0, 1, 2, 1]
ACCEPTED = ([0, 1, 3], [0, 2])  # per sequence: the accepted path of the tree, root first


def unfused_model(checkpoint) -> JetNemotronForCausalLM:
    """The checkpoint in a model built directly (no loader, so never fused): every parameter its own tensor."""
    model = JetNemotronForCausalLM(ModelConfig.from_hf(checkpoint))
    model.load_state_dict(load_file(str(checkpoint / "model.safetensors")), strict=True)
    return model.eval().requires_grad_(False)


def groups(model) -> list[InputProjections]:
    return [m for m in model.modules() if isinstance(m, InputProjections)]


def is_fused(model) -> bool:
    return all(m.fused_input is not None and m.fused_input.is_current(m.input_projections()) for m in groups(model))


def run_phases(model) -> list[torch.Tensor]:
    """Logits of a batched prefill (two prompts, one past the SWA window), three decode steps, a tree VERIFY, and the
    decode after committing part of the tree."""
    cache = StaticCache(model, 2, 64, page_size=8)
    out = []
    with torch.inference_mode():
        out.append(model.compute_logits(model(cache.batch([0, 1], [random_tokens(19, 0), random_tokens(6, 1)]))))
        for step in range(3):
            out.append(model.compute_logits(model(cache.batch([0, 1], [[3 + step], [40 + step]]))))
        tokens = torch.tensor([random_tokens(len(TREE_PARENTS), 2), random_tokens(len(TREE_PARENTS), 3)])
        fb = cache.verify_batch([0, 1], tokens, torch.tensor([TREE_PARENTS] * 2))
        out.append(model.compute_logits(model(fb)))
        accepted = torch.full((2, len(TREE_PARENTS)), -1, dtype=torch.int32)
        for i, path in enumerate(ACCEPTED):
            accepted[i, : len(path)] = torch.tensor(path, dtype=torch.int32)
        num_accepted = torch.tensor([len(p) for p in ACCEPTED], dtype=torch.int32)
        model.commit_verified(fb, accepted, num_accepted)
        cache.commit([0, 1], num_accepted.tolist())
        out.append(model.compute_logits(model(cache.batch([0, 1], [[7], [9]]))))
    return out


def assert_same_logits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, s=step: f"step {s}: {m}")


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    """The tiny model with other weights (seed 1)."""
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny_other"), seed=1)


@pytest.fixture
def backend(request):
    set_backend(request.param)
    yield request.param
    set_backend(None)


def test_loaded_model_is_fused_with_unchanged_names(tiny_checkpoint):
    fused, unfused = load_model(tiny_checkpoint, dtype="float32"), unfused_model(tiny_checkpoint)
    assert is_fused(fused) and not any(m.fused_input for m in groups(unfused))
    assert len(groups(fused)) == 2 * fused.config.num_hidden_layers  # each layer's mixer and MLP
    assert list(fused.state_dict()) == list(unfused.state_dict())
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in unfused.named_parameters()]
    for (name, a), b in zip(fused.state_dict().items(), unfused.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for module in groups(fused):
        weight, bias = module.fused_input.weight, module.fused_input.bias
        assert weight.is_contiguous() and (bias is None) == (module.input_projections()[0].bias is None)
        start = 0
        for linear in module.input_projections():  # each parameter is its rows of the one tensor, not a copy
            rows = slice(start, start + linear.out_features)
            assert linear.weight.data_ptr() == weight[rows].data_ptr() and linear.weight.shape == weight[rows].shape
            if bias is not None:
                assert linear.bias.data_ptr() == bias[rows].data_ptr()
            start = rows.stop
        assert start == module.fused_input.width and weight.shape[0] % OUTPUT_ROW_ALIGN == 0
        assert weight.shape[0] - start < OUTPUT_ROW_ALIGN and not weight[start:].any()  # zero padding rows
        if bias is not None:
            assert not bias[start:].any()
    jet = next(layer.self_attn for layer in fused.model.layers if layer.kind == "jet")
    assert jet.fused_input.width % OUTPUT_ROW_ALIGN != 0  # the tiny JetBlock's 204 columns: padded, so tested
    projected = jet.project(torch.randn(5, fused.config.hidden_size))
    assert projected.shape == (5, jet.fused_input.width) and projected.stride(0) % OUTPUT_ROW_ALIGN == 0
    attention = next(layer.self_attn for layer in fused.model.layers if layer.kind != "jet")
    assert attention.fused_input.bias is not None  # Qwen2 q/k/v biases are fused too


@pytest.mark.parametrize("backend", ["reference", "triton"], indirect=True)
def test_fused_equals_unfused_in_every_phase(tiny_checkpoint, backend):
    if backend == "triton" and not envs.triton_interpret():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    fused, unfused = load_model(tiny_checkpoint, dtype="float32"), unfused_model(tiny_checkpoint)
    assert_same_logits(run_phases(fused), run_phases(unfused))


def test_triton_model_equals_reference_model(tiny_checkpoint):
    """The fused model on the Triton kernels (skinny GEMMs with the JetBlock's SiLU in their epilogue and the MLP's
    SwiGLU in the down projection's prologue, and every other op) against the reference ops, in every phase."""
    if not envs.triton_interpret():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    model = load_model(tiny_checkpoint, dtype="float32")
    try:
        set_backend("reference")
        want = run_phases(model)
        set_backend("triton")
        got = run_phases(model)
    finally:
        set_backend(None)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


def test_fused_mixer_decode_in_the_model_equals_the_reference_model(tiny_checkpoint, monkeypatch):
    """The fused mixer (on by default): a lone sequence's decode steps run each JetBlock's conv and gated delta rule
    as one Triton launch (counted), and the logits equal the reference ops'."""
    if not envs.triton_interpret():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    from jetserve.ops.jet_mixer import decode as fused

    monkeypatch.setenv("JETSERVE_FUSED_MIXER", "1")
    calls = []
    original = fused.jet_mixer_decode
    monkeypatch.setattr(fused, "jet_mixer_decode", lambda *args, **kw: calls.append(1) or original(*args, **kw))
    model = load_model(tiny_checkpoint, dtype="float32")

    def run() -> list[torch.Tensor]:
        cache = StaticCache(model, 1, 64, page_size=8)
        with torch.inference_mode():
            out = [model.compute_logits(model(cache.batch([0], [random_tokens(11, 4)])))]
            out += [model.compute_logits(model(cache.batch([0], [[5 + step]]))) for step in range(3)]
        return out

    try:
        set_backend("reference")
        want = run()
        set_backend("triton")
        got = run()
    finally:
        set_backend(None)
    jet_layers = sum(layer.kind == "jet" for layer in model.model.layers)
    assert jet_layers > 0 and len(calls) == 3 * jet_layers
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


def test_output_norm_in_the_decode_launch_equals_the_reference_model(tiny_checkpoint, monkeypatch, decode_norm_calls):
    """Past GEMV_MAX_ROWS rows and from NORM_MIN_PAIRS (sequence, head) pairs on the Triton backend a JetBlock's
    decode runs its output norm in the gated delta rule's launch and o_proj as a plain GEMM (both thresholds lowered
    here so the tiny model's decode takes the path; the launches counted); the logits equal the reference ops'."""
    if not envs.triton_interpret():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    from jetserve.model import jet_block
    from jetserve.ops import gated_delta_rule

    monkeypatch.setattr(jet_block, "GEMV_MAX_ROWS", 1)
    monkeypatch.setattr(gated_delta_rule, "NORM_MIN_PAIRS", 1)
    model = load_model(tiny_checkpoint, dtype="float32")

    def run() -> list[torch.Tensor]:
        cache = StaticCache(model, 3, 64, page_size=8)
        with torch.inference_mode():
            prompts = [random_tokens(7, 1), random_tokens(5, 2), random_tokens(9, 3)]
            out = [model.compute_logits(model(cache.batch([0, 1, 2], prompts)))]
            out += [model.compute_logits(model(cache.batch([0, 1, 2], [[5 + step]] * 3))) for step in range(2)]
            out += [model.compute_logits(model(cache.batch([1], [[9]])))]  # one row: the fused mixer as before
        return out

    try:
        set_backend("reference")
        want = run()
        assert not decode_norm_calls
        set_backend("triton")
        got = run()
    finally:
        set_backend(None)
    jet_layers = sum(layer.kind == "jet" for layer in model.model.layers)
    assert jet_layers > 0 and decode_norm_calls == [True] * (2 * jet_layers)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


@pytest.mark.parametrize(("flag", "narrow"), [("0", "1"), ("1", "0"), ("1", "1")])
def test_add_norm_epilogue_in_the_model_equals_the_reference_model(tiny_checkpoint, monkeypatch, flag, narrow):
    """JETSERVE_ADD_NORM_EPILOGUE=1: every residual add and RMSNorm after layer 0's input norm runs in the epilogue of
    the Triton GEMM that produces its input (o_proj, down) in steps of up to GEMV_MAX_ROWS rows, so the norm op runs
    once in each of them (counted); the batched prefill (25 rows) keeps every norm as an op on cuBLAS
    (JETSERVE_NARROW_GEMM=0) and hands them to the Triton GEMM too with it on (up to NARROW_MAX_ROWS rows; the tiny
    shapes do not split K, so the epilogue takes them). Off, every norm is an op. Either way the logits equal the
    reference ops'."""
    if not envs.triton_interpret():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    from jetserve.ops.norm import kernels as norm_kernels

    monkeypatch.setenv("JETSERVE_ADD_NORM_EPILOGUE", flag)
    monkeypatch.setenv("JETSERVE_NARROW_GEMM", narrow)
    model = load_model(tiny_checkpoint, dtype="float32")
    try:
        set_backend("reference")
        want = run_phases(model)
        set_backend("triton")
        calls = []
        original = norm_kernels.rms_norm
        monkeypatch.setattr(norm_kernels, "rms_norm", lambda *a, **k: calls.append(1) or original(*a, **k))
        got = run_phases(model)
    finally:
        set_backend(None)
    norms = 2 * len(model.model.layers) + 1  # per forward: two per layer and the final norm
    small_steps = len(want) - 1  # three decodes, the verify (12 rows) and the decode after the commit
    prefill_norms = 1 if flag == "1" and narrow == "1" else norms
    assert len(calls) == prefill_norms + small_steps * (1 if flag == "1" else norms)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}")


def test_fusing_twice_changes_nothing(tiny_checkpoint):
    model = load_model(tiny_checkpoint, dtype="float32")
    before = [m.fused_input for m in groups(model)]
    pointers = [p.data_ptr() for p in model.parameters()]
    assert fuse_projections(model) is model
    assert all(m.fused_input is f for m, f in zip(groups(model), before, strict=True))
    assert [p.data_ptr() for p in model.parameters()] == pointers


def test_parameters_replaced_after_fusion_are_never_stale(tiny_checkpoint, other_checkpoint):
    """A replaced parameter (assign-loading, `.data =` on one projection, a cast) leaves the fused copy behind: the next
    forward must notice and compute with the new parameters, and fusing again restores the fused path."""
    other = unfused_model(other_checkpoint)
    want = run_phases(other)

    model = load_model(tiny_checkpoint, dtype="float32")
    model.load_state_dict({n: t.clone() for n, t in other.state_dict().items()}, assign=True)
    assert_same_logits(run_phases(model), want)
    assert not any(m.fused_input for m in groups(model))  # the stale copies were dropped
    fuse_projections(model)
    assert is_fused(model)
    assert_same_logits(run_phases(model), want)

    # One projection of a jet layer and one of an attention layer re-pointed by hand.
    model = load_model(tiny_checkpoint, dtype="float32")
    reference = unfused_model(tiny_checkpoint)
    jet = next(i for i, layer in enumerate(model.model.layers) if layer.kind == "jet")
    attn = next(i for i, layer in enumerate(model.model.layers) if layer.kind != "jet")
    for m in (model, reference):
        w1 = m.model.layers[jet].self_attn.dynamic_conv1d.kernel_generator.w1
        w1.weight.data = other.model.layers[jet].self_attn.dynamic_conv1d.kernel_generator.w1.weight.clone()
        m.model.layers[attn].self_attn.k_proj.bias.data = other.model.layers[attn].self_attn.k_proj.bias.clone()
    assert_same_logits(run_phases(model), run_phases(reference))

    # In-place writes (load_state_dict without assign) land in the fused tensor itself: still fused, still right.
    model = load_model(tiny_checkpoint, dtype="float32")
    model.load_state_dict(other.state_dict())
    assert is_fused(model)
    assert_same_logits(run_phases(model), want)

    model = cast_model(load_model(tiny_checkpoint, dtype="float32"), torch.bfloat16)
    assert_same_logits(run_phases(model), run_phases(load_model(tiny_checkpoint, dtype="bfloat16")))


def test_autograd_reaches_each_weight_of_a_fused_model(tiny_checkpoint):
    """Training a loaded (fused) model: with grad enabled the group runs over the parameters themselves."""
    model = load_model(tiny_checkpoint, dtype="float32").requires_grad_(True)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for module in groups(model):
        linears = module.input_projections()
        module.project(x).square().sum().backward()
        weights = [li.weight.detach().clone().requires_grad_(True) for li in linears]
        separate = torch.cat([F.linear(x, w, li.bias) for w, li in zip(weights, linears, strict=True)], dim=-1)
        grads = torch.autograd.grad(separate.square().sum(), weights)
        for li, grad in zip(linears, grads, strict=True):
            torch.testing.assert_close(li.weight.grad, grad, rtol=1e-5, atol=1e-5)


def test_draft_is_fused_and_equals_unfused(tiny_checkpoint, tmp_path):
    target = load_model(tiny_checkpoint, dtype="float32")
    draft_dir = make_draft_checkpoint(tiny_checkpoint, tmp_path / "draft", seed=1, draft_vocab_size=100)
    draft = load_draft_model(draft_dir, target)
    assert is_fused(draft) and len(groups(draft)) == 2
    unfused = load_draft_model(draft_dir, target)
    for m in groups(unfused):
        m.fused_input = None
    x = torch.randn(6, 2 * draft.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for a, b in zip(groups(draft), groups(unfused), strict=True):
        y = x if a is draft.midlayer.self_attn else x[:, : draft.config.hidden_size]
        torch.testing.assert_close(a.project(y), b.project(y), rtol=1e-6, atol=1e-6)


def test_engine_fuses_the_model_it_is_given(tiny_checkpoint):
    model = unfused_model(tiny_checkpoint)
    config = EngineConfig(
        model=str(tiny_checkpoint), device="cpu", page_size=4, num_pages=64, num_slots=3, max_model_len=128
    )
    engine = LLMEngine(config, model=model, tokenizer=None)
    assert engine.model is model and is_fused(model)
