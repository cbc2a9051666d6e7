"""Turn a built (meta-device) JetNemotronForCausalLM into one rank's tensor-parallel shard: which slice of every
checkpoint tensor the rank holds (`ShardSpec`), the module swaps (row-parallel projections, vocab-parallel
embedding and logits), and the rank-local config that sizes its K/V pages and StatePool."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from jetserve.config import ModelConfig
from jetserve.distributed.group import TensorParallelGroup
from jetserve.distributed.layers import RowParallelLinear, VocabParallelEmbedding, vocab_parallel_logits
from jetserve.model.attention import Attention
from jetserve.model.jet_block import JetBlock
from jetserve.model.jet_nemotron import JetNemotronForCausalLM
from jetserve.model.layers import MLP


@dataclass(frozen=True)
class ShardSpec:
    """The part of a checkpoint tensor one rank holds: indices `[start, end)` along `dim` (None: the whole tensor,
    replicated), zero-padded to `size` along `dim` (larger than end - start only for the last vocabulary shard)."""

    dim: int | None = None
    start: int = 0
    end: int = 0
    size: int = 0

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(shape)
        return tuple(self.size if d == self.dim else n for d, n in enumerate(shape))

    def read(self, tensor_slice) -> torch.Tensor:
        """This rank's part of `tensor_slice` (a safetensors slice, or a tensor): only those rows/columns are read."""
        if self.dim is None:
            return tensor_slice[:]
        index = (slice(None),) * self.dim + (slice(self.start, self.end),)
        part = tensor_slice[index]
        missing = self.size - (self.end - self.start)
        if missing > 0:
            pad_shape = list(part.shape)
            pad_shape[self.dim] = missing
            part = torch.cat([part, part.new_zeros(pad_shape)], dim=self.dim)
        return part


