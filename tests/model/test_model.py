"""Model invariants on the tiny checkpoint (all three layer kinds), reference ops, fp32."""

import torch
from model_helpers import jet_states, random_tokens

from jetserve.model.forward_batch import Phase
from jetserve.model.loader import load_model
from jetserve.model.static_cache import StaticCache


def test_prefill_then_decode_equals_one_prefill(model):
    tokens = random_tokens(40, 1)  # longer than the SWA window (16): the window matters
    whole = StaticCache(model, 1, 64)
    logits_whole = model.compute_logits(model(whole.batch([0], [tokens])))
    states_whole = jet_states(model, 0)

    split = StaticCache(model, 1, 64)
    logits = [model.compute_logits(model(split.batch([0], [tokens[:7]])))]
    for t in tokens[7:]:
        fb = split.batch([0], [[t]])
        assert fb.phase is Phase.DECODE
        logits.append(model.compute_logits(model(fb)))
    torch.testing.assert_close(torch.cat(logits), logits_whole, rtol=1e-4, atol=1e-4)
    for a, b in zip(jet_states(model, 0), states_whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_chunked_prefill_equals_one_prefill(model):
    tokens = random_tokens(37, 2)
    whole = StaticCache(model, 1, 64)
    logits_whole = model.compute_logits(model(whole.batch([0], [tokens])))
    chunked = StaticCache(model, 1, 64)
    pieces = [model.compute_logits(model(chunked.batch([0], [tokens[a:b]]))) for a, b in ((0, 2), (2, 19), (19, 37))]
    torch.testing.assert_close(torch.cat(pieces), logits_whole, rtol=1e-4, atol=1e-4)


def test_packed_batch_equals_each_alone(model):
    prompts = [random_tokens(n, 10 + n) for n in (1, 3, 20, 9)]
    batched = StaticCache(model, len(prompts), 64)
    logits_batched = model.compute_logits(model(batched.batch(list(range(len(prompts))), prompts)))
    decode_batched = model.compute_logits(model(batched.batch([0, 1, 2, 3], [[5], [6], [7], [8]])))
    states_batched = [jet_states(model, i) for i in range(len(prompts))]
    alone_logits, alone_decode = [], []
    for i, p in enumerate(prompts):
        cache = StaticCache(model, 1, 64)
        alone_logits.append(model.compute_logits(model(cache.batch([0], [p]))))
        alone_decode.append(model.compute_logits(model(cache.batch([0], [[5 + i]]))))
        for a, b in zip(jet_states(model, 0), states_batched[i], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits_batched, torch.cat(alone_logits), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode_batched, torch.cat(alone_decode), rtol=1e-4, atol=1e-4)


def test_swa_layer_sees_exactly_window_tokens(model):
    """Changing the token `window` positions back changes nothing at the SWA layer; one step closer does."""
    window = model.config.swa_window_size
    swa = next(layer for layer in model.model.layers if layer.kind == "swa").self_attn
    captured = {}
    hook = swa.register_forward_hook(lambda mod, args, out: captured.__setitem__("out", out))
    try:
        # Feed the SWA layer directly: its input at each position is independent of the others.
        x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        outs = []
        for change in (None, 40 - 1 - window, 40 - window):
            x2 = x.clone()
            if change is not None:
                x2[change] += 1.0
            cache = StaticCache(model, 1, 64)
            outs.append(swa(x2, cache.batch([0], [list(range(40))]))[-1])
    finally:
        hook.remove()
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)  # position 39 - window: outside
    assert (outs[2] - outs[0]).abs().max() > 1e-4  # position 40 - window: the oldest key inside the window


def test_bf16_forward_runs_and_is_finite(tiny_checkpoint):
    model = load_model(tiny_checkpoint, dtype="bfloat16")
    assert model.model.layers[0].self_attn.A_log.dtype == torch.float32
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    cache = StaticCache(model, 1, 32)
    logits = model.compute_logits(model(cache.batch([0], [random_tokens(12, 3)])))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
