"""The jet_vlm model side: config parsing, the SigLIP tower against transformers' SiglipVisionModel (penultimate
layer), the 2x2 token merge against a plain loop, and checkpoint loading in the official layout."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from jetserve.checkpoint import make_checkpoint
from jetserve.config import ModelConfig, VisionConfig, VLMConfig
from jetserve.model.loader import CheckpointError, load_model, load_vision_encoder
from jetserve.model.vision import VISION_PREFIX, TokenMerge2x2, VisionEncoder


def test_vlm_config(vlm_checkpoint):
    config = VLMConfig.from_hf(vlm_checkpoint)
    text = ModelConfig.from_hf(vlm_checkpoint)  # a jet_vlm folder gives its text model's config
    assert config.text == text and text.model_type == "jet_nemotron" and set(text.layer_types) == {"jet", "swa", "attn"}
    assert (config.vision.image_size, config.vision.patch_size, config.vision.tokens_per_tile) == (40, 8, 9)
    assert config.image_token_id == 259 and config.video_token_id == 260
    with pytest.raises(ValueError, match="image_token_id"):
        VLMConfig.from_dict(config.raw | {"image_token_id": 10**6})
    with pytest.raises(ValueError, match="num_attention_heads"):
        VisionConfig.from_dict({"hidden_size": 30, "num_attention_heads": 4})
    # The published shapes: 27x27 patches padded to 28x28, merged 2x2.
    assert VisionConfig.from_dict({"image_size": 384, "patch_size": 14}).tokens_per_tile == 196


@pytest.mark.parametrize("side", [4, 5])
def test_token_merge_matches_loop(side):
    gen = torch.Generator().manual_seed(side)
    x = torch.randn(2, side * side, 3, generator=gen)
    out = TokenMerge2x2()(x)
    padded = torch.zeros(2, side + side % 2, side + side % 2, 3)
    padded[:, :side, :side] = x.view(2, side, side, 3)
    half = padded.shape[1] // 2
    expected = torch.stack([
        torch.cat([padded[:, 2 * h, 2 * w], padded[:, 2 * h, 2 * w + 1], padded[:, 2 * h + 1, 2 * w],
                   padded[:, 2 * h + 1, 2 * w + 1]], dim=-1)
        for h in range(half) for w in range(half)
    ], dim=1)  # fmt: skip
    assert out.shape == (2, half * half, 12)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_tower_matches_transformers_siglip():
    transformers = pytest.importorskip("transformers")
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, image_size=40,
                  patch_size=8)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**vision)).eval()
    config = VisionConfig.from_dict(vision)
    ours = VisionEncoder(config, text_hidden_size=16).eval()
    state = {}
    for name, tensor in hf.state_dict().items():
        name = name.removeprefix("vision_model.")
        key = "vision_tower.vision_model." + name
        if key in dict(ours.named_parameters()):
            state[key] = tensor
    missing, _ = ours.load_state_dict(state, strict=False)
    assert [m for m in missing if not m.startswith("mm_projector")] == []
    pixels = torch.randn(3, 3, 40, 40)
    with torch.no_grad():
        expected = hf(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]  # [3, 25, 32]
        features = ours.vision_tower.vision_model(pixels)
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)
    # The projector runs LayerNorm → Linear → GELU → Linear on the merged tokens.
    proj = ours.mm_projector.layers
    merged = TokenMerge2x2()(expected)
    manual = proj[4](torch.nn.functional.gelu(proj[2](torch.nn.functional.layer_norm(
        merged, (128,), proj[1].weight, proj[1].bias, 1e-5))))  # fmt: skip
    torch.testing.assert_close(ours(pixels), manual.flatten(0, 1), rtol=1e-5, atol=1e-5)


def test_checkpoint_layout_and_loading(vlm_checkpoint, tmp_path):
    tensors = load_file(f"{vlm_checkpoint}/model.safetensors")
    names = set(tensors)
    assert "llm.model.embed_tokens.weight" in names and "llm.model.layers.0.mlp.up_proj.weight" in names
    assert {f"mm_projector.layers.{i}.weight" for i in (1, 2, 4)} <= names
    assert VISION_PREFIX + "encoder.layers.2.mlp.fc1.weight" in names  # the last layer ships (and is never run)
    assert VISION_PREFIX + "head.attention.in_proj_weight" in names and VISION_PREFIX + "post_layernorm.bias" in names
    model = load_model(vlm_checkpoint)
    torch.testing.assert_close(model.model.embed_tokens.weight, tensors["llm.model.embed_tokens.weight"])
    encoder = load_vision_encoder(vlm_checkpoint)
    assert len(encoder.vision_tower.vision_model.encoder.layers) == 2  # penultimate features: layers 0 and 1 only
    torch.testing.assert_close(encoder.mm_projector.layers[2].weight, tensors["mm_projector.layers.2.weight"])
    # A tensor no part of the model knows is an error naming it; a missing one too.
    bad = make_checkpoint("tiny-vlm", tmp_path / "bad", seed=1)
    extra = load_file(bad / "model.safetensors") | {"mm_projector.layers.9.weight": torch.ones(2)}
    save_file(extra, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"mm_projector\.layers\.9\.weight"):
        load_model(bad)
    del extra["mm_projector.layers.9.weight"], extra[VISION_PREFIX + "encoder.layers.1.mlp.fc2.bias"]
    save_file(extra, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"encoder\.layers\.1\.mlp\.fc2\.bias"):
        load_vision_encoder(bad)


def test_make_checkpoint_cli(tmp_path, capsys):
    from jetserve.checkpoint import preset_config
    from jetserve.cli import main

    assert main(["make-checkpoint", "--config", "tiny-vlm", "--out", str(tmp_path / "v"), "--num-layers", "2"]) == 0
    config = VLMConfig.from_hf(tmp_path / "v")
    assert config.text.num_hidden_layers == 2 and (tmp_path / "v" / "preprocessor_config.json").is_file()
    assert load_vision_encoder(tmp_path / "v").tokens_per_tile == 9
    # 2b-vlm has the published shapes (not written here: 2B random weights take minutes).
    big = VLMConfig.from_dict(preset_config("2b-vlm") | {"image_token_id": 151665, "video_token_id": 151666})
    assert (big.text.hidden_size, big.vision.hidden_size, big.vision.num_hidden_layers) == (1536, 1152, 27)
    assert big.vision.tokens_per_tile == 196