REPLICATED = ShardSpec()


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """ValueError naming the first size that `world_size` ranks cannot split."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size: must be ≥ 1, got {world_size}")
    name = "tensor_parallel_size"
    if config.num_attention_heads % world_size:
        raise ValueError(f"{name}: {world_size} does not divide num_attention_heads ({config.num_attention_heads})")
    kv = config.num_key_value_heads
    if (world_size <= kv and kv % world_size) or (world_size > kv and world_size % kv):
        raise ValueError(
            f"{name}: {world_size} must divide num_key_value_heads ({kv}) or be a multiple of it (then each K/V "
            f"head is replicated on {world_size // kv if world_size > kv else 1} ranks)"
        )
    if config.intermediate_size % world_size:
        raise ValueError(f"{name}: {world_size} does not divide intermediate_size ({config.intermediate_size})")
    if config.jet is not None and config.jet.num_heads % world_size:
        raise ValueError(
            f"{name}: {world_size} does not divide efficient_attention_config.jet.num_heads ({config.jet.num_heads})"
        )


def local_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config one rank's caches are sized by: its share of attention heads, K/V heads (at least one), MLP
    channels and JetBlock heads. Hidden size and vocabulary stay global (hidden states and logits are whole on every
    rank). Its `jet.generator_dim` no longer describes w1, which every rank holds whole."""
    kv = max(1, config.num_key_value_heads // world_size)
    jet = config.jet and dataclasses.replace(config.jet, num_heads=config.jet.num_heads // world_size)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=kv,
        intermediate_size=config.intermediate_size // world_size,
        jet=jet,
    )


def vocab_rows_per_rank(vocab_size: int, world_size: int) -> int:
    return -(-vocab_size // world_size)


def shard_model(model: JetNemotronForCausalLM, group: TensorParallelGroup) -> dict[str, ShardSpec]:
    """Replace `model`'s modules (on the meta device, before any weight is read) by this rank's shard; returns the
    ShardSpec of every parameter, keyed by its checkpoint name.

    Attention: q heads split evenly, K/V heads split while ranks ≤ K/V heads and replicated beyond (rank r then
    holds K/V head r // (ranks / K/V heads), which is the one its q heads read); o_proj row-parallel. JetBlock: split
    by head — q, k, v, a, b, g, A_log, dt_bias and the w2 output channels of the local value channels (w1 and
    o_norm whole) — with o_proj row-parallel. MLP: gate/up column-parallel, down row-parallel. Embedding and lm_head:
    contiguous vocabulary rows per rank; logits are all-gathered, so every rank samples from the same logits.
    """
    config = model.config
    world, rank = group.world_size, group.rank
    check_tensor_parallel(config, world)
    specs: dict[str, ShardSpec] = {}
    for name, _ in model.named_parameters():
        specs[name] = REPLICATED
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        if layer.kind == "jet":
            _shard_jet_block(layer.self_attn, prefix + "self_attn.", group, specs)
        else:
            _shard_attention(layer.self_attn, prefix + "self_attn.", group, specs)
        _shard_mlp(layer.mlp, prefix + "mlp.", group, specs)
    rows = vocab_rows_per_rank(config.vocab_size, world)
    start = rank * rows
    vocab_spec = ShardSpec(0, min(start, config.vocab_size), min(start + rows, config.vocab_size), rows)
    with torch.device("meta"):
        model.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, rows, group)
        if model.lm_head is not None:
            model.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
            specs["lm_head.weight"] = vocab_spec
    specs["model.embed_tokens.weight"] = vocab_spec
    vocab_size = config.vocab_size

    def compute_logits(hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`hidden` [N, hidden] → logits [N, vocab] fp32, all-gathered (the same on every rank); copied into `out`
        when given (the gather's result is a tensor of its own)."""
        logits = vocab_parallel_logits(hidden, model.lm_head_weight, vocab_size, group)
        return logits if out is None else out.copy_(logits)

    # An instance attribute shadows the class's single-device compute_logits; everything else stays the model's own.
    model.compute_logits = compute_logits
    model.config = local_config(config, world)
    model.tensor_parallel = group
    assert set(specs) == {name for name, _ in model.named_parameters()}, "a parameter without a shard spec"
    return specs


def _column(parent: nn.Module, attr: str, start: int, end: int, prefix: str, specs: dict[str, ShardSpec]) -> None:
    """Keep output rows [start, end) of the Linear `parent.attr` (and of its bias)."""
    old: nn.Linear = getattr(parent, attr)
    with torch.device("meta"):
        setattr(parent, attr, nn.Linear(old.in_features, end - start, bias=old.bias is not None))
    specs[f"{prefix}{attr}.weight"] = ShardSpec(0, start, end, end - start)
    if old.bias is not None:
        specs[f"{prefix}{attr}.bias"] = ShardSpec(0, start, end, end - start)


def _row(
    parent: nn.Module, attr: str, start: int, end: int, group: TensorParallelGroup, prefix: str, specs: dict
) -> None:
    """Keep input columns [start, end) of the Linear `parent.attr`, summing the partial outputs over the ranks."""
    old: nn.Linear = getattr(parent, attr)
    assert old.bias is None, f"{prefix}{attr}: a row-parallel layer with a bias would add it once per rank"
    with torch.device("meta"):
        setattr(parent, attr, RowParallelLinear(end - start, old.out_features, group))
    specs[f"{prefix}{attr}.weight"] = ShardSpec(1, start, end, end - start)


def _vector(parent: nn.Module, attr: str, start: int, end: int, prefix: str, specs: dict[str, ShardSpec]) -> None:
    old: nn.Parameter = getattr(parent, attr)
    setattr(parent, attr, nn.Parameter(torch.empty(end - start, dtype=old.dtype, device="meta")))
    specs[f"{prefix}{attr}"] = ShardSpec(0, start, end, end - start)


def _shard_attention(attn: Attention, prefix: str, group: TensorParallelGroup, specs: dict[str, ShardSpec]) -> None:
    world, rank, dh = group.world_size, group.rank, attn.head_dim
    num_heads = attn.num_heads // world
    if world <= attn.num_kv_heads:
        num_kv_heads = attn.num_kv_heads // world
        first_kv = rank * num_kv_heads
    else:
        num_kv_heads = 1
        first_kv = rank // (world // attn.num_kv_heads)
    first = rank * num_heads
    _column(attn, "q_proj", first * dh, (first + num_heads) * dh, prefix, specs)
    _column(attn, "k_proj", first_kv * dh, (first_kv + num_kv_heads) * dh, prefix, specs)
    _column(attn, "v_proj", first_kv * dh, (first_kv + num_kv_heads) * dh, prefix, specs)
    _row(attn, "o_proj", first * dh, (first + num_heads) * dh, group, prefix, specs)
    attn.num_heads, attn.num_kv_heads = num_heads, num_kv_heads


def _shard_jet_block(block: JetBlock, prefix: str, group: TensorParallelGroup, specs: dict[str, ShardSpec]) -> None:
    world, rank = group.world_size, group.rank
    heads = block.num_heads // world
    first = rank * heads
    dk, dv = block.head_k_dim, block.head_v_dim
    k0, k1 = first * dk, (first + heads) * dk  # key channels of the local heads
    v0, v1 = first * dv, (first + heads) * dv  # value channels of the local heads
    for attr in ("q_proj", "k_proj"):
        _column(block, attr, k0, k1, prefix, specs)
    for attr in ("v_proj", "g_proj"):
        _column(block, attr, v0, v1, prefix, specs)
    for attr in ("a_proj", "b_proj"):
        _column(block, attr, first, first + heads, prefix, specs)
    for attr in ("A_log", "dt_bias"):
        _vector(block, attr, first, first + heads, prefix, specs)
    # w2's output is flat (channel, tap) with the tap fastest, so a channel range is one contiguous row range.
    generator = block.dynamic_conv1d.kernel_generator
    width = generator.w2.out_features // block.value_dim
    _column(generator, "w2", v0 * width, v1 * width, prefix + "dynamic_conv1d.kernel_generator.", specs)
    _row(block, "o_proj", v0, v1, group, prefix, specs)
    block.num_heads, block.key_dim, block.value_dim = heads, heads * dk, heads * dv


def _shard_mlp(mlp: MLP, prefix: str, group: TensorParallelGroup, specs: dict[str, ShardSpec]) -> None:
    size = mlp.gate_proj.out_features // group.world_size
    start = group.rank * size
    _column(mlp, "gate_proj", start, start + size, prefix, specs)
    _column(mlp, "up_proj", start, start + size, prefix, specs)
    _row(mlp, "down_proj", start, start + size, group, prefix, specs)
