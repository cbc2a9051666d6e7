"""Frozen model configuration parsed from a Hugging Face `config.json` (Jet-Nemotron, Qwen2, Llama)."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_KINDS = ("attn", "swa", "jet")
SUPPORTED_MODEL_TYPES = ("jet_nemotron", "qwen2", "llama")
VLM_MODEL_TYPE = "jet_vlm"  # SigLIP tower + 2x2 token-merge projector + a Jet-Nemotron text model under `llm.`


class ConfigError(ValueError):
    """A config.json that cannot describe a model jetserve runs; the message names the field."""


@dataclass(frozen=True)
class JetBlockConfig:
    """The `efficient_attention_config["jet"]` section, with the derived sizes."""

    num_heads: int  # n
    head_dim: int  # d_k
    expand_v: float
    conv_size: int  # W
    dconv_generator_reduction: int  # r
    norm_eps: float
    mode: str = "chunk"

    @property
    def head_v_dim(self) -> int:  # d_v
        return int(self.head_dim * self.expand_v)

    @property
    def key_dim(self) -> int:  # D_k
        return self.num_heads * self.head_dim

    @property
    def value_dim(self) -> int:  # D_v
        return int(self.key_dim * self.expand_v)

    @property
    def generator_dim(self) -> int:  # D_g
        return self.value_dim // self.dconv_generator_reduction


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    layer_types: tuple[str, ...]
    jet: JetBlockConfig | None = None
    swa_window_size: int | None = None  # keys a `swa` query sees, itself included
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def jet_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "jet")

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """Layers that keep K/V (`attn` and `swa`)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind in ("attn", "swa"))

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json` (or `path` itself when it is a file)."""
        return cls.from_dict(_read_config_json(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """A `jet_vlm` config gives its text model's config (VLMConfig.from_dict reads the whole)."""
        model_type = data.get("model_type")
        if model_type == VLM_MODEL_TYPE:
            return cls.from_dict(_vlm_text_config(data))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type: {model_type!r} is not supported (expected one of {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        hidden = _int(data, "hidden_size")
        num_layers = _int(data, "num_hidden_layers")
        num_heads = _int(data, "num_attention_heads")
        num_kv_heads = _int(data, "num_key_value_heads", default=num_heads)
        head_dim = _int(data, "head_dim", default=hidden // num_heads if num_heads else 0)
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ConfigError(
                f"num_key_value_heads: {num_kv_heads} must divide num_attention_heads ({num_heads}) and be positive"
            )
        if "head_dim" not in data and hidden % num_heads:
            raise ConfigError(f"hidden_size: {hidden} is not divisible by num_attention_heads ({num_heads})")
        if head_dim % 2:
            raise ConfigError(f"head_dim: {head_dim} must be even for rotary embeddings")

        layer_types = _layer_types(data, model_type, num_layers)
        jet = _jet_config(data, hidden) if "jet" in layer_types else None
        swa_window = None
        if "swa" in layer_types:
            swa = (data.get("efficient_attention_config") or {}).get("swa")
            if not isinstance(swa, dict) or "window_size" not in swa:
                raise ConfigError("efficient_attention_config.swa.window_size: required when layer_types has 'swa'")
            swa_window = _int(swa, "window_size", prefix="efficient_attention_config.swa.")
            if swa_window < 1:
                raise ConfigError(f"efficient_attention_config.swa.window_size: {swa_window} must be ≥ 1")

        eos = data.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_theta = data.get("rope_theta")
        if rope_theta is None:
            rope_theta = (data.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        # Qwen2 always has q/k/v biases; Llama has them only with attention_bias.
        attention_bias = bool(data.get("attention_bias", model_type != "llama"))
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=_int(data, "intermediate_size"),
            vocab_size=_int(data, "vocab_size"),
            max_position_embeddings=_int(data, "max_position_embeddings", default=32768),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", model_type == "jet_nemotron")),
            attention_bias=attention_bias,
            layer_types=layer_types,
            jet=jet,
            swa_window_size=swa_window,
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(data.get("torch_dtype") or data.get("dtype") or "bfloat16"),
            raw=data,
        )


def _int(data: dict[str, Any], key: str, default: int | None = None, prefix: str = "") -> int:
    value = data.get(key, default)
    if value is None:
        raise ConfigError(f"{prefix}{key}: required")
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        raise ConfigError(f"{prefix}{key}: expected an integer, got {value!r}")
    return value


def _layer_types(data: dict[str, Any], model_type: str, num_layers: int) -> tuple[str, ...]:
    raw = data.get("layer_types")
    if model_type != "jet_nemotron":
        # Qwen2/Llama are the degenerate case: every layer is full attention. Qwen2 configs may carry their own
        # `layer_types` of "full_attention"/"sliding_attention"; only the former is supported here.
        if raw is not None and any(t != "full_attention" for t in raw):
            raise ConfigError(f"layer_types: {model_type} with sliding-window layers is not supported")
        return ("attn",) * num_layers
    if raw is None:
        raise ConfigError("layer_types: required for model_type jet_nemotron")
    if isinstance(raw, str):
        try:
            raw = ast.literal_eval(raw)
        except (ValueError, SyntaxError) as e:
            raise ConfigError(f"layer_types: cannot parse {raw!r} as a list") from e
    if not isinstance(raw, (list, tuple)) or not all(isinstance(t, str) for t in raw):
        raise ConfigError(f"layer_types: expected a list of strings, got {raw!r}")
    if len(raw) != num_layers:
        raise ConfigError(f"layer_types: has {len(raw)} entries but num_hidden_layers is {num_layers}")
    unknown = sorted({t for t in raw if t not in LAYER_KINDS})
    if unknown:
        raise ConfigError(f"layer_types: unknown layer kind(s) {unknown} (expected {', '.join(LAYER_KINDS)})")
    return tuple(raw)


def _jet_config(data: dict[str, Any], hidden: int) -> JetBlockConfig:
    section = (data.get("efficient_attention_config") or {}).get("jet")
    prefix = "efficient_attention_config.jet."
    if not isinstance(section, dict):
        raise ConfigError("efficient_attention_config.jet: required when layer_types has 'jet'")
    try:
        norm_eps = float(section.get("norm_eps", 1e-5))
        expand_v = float(section.get("expand_v", 2.0))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix}norm_eps/expand_v: not a number ({e})") from e
    jet = JetBlockConfig(
        num_heads=_int(section, "num_heads", prefix=prefix),
        head_dim=_int(section, "head_dim", prefix=prefix),
        expand_v=expand_v,
        conv_size=_int(section, "conv_size", default=4, prefix=prefix),
        dconv_generator_reduction=_int(section, "dconv_generator_reduction", default=8, prefix=prefix),
        norm_eps=norm_eps,
        mode=str(section.get("mode", "chunk")),
    )
    if jet.num_heads <= 0 or jet.head_dim <= 0:
        raise ConfigError(f"{prefix}num_heads/head_dim: must be positive")
    if jet.key_dim * jet.expand_v != jet.value_dim or jet.value_dim != jet.num_heads * jet.head_v_dim:
        raise ConfigError(f"{prefix}expand_v: {expand_v} gives a non-integer value dim for head_dim {jet.head_dim}")
    if jet.conv_size < 2:
        raise ConfigError(f"{prefix}conv_size: {jet.conv_size} must be ≥ 2")
    if jet.dconv_generator_reduction <= 0 or jet.value_dim % jet.dconv_generator_reduction:
        raise ConfigError(
            f"{prefix}dconv_generator_reduction: {jet.dconv_generator_reduction} must divide the value dim "
            f"{jet.value_dim}"
        )
    return jet


@dataclass(frozen=True)
class VisionConfig:
    """The SigLIP vision tower of a `jet_vlm` checkpoint (`vision_config`, transformers' SiglipVisionConfig keys)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    vision_use_head: bool  # the checkpoint carries the pooling head (unused: jet_vlm reads patch features)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2

    @property
    def tokens_per_tile(self) -> int:
        """Embeddings one image tile becomes: the patch grid, padded to even, merged 2x2."""
        side = (self.patches_per_side + 1) // 2
        return side * side

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VisionConfig:
        prefix = "vision_config."
        config = cls(
            hidden_size=_int(data, "hidden_size", default=768, prefix=prefix),
            intermediate_size=_int(data, "intermediate_size", default=3072, prefix=prefix),
            num_hidden_layers=_int(data, "num_hidden_layers", default=12, prefix=prefix),
            num_attention_heads=_int(data, "num_attention_heads", default=12, prefix=prefix),
            num_channels=_int(data, "num_channels", default=3, prefix=prefix),
            image_size=_int(data, "image_size", default=224, prefix=prefix),
            patch_size=_int(data, "patch_size", default=16, prefix=prefix),
            layer_norm_eps=float(data.get("layer_norm_eps", 1e-6)),
            hidden_act=str(data.get("hidden_act", "gelu_pytorch_tanh")),
            vision_use_head=bool(data.get("vision_use_head", True)),
        )
        if config.num_attention_heads <= 0 or config.hidden_size % config.num_attention_heads:
            raise ConfigError(
                f"{prefix}num_attention_heads: {config.num_attention_heads} must divide hidden_size "
                f"({config.hidden_size})"
            )
        if config.patch_size <= 0 or config.image_size < config.patch_size:
            raise ConfigError(f"{prefix}patch_size: {config.patch_size} must be in [1, image_size {config.image_size}]")
        if config.num_hidden_layers < 2:
            raise ConfigError(f"{prefix}num_hidden_layers: {config.num_hidden_layers} must be ≥ 2 (features come from "
                              "the penultimate layer)")  # fmt: skip
        if config.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ConfigError(f"{prefix}hidden_act: {config.hidden_act!r} is not supported (gelu_pytorch_tanh, gelu)")
        return config


@dataclass(frozen=True)
class VLMConfig:
    """A `jet_vlm` config.json: the text model, the vision tower, and the placeholder token ids."""

    text: ModelConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int | None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf(cls, path: str | Path) -> VLMConfig:
        return cls.from_dict(_read_config_json(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VLMConfig:
        if data.get("model_type") != VLM_MODEL_TYPE:
            raise ConfigError(f"model_type: {data.get('model_type')!r} is not {VLM_MODEL_TYPE!r}")
        vision = data.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError("vision_config: required for model_type jet_vlm")
        text = ModelConfig.from_dict(_vlm_text_config(data))
        image_token_id = _int(data, "image_token_id")
        video = data.get("video_token_id")
        video_token_id = None if video is None or video == -1 else _int(data, "video_token_id")
        for name, token in (("image_token_id", image_token_id), ("video_token_id", video_token_id)):
            if token is not None and not 0 <= token < text.vocab_size:
                raise ConfigError(f"{name}: {token} is outside the vocabulary [0, {text.vocab_size})")
        return cls(text, VisionConfig.from_dict(vision), image_token_id, video_token_id, raw=data)


def is_vlm_config(path: str | Path) -> bool:
    """Whether `path` (a checkpoint folder or a config.json) describes a `jet_vlm` model."""
    try:
        return _read_config_json(path).get("model_type") == VLM_MODEL_TYPE
    except (ConfigError, OSError, AttributeError):
        return False


def _read_config_json(path: str | Path) -> Any:
    """The parsed `path/config.json` (or `path` itself when it is a file); ConfigError when absent or not JSON."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from e


def _vlm_text_config(data: dict[str, Any]) -> dict[str, Any]:
    """`text_config` with the top level's dtype and special token ids where it lacks its own."""
    text = data.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("text_config: required for model_type jet_vlm")
    text = {"model_type": "jet_nemotron"} | text
    for key in ("torch_dtype", "bos_token_id", "eos_token_id"):
        if key not in text and key in data:
            text[key] = data[key]
    return text
