"""Load a Hugging Face checkpoint (safetensors, single file or sharded index) into JetNemotronForCausalLM."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from jetserve.config import ModelConfig, VLMConfig, is_vlm_config
from jetserve.model.fusion import fuse_projections
from jetserve.model.jet_nemotron import JetNemotronForCausalLM, cast_model, parameter_dtype
from jetserve.model.vision import VisionEncoder, projector_checkpoint_shapes, siglip_checkpoint_shapes

LLM_PREFIX = "llm."  # where a jet_vlm checkpoint keeps its text model's tensors
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match the model its config describes; the message names the tensor."""


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """`auto` takes the config's torch_dtype (bfloat16 when it names none we support)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return DTYPES.get(config.torch_dtype, torch.bfloat16)
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the index's shards, or the single model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: shard(s) named in the index are missing: {', '.join(missing)}")
    return files


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    ignore_unused: bool = False,
) -> JetNemotronForCausalLM:
    """Build the model from `path/config.json` and fill it from the checkpoint's tensors.

    A tensor the model needs but the files lack, or one of the wrong shape, is an error naming it; so is a tensor the
    model does not use, unless `ignore_unused`. For a `jet_vlm` checkpoint this is its text model (the tensors under
    `llm.`); `load_vision_encoder` reads the rest.
    """
    path = Path(path)
    config = ModelConfig.from_hf(path)
    torch_dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        model = JetNemotronForCausalLM(config)
    if is_vlm_config(path):
        vlm = VLMConfig.from_hf(path)
        skipped = set(siglip_checkpoint_shapes(vlm.vision)) | set(
            projector_checkpoint_shapes(vlm.vision.hidden_size, config.hidden_size)
        )

        def rename(name: str) -> str | None:
            return name[len(LLM_PREFIX) :] if name.startswith(LLM_PREFIX) else None if name in skipped else name

    else:

        def rename(name: str) -> str | None:
            return name

    _fill(model, path, rename, torch_dtype, device, ignore_unused)
    model.init_rope(device)  # built on the meta device with the model
    return fuse_projections(cast_model(model, torch_dtype).eval().requires_grad_(False))


def load_vision_encoder(
    path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu"
) -> VisionEncoder:
    """The SigLIP tower and projector of a `jet_vlm` checkpoint. Tensors the encoder never runs (the tower's last
    layer, post_layernorm, pooling head) are skipped; the text model's (`llm.`) are left to `load_model`."""
    path = Path(path)
    config = VLMConfig.from_hf(path)
    torch_dtype = resolve_dtype(dtype, config.text)
    with torch.device("meta"):
        encoder = VisionEncoder(config.vision, config.text.hidden_size)
    known = set(siglip_checkpoint_shapes(config.vision))

    def rename(name: str) -> str | None:
        return None if name.startswith(LLM_PREFIX) or (name in known and name not in expected) else name

    expected = dict(encoder.named_parameters())
    _fill(encoder, path, rename, torch_dtype, device, ignore_unused=False)
    return encoder.to(torch_dtype).eval().requires_grad_(False)


def _fill(
    model: torch.nn.Module,
    path: Path,
    rename: Callable[[str], str | None],
    torch_dtype: torch.dtype,
    device: str | torch.device,
    ignore_unused: bool,
) -> None:
    """Assign `model`'s (meta) parameters from the checkpoint; `rename` maps a checkpoint name to the parameter name,
    or to None for a tensor that belongs to another part of the checkpoint (not read)."""
    expected = {name: p for name, p in model.named_parameters()}
    loaded: dict[str, torch.Tensor] = {}
    unused: list[str] = []
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():
                name = rename(stored)
                if name is None:
                    continue
                if name not in expected:
                    # e.g. a tied checkpoint that still carries lm_head.weight: an error unless `ignore_unused`.
                    unused.append(stored)
                    continue
                tensor = f.get_tensor(stored)
                if tuple(tensor.shape) != tuple(expected[name].shape):
                    raise CheckpointError(
                        f"{stored}: shape {tuple(tensor.shape)} in {file.name}, expected {tuple(expected[name].shape)}"
                    )
                loaded[name] = tensor.to(device=device, dtype=parameter_dtype(name, torch_dtype))
    assign_loaded(model, path, loaded, unused, ignore_unused)


def assign_loaded(
    model: torch.nn.Module, path: Path, loaded: dict[str, torch.Tensor], unused: list[str], ignore_unused: bool
) -> None:
    """Assign the `loaded` tensors to `model`'s parameters; a CheckpointError names the parameters no tensor filled
    and (unless `ignore_unused`) the checkpoint tensors the model has no parameter for."""
    missing = [name for name, _ in model.named_parameters() if name not in loaded]
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {_first_five(missing)}")
    if unused and not ignore_unused:
        shown = _first_five(sorted(unused))
        raise CheckpointError(f"{path}: tensor(s) the model does not use: {shown} (pass ignore_unused to load anyway)")
    model.load_state_dict(loaded, strict=False, assign=True)


def _first_five(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
