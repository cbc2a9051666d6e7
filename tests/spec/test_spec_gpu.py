"""GPU: tree acceptance at the real vocabulary (151936) on the device equals its loop version, greedy and sampled."""

import pytest
import torch

from jetserve.ops.sampling import tree_accept, tree_accept_greedy, tree_accept_loop

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("num_seqs", [1, 16, 64])
def test_tree_accept_on_device_equals_loop(num_seqs):
    device = "cuda"
    gen = torch.Generator(device=device).manual_seed(num_seqs)
    vocab, num_nodes = 151936, 8
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 6], dtype=torch.int32, device=device).expand(num_seqs, -1)
    logits = torch.randn(num_seqs, num_nodes, vocab, device=device, generator=gen) * 3
    # Half of the drafts are the target's argmax at their parent, so paths of every length occur.
    argmax_at_parent = logits.argmax(-1).gather(1, parents.clamp(min=0).long())
    noise = torch.randint(0, vocab, (num_seqs, num_nodes), device=device, generator=gen)
    keep = torch.rand(num_seqs, num_nodes, device=device, generator=gen) < 0.5
    tokens = torch.where(keep, argmax_at_parent, noise)
    params = dict(
        temperature=torch.tensor([0.0, 0.8, 1.0, 1.5], device=device).repeat(num_seqs)[:num_seqs],
        top_k=torch.tensor([0, 50, 0, 1000], dtype=torch.int32, device=device).repeat(num_seqs)[:num_seqs],
        top_p=torch.tensor([1.0, 0.95, 0.9, 1.0], device=device).repeat(num_seqs)[:num_seqs],
        min_p=torch.zeros(num_seqs, device=device),
        seeds=torch.arange(num_seqs, dtype=torch.int64, device=device) * 31,
        counters=torch.full((num_seqs,), 12, dtype=torch.int64, device=device),
    )
    batched = tree_accept(logits, tokens, parents, **params)
    looped = tree_accept_loop(logits, tokens, parents, **params)
    for a, b in zip(batched, looped, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    greedy = tree_accept_greedy(logits, tokens, parents)
    is_greedy = (params["temperature"] == 0).cpu()
    assert torch.equal(batched[1].cpu()[is_greedy], greedy[1].cpu()[is_greedy])
    assert bool((batched[1] >= 1).all()) and torch.isin(batched[1].cpu(), torch.arange(1, 6)).all()  # depth ≤ 4
