import pytest
import torch

from jetserve.model.static_cache import StaticCache
from jetserve.train.forward import causal_lm_loss, chunk_gated_delta_rule_rows, forward_hidden


def _inference_hidden(model, rows: torch.Tensor, capture_layers=()):
    """One PREFILL of each row as its own sequence through the inference model (reference ops)."""
    B, T = rows.shape
    cache = StaticCache(model, num_seqs=B, max_tokens=T)
    fb = cache.batch(list(range(B)), rows.tolist())
    fb.capture_layers = capture_layers
    hidden = model(fb)  # [B*T, D]
    return hidden.view(B, T, -1), [a.view(B, T, -1) for a in model.aux_hidden_states]


@pytest.mark.parametrize("impl", ["reference", "torch"])
@pytest.mark.parametrize("B,T", [(2, 1), (2, 23), (2, 70), (1, 70)])  # one row: the chunk form's output is head-major
def test_training_forward_equals_inference(tiny_model, B, T, impl):
    gen = torch.Generator().manual_seed(T)
    rows = torch.randint(0, tiny_model.config.vocab_size, (B, T), generator=gen)
    capture = (0, 2, 3)
    with torch.no_grad():
        want, want_aux = _inference_hidden(tiny_model, rows, capture)
        got, got_aux = forward_hidden(tiny_model, rows, capture, gdr_impl=impl)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for g, w in zip(got_aux, want_aux, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    logits_got = tiny_model.compute_logits(got.flatten(0, 1))
    logits_want = tiny_model.compute_logits(want.flatten(0, 1))
    torch.testing.assert_close(logits_got, logits_want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["reference", "torch"])
def test_training_forward_runs_under_bf16_autocast(tiny_model, impl):
    """What the trainers do on CUDA (bf16 autocast over fp32 parameters), here on the CPU's autocast: the forward
    runs (the model's `Linear` layers take autocast's bf16 activations beside fp32 weights), gives gradients, and
    stays within bf16 rounding of the fp32 forward. Session 39 found both GPU trainers failing on it at step 1."""
    tiny_model.requires_grad_(True)
    rows = torch.randint(0, tiny_model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, _ = forward_hidden(tiny_model, rows, gdr_impl=impl)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = forward_hidden(tiny_model, rows, gdr_impl=impl)
        loss = causal_lm_loss(tiny_model, rows[:, :-1], rows[:, 1:], gdr_impl=impl)
    assert torch.isfinite(got).all()
    assert (got.float() - want).abs().max() <= 0.1 * want.abs().max()
    loss.backward()
    assert tiny_model.model.layers[0].self_attn.o_proj.weight.grad is not None


def test_training_forward_has_gradients_for_every_parameter(tiny_model):
    tiny_model.requires_grad_(True)
    rows = torch.randint(0, tiny_model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    loss = causal_lm_loss(tiny_model, rows[:, :-1], rows[:, 1:], gdr_impl="reference")
    loss.backward()
    missing = [n for n, p in tiny_model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing
    assert all(float(p.grad.abs().sum()) > 0 for p in tiny_model.parameters())


def test_fla_chunk_path_equals_reference_path(tiny_model):
    """fla-core's chunk kernel (the GPU training path; here under the Triton interpreter) gives the same forward."""
    pytest.importorskip("fla")
    rows = torch.randint(0, tiny_model.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, _ = forward_hidden(tiny_model, rows, gdr_impl="reference")
        got, _ = forward_hidden(tiny_model, rows, gdr_impl="fla")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fla_chunk_path_gradients_equal_reference_path(tiny_train_checkpoint):
    """The backward the GPU training uses (fla's chunk kernel, here under the Triton interpreter) matches autograd
    through the pure-PyTorch chunk reference."""
    pytest.importorskip("fla")
    from jetserve.model.loader import load_model

    rows = torch.randint(0, 320, (1, 70), generator=torch.Generator().manual_seed(5))
    grads = {}
    for impl in ("reference", "fla"):
        model = load_model(tiny_train_checkpoint, dtype="float32").requires_grad_(True)
        causal_lm_loss(model, rows[:, :-1], rows[:, 1:], gdr_impl=impl).backward()
        grads[impl] = {name: p.grad for name, p in model.named_parameters()}
    for name, want in grads["reference"].items():
        torch.testing.assert_close(grads["fla"][name], want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


@pytest.mark.parametrize("T,chunk", [(1, 64), (37, 16), (64, 16), (75, 32)])
def test_rows_chunk_form_equals_recurrent_reference_with_gradients(T, chunk):
    """The batched chunk form == the per-token recurrence (jetserve.ops' reference), values and every input's
    gradient, on awkward lengths (padding inside the last chunk) and strong decays."""
    B, H, K, V = 3, 2, 8, 5
    gen = torch.Generator().manual_seed(T)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    a, b = (torch.randn(B, T, H, generator=gen, dtype=torch.float64) * 2 for _ in range(2))
    A_log = torch.randn(H, generator=gen, dtype=torch.float64)
    dt_bias = torch.randn(H, generator=gen, dtype=torch.float64)
    leaves = [x.requires_grad_(True) for x in (q, k, v, a, b)]

    def inputs():
        g = -torch.exp(A_log) * torch.nn.functional.softplus(a + dt_bias)
        qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K**-0.5
        kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        return qn, kn, v, g, torch.sigmoid(b)

    got = chunk_gated_delta_rule_rows(*inputs(), chunk=chunk)
    qn, kn, vv, g, beta = inputs()
    S = torch.zeros(B, H, K, V, dtype=torch.float64)
    outs = []
    for t in range(T):  # S <- e^g S; e = β(v - Sᵀk); S <- S + k eᵀ; o = Sᵀq
        S = g[:, t, :, None, None].exp() * S
        e = beta[:, t, :, None] * (vv[:, t] - torch.einsum("bhkv,bhk->bhv", S, kn[:, t]))
        S = S + kn[:, t, :, :, None] * e[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, qn[:, t]))
    want = torch.stack(outs, 1)  # [B, T, H, V]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    weights = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    grads_got = torch.autograd.grad((got * weights).sum(), leaves)
    grads_want = torch.autograd.grad((want * weights).sum(), leaves)
    for gg, gw in zip(grads_got, grads_want, strict=True):
        torch.testing.assert_close(gg, gw, rtol=1e-8, atol=1e-9)
