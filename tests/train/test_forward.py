import pytest
import torch

from jetserve.model.static_cache import StaticCache
from jetserve.train.forward import causal_lm_loss, forward_hidden


def _inference_hidden(model, rows: torch.Tensor, capture_layers=()):
    """One PREFILL of each row as its own sequence through the inference model (reference ops)."""
    B, T = rows.shape
    cache = StaticCache(model, num_seqs=B, max_tokens=T)
    fb = cache.batch(list(range(B)), rows.tolist())
    fb.capture_layers = capture_layers
    hidden = model(fb)  # [B*T, D]
    return hidden.view(B, T, -1), [a.view(B, T, -1) for a in model.aux_hidden_states]


@pytest.mark.parametrize("T", [1, 23, 70])
def test_training_forward_equals_inference(tiny_model, T):
    gen = torch.Generator().manual_seed(T)
    rows = torch.randint(0, tiny_model.config.vocab_size, (2, T), generator=gen)
    capture = (0, 2, 3)
    with torch.no_grad():
        want, want_aux = _inference_hidden(tiny_model, rows, capture)
        got, got_aux = forward_hidden(tiny_model, rows, capture, gdr_impl="reference")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for g, w in zip(got_aux, want_aux, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    logits_got = tiny_model.compute_logits(got.flatten(0, 1))
    logits_want = tiny_model.compute_logits(want.flatten(0, 1))
    torch.testing.assert_close(logits_got, logits_want, rtol=1e-4, atol=1e-4)


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
