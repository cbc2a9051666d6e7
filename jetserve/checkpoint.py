"""`make-checkpoint`: random-weight checkpoints in exactly the official Hugging Face layout (tests and benchmarks)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from jetserve.config import VLM_MODEL_TYPE, ModelConfig, VLMConfig
from jetserve.model.jet_nemotron import JetNemotronForCausalLM
from jetserve.model.loader import LLM_PREFIX, resolve_dtype
from jetserve.model.vision import projector_checkpoint_shapes, siglip_checkpoint_shapes
from jetserve.tokenizer import CHATML_TEMPLATE

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _jet_nemotron(
    hidden: int, layers: list[str], heads: int, kv_heads: int, head_dim: int, mlp: int, vocab: int, jet: dict, swa: int
) -> dict[str, Any]:
    return {
        "architectures": ["JetNemotronForCausalLM"],
        "model_type": "jet_nemotron",
        "hidden_size": hidden,
        "num_hidden_layers": len(layers),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": mlp,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "layer_types": layers,
        "efficient_attention_config": {"jet": jet, "swa": {"window_size": swa}},
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    }


def _layer_types(num_layers: int, attn: tuple[int, ...], swa: tuple[int, ...]) -> list[str]:
    return ["attn" if i in attn else "swa" if i in swa else "jet" for i in range(num_layers)]


def _jet(heads: int, head_dim: int, expand_v: float) -> dict[str, Any]:
    return {
        "mode": "chunk",
        "expand_v": expand_v,
        "num_heads": heads,
        "head_dim": head_dim,
        "norm_eps": "1e-5",
        "conv_size": 4,
        "dconv_generator_reduction": 8,
        "dconv_implementation": "triton",
    }


PRESETS: dict[str, dict[str, Any]] = {
    # All three layer kinds, small enough that a forward takes milliseconds on the CPU; window 16 so tests reach it.
    "tiny": _jet_nemotron(64, ["jet", "swa", "jet", "attn"], 4, 2, 16, 128, 320, _jet(2, 16, 2.0), swa=16)
    | {"max_position_embeddings": 4096, "torch_dtype": "float32"},
    "2b": _jet_nemotron(
        1536, _layer_types(28, (14, 19), (20, 21)), 12, 2, 128, 8960, 151936, _jet(12, 96, 256 / 96), swa=1152
    ),
    "4b": _jet_nemotron(
        2048,
        _layer_types(36, (17, 20, 32), (5, 16, 19, 21, 22, 25, 27)),
        16,
        2,
        128,
        11008,
        151936,
        _jet(16, 128, 2.0),
        swa=2048,
    ),
}


# jet_vlm presets: (text preset, SigLIP vision_config, image processor config). `2b-vlm` has the published shapes
# (SigLIP so400m/14 at 384 px: 27x27 patches → 196 tokens per tile); `tiny-vlm` an odd 5x5 patch grid (padded to
# 6x6 → 9 tokens per tile) so tests exercise the projector's padding, and at most 4 tiles per single image.
VLM_PRESETS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "tiny-vlm": (
        "tiny",
        {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
         "image_size": 40, "patch_size": 8},
        {"max_tiles": 4},
    ),
    "2b-vlm": (
        "2b",
        {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
         "image_size": 384, "patch_size": 14},
        {"max_tiles": 12},
    ),
}  # fmt: skip
VLM_SPECIAL_TOKENS = ("<image>", "<vila/video>")  # the NVILA processor's image and video placeholders


def _vlm_config(text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    vision = {"model_type": "siglip_vision_model", "num_channels": 3, "hidden_act": "gelu_pytorch_tanh",
              "layer_norm_eps": 1e-6, "attention_dropout": 0.0, "vision_use_head": True} | vision  # fmt: skip
    return {
        "architectures": ["JetVLMForConditionalGeneration"],
        "model_type": VLM_MODEL_TYPE,
        "text_config": text,
        "vision_config": vision,
        "torch_dtype": text.get("torch_dtype", "bfloat16"),
    }


def preset_config(name_or_path: str, num_layers: int | None = None, vocab_size: int | None = None) -> dict[str, Any]:
    """A preset name (`tiny`, `2b`, `4b`, `tiny-vlm`, `2b-vlm`) or a path to a config JSON, with optional overrides
    (applied to a jet_vlm's text model)."""
    if name_or_path in VLM_PRESETS:
        text_preset, vision, _ = VLM_PRESETS[name_or_path]
        return _vlm_config(preset_config(text_preset, num_layers, vocab_size), json.loads(json.dumps(vision)))
    if name_or_path in PRESETS:
        data = json.loads(json.dumps(PRESETS[name_or_path]))
    else:
        path = Path(name_or_path)
        if not path.is_file():
            names = ", ".join([*PRESETS, *VLM_PRESETS])
            raise ValueError(f"--config: {name_or_path!r} is neither a preset ({names}) nor a JSON file")
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"--config: {name_or_path}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"--config: {name_or_path}: not a JSON object")
        if data.get("model_type") == VLM_MODEL_TYPE:
            data["text_config"] = _override(data.get("text_config") or {}, num_layers, vocab_size)
            VLMConfig.from_dict(data)  # validate
            return data
    return _override(data, num_layers, vocab_size)


def _override(data: dict[str, Any], num_layers: int | None, vocab_size: int | None) -> dict[str, Any]:
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"--num-layers: {num_layers} must be ≥ 1")
        kinds = data.get("layer_types")
        if isinstance(kinds, list):
            # Sample the original pattern evenly, so a shortened preset keeps its mix of kinds.
            data["layer_types"] = [kinds[i * len(kinds) // num_layers] for i in range(num_layers)]
        data["num_hidden_layers"] = num_layers
    if vocab_size is not None:
        if vocab_size < len(SPECIAL_TOKENS) + 256:
            raise ValueError(f"--vocab-size: {vocab_size} must be ≥ {len(SPECIAL_TOKENS) + 256} (bytes + specials)")
        data["vocab_size"] = vocab_size
    ModelConfig.from_dict(data)  # validate
    return data


def byte_tokenizer() -> HFTokenizer:
    """A byte-level BPE tokenizer with no merges: 256 byte tokens, then the ChatML special tokens."""
    vocab = {char: i for i, char in enumerate(_byte_alphabet())}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _byte_alphabet() -> list[str]:
    """The printable stand-in for each byte 0..255 that byte-level BPE uses (printable bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_tokenizer(tok: HFTokenizer, out: Path, model_max_length: int) -> tuple[int, int]:
    """Write tokenizer.json and tokenizer_config.json; returns the (endoftext, im_end) ids."""
    tok.save(str(out / "tokenizer.json"))
    endoftext, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    added = {
        str(tok.token_to_id(t)): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                  "rstrip": False, "single_word": False}
        for t in SPECIAL_TOKENS
    }  # fmt: skip
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return endoftext, im_end


@torch.no_grad()
def random_weights(config: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors for every checkpoint name, scaled so activations stay O(1) through the residual stream."""
    with torch.device("meta"):
        model = JetNemotronForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, param in model.named_parameters():
        shape, leaf = tuple(param.shape), name.rsplit(".", 1)[-1]
        if name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=gen) / math.sqrt(config.hidden_size)  # tied lm_head: logits O(1)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif leaf == "A_log":
            t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif leaf == "dt_bias":
            dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
            t = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif leaf == "bias":
            t = 0.1 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])  # fan-in scaling
        tensors[name] = t.to(torch.float32 if leaf in ("A_log", "dt_bias") else dtype).contiguous()
    return tensors


