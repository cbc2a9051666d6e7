"""Unbatched prefill-then-decode generation over one StaticCache (the engine batches; this is the simple path)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from jetserve.model.jet_nemotron import JetNemotronForCausalLM
from jetserve.model.static_cache import StaticCache
from jetserve.ops.sampling import sample


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    num_prompt_tokens: int
    seconds: float
    finish_reason: str  # "stop" (an end-of-sequence token) or "length"


@torch.no_grad()
def generate_tokens(
    model: JetNemotronForCausalLM,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_token_ids: tuple[int, ...] = (),
) -> Generation:
    if not prompt_ids:
        raise ValueError("prompt: empty (it must hold at least one token)")
    if max_tokens < 1:
        raise ValueError(f"max_tokens: {max_tokens} must be ≥ 1")
    total = len(prompt_ids) + max_tokens
    if total > model.config.max_position_embeddings:
        raise ValueError(
            f"max_tokens: prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceeds the model's context "
            f"({model.config.max_position_embeddings})"
        )
    device = model.model.embed_tokens.weight.device
    cache = StaticCache(model, num_seqs=1, max_tokens=total)
    params = dict(
        temperature=torch.tensor([temperature], device=device),
        top_k=torch.tensor([top_k], dtype=torch.int32, device=device),
        top_p=torch.tensor([top_p], device=device),
        min_p=torch.zeros(1, device=device),
        seeds=torch.tensor([seed], dtype=torch.int64, device=device),
    )
    start = time.perf_counter()
    out: list[int] = []
    tokens = list(prompt_ids)
    finish_reason = "length"
    for step in range(max_tokens):
        hidden = model(cache.batch([0], [tokens]))  # [T, hidden]
        logits = model.compute_logits(hidden[-1:])  # [1, vocab]
        counters = torch.tensor([len(prompt_ids) + step], dtype=torch.int64, device=device)
        token = int(sample(logits, counters=counters, **params)[0])
        out.append(token)
        if token in stop_token_ids:
            finish_reason = "stop"
            break
        tokens = [token]
    return Generation(out, len(prompt_ids), time.perf_counter() - start, finish_reason)
