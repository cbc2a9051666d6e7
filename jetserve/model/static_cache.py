"""StaticCache: a fixed set of sequences with preallocated K/V pages and JetBlock state, for unbatched generation
and model tests (the engine's BlockManager and StatePool do the same job dynamically)."""

from __future__ import annotations

import torch

from jetserve.model.forward_batch import ForwardBatch, KVMetadata, Phase
from jetserve.model.jet_nemotron import JetNemotronForCausalLM


class StaticCache:
    """Sequence i (0-based) owns state slot i + 1 and pages [1 + i*P, 1 + (i+1)*P); slot 0 and page 0 are spare."""

    def __init__(self, model: JetNemotronForCausalLM, num_seqs: int, max_tokens: int, page_size: int = 16) -> None:
        config = model.config
        param = model.model.embed_tokens.weight
        device, dtype = param.device, param.dtype
        self.device = device
        self.page_size = page_size
        self.max_tokens = max_tokens
        self.pages_per_seq = -(-max_tokens // page_size)
        num_pages = 1 + num_seqs * self.pages_per_seq
        kv_shape = (num_pages, page_size, config.num_key_value_heads, config.head_dim)
        kv = {i: (torch.zeros(kv_shape, dtype=dtype, device=device), torch.zeros(kv_shape, dtype=dtype, device=device))
              for i in config.attention_layer_ids}  # fmt: skip
        conv, recurrent = {}, {}
        if config.jet is not None:
            jet = config.jet
            for i in config.jet_layer_ids:
                conv[i] = torch.zeros(num_seqs + 1, jet.conv_size - 1, jet.value_dim, dtype=dtype, device=device)
                recurrent[i] = torch.zeros(
                    num_seqs + 1, jet.num_heads, jet.head_dim, jet.head_v_dim, dtype=torch.float32, device=device
                )
        model.bind_caches(kv, conv, recurrent)
        self.block_tables = (1 + torch.arange(num_seqs * self.pages_per_seq, dtype=torch.int32, device=device)).view(
            num_seqs, self.pages_per_seq
        )  # [num_seqs, P]
        self.lengths = [0] * num_seqs  # tokens already in each sequence's cache

    def batch(self, seq_ids: list[int], tokens: list[list[int]], phase: Phase | None = None) -> ForwardBatch:
        """A ForwardBatch appending `tokens[j]` to sequence `seq_ids[j]` (PREFILL, or DECODE when all are single)."""
        if phase is None:
            phase = Phase.DECODE if all(len(t) == 1 for t in tokens) else Phase.PREFILL
        starts = [self.lengths[s] for s in seq_ids]
        for s, t in zip(seq_ids, tokens, strict=True):
            if self.lengths[s] + len(t) > self.max_tokens:
                raise ValueError(f"sequence {s}: {self.lengths[s] + len(t)} tokens exceed max_tokens {self.max_tokens}")
        positions = [p for start, t in zip(starts, tokens, strict=True) for p in range(start, start + len(t))]
        rows = torch.tensor(seq_ids, dtype=torch.long, device=self.device)
        block_tables = self.block_tables[rows]  # [N, P]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        owner = torch.repeat_interleave(rows, torch.tensor([len(t) for t in tokens], device=self.device))  # [T]
        slots = self.block_tables[owner, pos // self.page_size].long() * self.page_size + pos % self.page_size
        lens = [len(t) for t in tokens]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=self.device)
        fb = ForwardBatch(
            phase=phase,
            input_ids=torch.tensor([x for t in tokens for x in t], dtype=torch.long, device=self.device),
            positions=pos,
            cu_seqlens=cu,
            context_lens=torch.tensor(
                [s + n for s, n in zip(starts, lens, strict=True)], dtype=torch.int32, device=self.device
            ),
            state_indices=(rows + 1).to(torch.int32),
            has_initial_state=torch.tensor([s > 0 for s in starts], dtype=torch.bool, device=self.device),
            max_seqlen_q=max(lens),
            kv=KVMetadata(slot_mapping=slots, block_tables=block_tables),
            swa_kv=KVMetadata(slot_mapping=slots, block_tables=block_tables),
        )
        for s, n in zip(seq_ids, lens, strict=True):
            self.lengths[s] += n
        return fb

    def verify_batch(self, seq_ids: list[int], tokens: torch.Tensor, parents: torch.Tensor) -> ForwardBatch:
        """A VERIFY batch: `tokens` [N, T_d] draft trees (node 0 the last committed token, not yet in the cache),
        `parents` [N, T_d] int32 (-1 for node 0). Node j is stored at position prefix + j and sits at RoPE position
        prefix + depth(j). The cache lengths do not move until `commit`."""
        num_seqs, num_nodes = tokens.shape
        device = self.device
        parents = parents.to(device=device, dtype=torch.int32)
        ancestors = torch.eye(num_nodes, dtype=torch.bool, device=device).expand(num_seqs, -1, -1).clone()
        depth = torch.zeros(num_seqs, num_nodes, dtype=torch.long, device=device)
        for j in range(1, num_nodes):  # parents precede children: one pass in node order
            p = parents[:, j].long()
            assert bool((p >= 0).all() and (p < j).all()), "a parent must come before its child"
            ancestors[:, j] |= ancestors[torch.arange(num_seqs, device=device), p]
            depth[:, j] = depth[torch.arange(num_seqs, device=device), p] + 1
        rows = torch.tensor(seq_ids, dtype=torch.long, device=device)
        prefix = torch.tensor([self.lengths[s] for s in seq_ids], dtype=torch.long, device=device)  # [N]
        if int(prefix.max()) + num_nodes > self.max_tokens:
            raise ValueError(f"verify: {int(prefix.max()) + num_nodes} tokens exceed max_tokens {self.max_tokens}")
        stored = prefix[:, None] + torch.arange(num_nodes, device=device)  # [N, T_d]
        tables = self.block_tables[rows]  # [N, P]
        slots = tables.gather(1, stored // self.page_size).long() * self.page_size + stored % self.page_size
        kv = KVMetadata(slot_mapping=slots.view(-1), block_tables=tables)
        return ForwardBatch(
            phase=Phase.VERIFY,
            input_ids=tokens.to(device).reshape(-1),
            positions=(prefix[:, None] + depth).view(-1),
            cu_seqlens=torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * num_nodes,
            context_lens=(prefix + num_nodes).to(torch.int32),
            state_indices=(rows + 1).to(torch.int32),
            has_initial_state=prefix > 0,
            max_seqlen_q=num_nodes,
            kv=kv,
            swa_kv=kv,
            tree_parents=parents,
            tree_mask=ancestors,
        )

    def commit(self, seq_ids: list[int], num_accepted: list[int]) -> None:
        """Record that each sequence kept `num_accepted` nodes of its last verified tree (after the model's commit)."""
        for s, n in zip(seq_ids, num_accepted, strict=True):
            self.lengths[s] += n