def make_checkpoint(
    config: str | dict[str, Any],
    out_dir: str | Path,
    seed: int = 0,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    dtype: str = "auto",
) -> Path:
    """Write config.json, model.safetensors (no lm_head.weight when tied), tokenizer and generation config."""
    data = preset_config(config, num_layers, vocab_size) if isinstance(config, str) else dict(config)
    if data.get("model_type") == VLM_MODEL_TYPE:
        processor = VLM_PRESETS[config][2] if isinstance(config, str) and config in VLM_PRESETS else {}
        return _make_vlm_checkpoint(data, out_dir, seed, dtype, processor)
    model_config = ModelConfig.from_dict(data)
    tok = byte_tokenizer()
    if tok.get_vocab_size(with_added_tokens=True) > model_config.vocab_size:
        raise ValueError(f"vocab_size: {model_config.vocab_size} is smaller than the tokenizer's vocabulary")
    out = _output_dir(out_dir)
    endoftext, im_end = write_tokenizer(tok, out, model_config.max_position_embeddings)
    _write_configs(out, data | {"bos_token_id": endoftext, "eos_token_id": endoftext}, endoftext, im_end)
    weights = random_weights(model_config, seed, resolve_dtype(dtype, model_config))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _output_dir(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _write_configs(out: Path, config: dict[str, Any], endoftext: int, im_end: int) -> None:
    """config.json as given, and a generation_config.json that stops at either end token (as Qwen2.5's does)."""
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


@torch.no_grad()
def random_vision_weights(config: VLMConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors for every vision tower (the whole SigLIP, head included) and projector name."""
    gen = torch.Generator().manual_seed(seed)
    shapes = siglip_checkpoint_shapes(config.vision) | projector_checkpoint_shapes(
        config.vision.hidden_size, config.text.hidden_size
    )
    tensors = {}
    for name, shape in shapes.items():
        leaf = name.rsplit(".", 1)[-1]
        is_norm = any(part in name for part in ("layer_norm", "layernorm", "mm_projector.layers.1."))
        if is_norm and leaf == "weight":
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif leaf in ("bias", "in_proj_bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        else:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
            t = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
        tensors[name] = t.to(dtype).contiguous()
    return tensors


def processor_config(config: VLMConfig, overrides: dict[str, Any]) -> dict[str, Any]:
    """A SigLIP image processor config (preprocessor_config.json) for the tower's tile size, with the NVILA
    processor's dynamic tiling made explicit."""
    size = config.vision.image_size
    return {
        "image_processor_type": "SiglipImageProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"height": size, "width": size},
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_aspect_ratio": "dynamic",
        "min_tiles": 1,
        "max_tiles": 12,
    } | overrides


def _make_vlm_checkpoint(
    data: dict[str, Any], out_dir: str | Path, seed: int, dtype: str, processor_overrides: dict[str, Any]
) -> Path:
    """A random jet_vlm checkpoint: the text model's tensors under `llm.`, the SigLIP tower and projector, the
    tokenizer with the image/video placeholders, and preprocessor_config.json."""
    tok = byte_tokenizer()
    tok.add_special_tokens(list(VLM_SPECIAL_TOKENS))
    image_token_id, video_token_id = (tok.token_to_id(t) for t in VLM_SPECIAL_TOKENS)
    text = ModelConfig.from_dict(data["text_config"])
    if tok.get_vocab_size(with_added_tokens=True) > text.vocab_size:
        raise ValueError(f"vocab_size: {text.vocab_size} is smaller than the tokenizer's vocabulary")
    out = _output_dir(out_dir)
    endoftext, im_end = write_tokenizer(tok, out, text.max_position_embeddings)
    tokenizer_config_file = out / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_file.read_text())
    for token in VLM_SPECIAL_TOKENS:
        tokenizer_config["added_tokens_decoder"][str(tok.token_to_id(token))] = {
            "content": token, "special": True, "normalized": False, "lstrip": False, "rstrip": False,
            "single_word": False,
        }  # fmt: skip
    tokenizer_config |= {"image_token": VLM_SPECIAL_TOKENS[0], "video_token": VLM_SPECIAL_TOKENS[1]}
    tokenizer_config_file.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    ids = {"bos_token_id": endoftext, "eos_token_id": endoftext}
    data = data | ids | {"text_config": data["text_config"] | ids}
    data |= {"image_token_id": image_token_id, "video_token_id": video_token_id}
    config = VLMConfig.from_dict(data)
    _write_configs(out, data, endoftext, im_end)
    processor = processor_config(config, processor_overrides)
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    torch_dtype = resolve_dtype(dtype, config.text)
    weights = {LLM_PREFIX + name: t for name, t in random_weights(config.text, seed, torch_dtype).items()}
    weights |= random_vision_weights(config, seed + 1, torch_dtype)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
