"""The jet_vlm image encoder: a SigLIP vision tower read at its penultimate layer and the 2x2 token-merge projector
(LayerNorm(4·D_vision) → Linear → GELU → Linear) into the text model's embedding space. Parameter names are the
checkpoint's (`vision_tower.vision_model.*`, `mm_projector.layers.*`), so its tensors load unchanged."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from jetserve.config import VisionConfig

VISION_PREFIX = "vision_tower.vision_model."
PROJECTOR_PREFIX = "mm_projector.layers."


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, S, S] → [B, P, D] (P patches in row-major order, learned absolute positions added)."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [B, D, S/p, S/p]
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight  # [B, P, D]


class SiglipAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Bidirectional multi-head attention over the patches of each image: [B, P, D] → [B, P, D]."""
        b, p, d = x.shape
        q, k, v = (proj(x).view(b, p, self.num_heads, -1).transpose(1, 2) for proj in (self.q_proj, self.k_proj,
                                                                                        self.v_proj))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v)  # [B, H, P, Dh], scale Dh^-0.5
        return self.out_proj(out.transpose(1, 2).reshape(b, p, d))


class SiglipMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: VisionConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(num_layers))


class SiglipVisionTransformer(nn.Module):
    """The tower up to its penultimate layer: the features jet_vlm reads are the input of the last encoder layer
    (transformers' `hidden_states[-2]`), so the last layer, `post_layernorm` and the pooling head are never run and
    are not built (the loader skips their tensors)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config, config.num_hidden_layers - 1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, S, S] → penultimate-layer features [B, P, D]."""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class SiglipVisionTower(nn.Module):
    """Holds the transformer as `vision_model`, as transformers' SiglipVisionModel does (checkpoint names)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.vision_model = SiglipVisionTransformer(config)


class TokenMerge2x2(nn.Module):
    """Concatenates each 2x2 block of the patch grid into one token: [B, s*s, D] → [B, ceil(s/2)^2, 4D]. An odd grid
    gets a zero row and column at the bottom and right first. Within a block the order is (row, column, channel):
    top-left, top-right, bottom-left, bottom-right."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, p, d = x.shape
        side = math.isqrt(p)
        assert side * side == p, f"the patch grid must be square, got {p} patches"
        grid = x.view(b, side, side, d)
        if side % 2:
            grid = F.pad(grid, (0, 0, 0, 1, 0, 1))  # one zero column (w), then one zero row (h)
            side += 1
        half = side // 2
        blocks = grid.view(b, half, 2, half, 2, d).permute(0, 1, 3, 2, 4, 5)  # [B, h, w, 2, 2, D]
        return blocks.reshape(b, half * half, 4 * d)


class MultimodalProjector(nn.Module):
    """`layers` is indexed as the checkpoint's Sequential: 0 merge, 1 LayerNorm, 2 Linear, 3 GELU, 4 Linear."""

    def __init__(self, vision_hidden: int, text_hidden: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            TokenMerge2x2(),
            nn.LayerNorm(4 * vision_hidden),  # default eps 1e-5, as the official module
            nn.Linear(4 * vision_hidden, text_hidden),
            nn.GELU(),  # exact (erf) GELU
            nn.Linear(text_hidden, text_hidden),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


class VisionEncoder(nn.Module):
    """Image tiles → text-space embeddings, one row per placeholder token. Its parameter names are the checkpoint's
    (the jet_vlm model minus `llm.`)."""

    def __init__(self, config: VisionConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = SiglipVisionTower(config)
        self.mm_projector = MultimodalProjector(config.hidden_size, text_hidden_size)

    @property
    def tokens_per_tile(self) -> int:
        return self.config.tokens_per_tile

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, max_tiles_per_pass: int = 16) -> torch.Tensor:
        """pixel_values [N, C, S, S] (normalised tiles) → embeddings [N * tokens_per_tile, text hidden], tile order.

        Tiles run through the tower `max_tiles_per_pass` at a time, which bounds the activation memory."""
        c, s = self.config.num_channels, self.config.image_size
        assert pixel_values.dim() == 4 and tuple(pixel_values.shape[1:]) == (c, s, s), (
            f"expected tiles [N, {c}, {s}, {s}], got {tuple(pixel_values.shape)}"
        )
        weight = self.mm_projector.layers[2].weight
        pixel_values = pixel_values.to(weight.device)
        outputs = []
        for chunk in pixel_values.split(max_tiles_per_pass):
            features = self.vision_tower.vision_model(chunk)  # [n, P, D_v]
            outputs.append(self.mm_projector(features).flatten(0, 1))  # [n * tokens_per_tile, H]
        return torch.cat(outputs)


def siglip_checkpoint_shapes(config: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a transformers SiglipVisionModel checkpoint holds under `vision_tower.vision_model.` (the last
    layer, post_layernorm and the pooling head included), with its shape: what make-checkpoint writes and what the
    loader accepts, using the subset VisionEncoder builds."""
    d, i = config.hidden_size, config.intermediate_size
    names: dict[str, tuple[int, ...]] = {
        "embeddings.patch_embedding.weight": (d, config.num_channels, config.patch_size, config.patch_size),
        "embeddings.patch_embedding.bias": (d,),
        "embeddings.position_embedding.weight": (config.num_patches, d),
    }
    for layer in range(config.num_hidden_layers):
        prefix = f"encoder.layers.{layer}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            names |= {f"{prefix}self_attn.{proj}.weight": (d, d), f"{prefix}self_attn.{proj}.bias": (d,)}
        for norm in ("layer_norm1", "layer_norm2"):
            names |= {f"{prefix}{norm}.weight": (d,), f"{prefix}{norm}.bias": (d,)}
        names |= {f"{prefix}mlp.fc1.weight": (i, d), f"{prefix}mlp.fc1.bias": (i,),
                  f"{prefix}mlp.fc2.weight": (d, i), f"{prefix}mlp.fc2.bias": (d,)}  # fmt: skip
    names |= {"post_layernorm.weight": (d,), "post_layernorm.bias": (d,)}
    if config.vision_use_head:
        names |= {
            "head.probe": (1, 1, d),
            "head.attention.in_proj_weight": (3 * d, d),
            "head.attention.in_proj_bias": (3 * d,),
            "head.attention.out_proj.weight": (d, d),
            "head.attention.out_proj.bias": (d,),
            "head.layernorm.weight": (d,),
            "head.layernorm.bias": (d,),
            "head.mlp.fc1.weight": (i, d),
            "head.mlp.fc1.bias": (i,),
            "head.mlp.fc2.weight": (d, i),
            "head.mlp.fc2.bias": (d,),
        }
    return {VISION_PREFIX + name: shape for name, shape in names.items()}


def projector_checkpoint_shapes(vision_hidden: int, text_hidden: int) -> dict[str, tuple[int, ...]]:
    d4 = 4 * vision_hidden
    return {
        f"{PROJECTOR_PREFIX}1.weight": (d4,),
        f"{PROJECTOR_PREFIX}1.bias": (d4,),
        f"{PROJECTOR_PREFIX}2.weight": (text_hidden, d4),
        f"{PROJECTOR_PREFIX}2.bias": (text_hidden,),
        f"{PROJECTOR_PREFIX}4.weight": (text_hidden, text_hidden),
        f"{PROJECTOR_PREFIX}4.bias": (text_hidden,),
    }
