"""Loader: round trip through make-checkpoint, sharded indexes, and errors that name the tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from jetserve.model.loader import CheckpointError, load_model


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_round_trip_same_tensors(tiny_checkpoint):
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # tied, as in the official layout
    model = load_model(tiny_checkpoint, dtype="float32")
    params = dict(model.named_parameters())
    assert set(params) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(params[name].data, t), name
    assert model.lm_head_weight is model.model.embed_tokens.weight


def test_dtype_selection(tiny_checkpoint):
    model = load_model(tiny_checkpoint, dtype="auto")  # tiny's config says float32
    assert model.model.embed_tokens.weight.dtype == torch.float32
    model = load_model(tiny_checkpoint, dtype="float16")
    assert model.model.norm.weight.dtype == torch.float16
    assert model.model.layers[0].self_attn.dt_bias.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_checkpoint, dtype="int8")


def test_sharded_index(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "sharded")
    tensors = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(ckpt / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = load_model(ckpt, dtype="float32")
    for name, p in model.named_parameters():
        assert torch.equal(p.data, tensors[name]), name


def _edit(tiny_checkpoint, tmp_path, fn):
    ckpt = _copy(tiny_checkpoint, tmp_path / "edited")
    tensors = load_file(str(ckpt / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))
    return ckpt


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    name = "model.layers.0.self_attn.dynamic_conv1d.kernel_generator.w2.bias"
    ckpt = _edit(tiny_checkpoint, tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor.*{name}"):
        load_model(ckpt)


def test_misshaped_tensor_is_named(tiny_checkpoint, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    ckpt = _edit(tiny_checkpoint, tmp_path, lambda t: t.__setitem__(name, torch.randn(8, 64)))
    with pytest.raises(CheckpointError, match=f"{name}: shape \\(8, 64\\)"):
        load_model(ckpt)


def test_misnamed_tensor_is_named(tiny_checkpoint, tmp_path):
    old, new = "model.layers.2.self_attn.A_log", "model.layers.2.self_attn.A_logg"
    ckpt = _edit(tiny_checkpoint, tmp_path, lambda t: t.__setitem__(new, t.pop(old)))
    with pytest.raises(CheckpointError, match=old):  # missing names the expected tensor
        load_model(ckpt)


def test_unused_tensor_is_an_error_unless_ignored(tiny_checkpoint, tmp_path):
    ckpt = _edit(tiny_checkpoint, tmp_path, lambda t: t.__setitem__("model.extra.weight", torch.ones(3)))
    with pytest.raises(CheckpointError, match="model.extra.weight"):
        load_model(ckpt)
    model = load_model(ckpt, ignore_unused=True)
    assert not hasattr(model.model, "extra")


def test_no_weights(tmp_path, tiny_checkpoint):
    (tmp_path / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(tmp_path)
