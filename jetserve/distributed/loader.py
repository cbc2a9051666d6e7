"""Load one rank's tensor-parallel shard of a Hugging Face checkpoint: each tensor's local slice is read from the
safetensors file (`get_slice`), so no rank ever holds a full sharded tensor."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from jetserve.config import ModelConfig
from jetserve.distributed.group import TensorParallelGroup
from jetserve.distributed.sharding import ShardSpec, shard_model
from jetserve.model.jet_nemotron import FP32_PARAMETERS, JetNemotronForCausalLM, cast_model
from jetserve.model.loader import CheckpointError, checkpoint_files, resolve_dtype

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
                target = torch.float32 if name.rsplit(".", 1)[-1] in FP32_PARAMETERS else torch_dtype
                loaded[name] = part.to(device=group.device, dtype=target)
    missing = [name for name in expected if name not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{path}: missing tensor(s) {shown}")
    if unused and not ignore_unused:
        shown = ", ".join(sorted(unused)[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise CheckpointError(f"{path}: tensor(s) the model does not use: {shown} (pass ignore_unused to load anyway)")
    model.load_state_dict(loaded, strict=False, assign=True)
    model.init_rope(group.device)
    return cast_model(model, torch_dtype).eval().requires_grad_(False)
