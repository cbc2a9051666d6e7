"""Load one rank's tensor-parallel shard of a Hugging Face checkpoint: each tensor's local slice is read from the
safetensors file (`get_slice`), so no rank ever holds a full sharded tensor."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

from jetserve.config import ModelConfig
from jetserve.distributed.group import TensorParallelGroup
from jetserve.distributed.sharding import ShardSpec, shard_model
from jetserve.model.fusion import fuse_projections
from jetserve.model.jet_nemotron import JetNemotronForCausalLM, cast_model, parameter_dtype
from jetserve.model.loader import CheckpointError, assign_loaded, checkpoint_files, resolve_dtype

# The one way this module opens a checkpoint file (tests wrap it to see what is read).
open_checkpoint = safe_open


def load_sharded_model(
    path: str | Path,
    group: TensorParallelGroup,
    dtype: str | torch.dtype = "auto",
    ignore_unused: bool = False,
) -> JetNemotronForCausalLM:
    """Build the model of `path/config.json` on the meta device, shard it for `group.rank` (`shard_model`), and
    fill it with the rank's slices on `group.device`. Errors name the tensor, as `jetserve.model.loader` does."""
    path = Path(path)
    config = ModelConfig.from_hf(path)
    torch_dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        model = JetNemotronForCausalLM(config)
    global_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    specs = shard_model(model, group)
    expected = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    unused: list[str] = []
    for file in checkpoint_files(path):
        with open_checkpoint(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in expected:
                    unused.append(name)
                    continue
                tensor_slice = f.get_slice(name)
                shape = tuple(tensor_slice.get_shape())
                if shape != global_shapes[name]:
                    raise CheckpointError(f"{name}: shape {shape} in {file.name}, expected {global_shapes[name]}")
                spec: ShardSpec = specs[name]
                part = spec.read(tensor_slice)  # [local shape]: only this rank's rows/columns were read
                assert tuple(part.shape) == tuple(expected[name].shape), f"{name}: {part.shape} vs {spec}"
                loaded[name] = part.to(device=group.device, dtype=parameter_dtype(name, torch_dtype))
    assign_loaded(model, path, loaded, unused, ignore_unused)
    model.init_rope(group.device)
    return fuse_projections(cast_model(model, torch_dtype).eval().requires_grad_(False))


@torch.no_grad()
def random_sharded_model(
    config: ModelConfig, group: TensorParallelGroup, dtype: str | torch.dtype = "auto", seed: int = 0
) -> JetNemotronForCausalLM:
    """This rank's shard of a model with random weights drawn on `group.device` (benchmarks: speed does not depend
    on the values). Each tensor is drawn from its own seed, so the tensors every rank holds whole are the same."""
    torch_dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        model = JetNemotronForCausalLM(config)
    specs = shard_model(model, group)
    model = model.to_empty(device=group.device)
    for name, param in model.named_parameters():
        gen = torch.Generator(device=group.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            param.uniform_(1.0, 16.0, generator=gen).log_()
        elif leaf == "dt_bias":
            dt = torch.empty_like(param).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
            param.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            param.normal_(1.0, 0.1, generator=gen)
        elif leaf == "bias":
            param.normal_(0.0, 0.1, generator=gen)
        else:
            spec = specs[name]
            fan_in = param.shape[-1] * (group.world_size if spec.dim == 1 else 1)
            fan_in = config.hidden_size if name.endswith("embed_tokens.weight") else fan_in
            param.normal_(0.0, fan_in**-0.5, generator=gen)
    model.init_rope(group.device)
    return fuse_projections(cast_model(model, torch_dtype).eval().requires_grad_(False))
