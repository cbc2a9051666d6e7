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

from jetserve.config import ModelConfig
from jetserve.model.jet_nemotron import JetNemotronForCausalLM
from jetserve.model.loader import resolve_dtype
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


def preset_config(name_or_path: str, num_layers: int | None = None, vocab_size: int | None = None) -> dict[str, Any]:
    """A preset name (`tiny`, `2b`, `4b`) or a path to a config JSON, with optional overrides."""
    if name_or_path in PRESETS:
        data = json.loads(json.dumps(PRESETS[name_or_path]))
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"--config: {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a JSON file")
        data = json.loads(path.read_text())
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
    model_config = ModelConfig.from_dict(data)
    tok = byte_tokenizer()
    if tok.get_vocab_size(with_added_tokens=True) > model_config.vocab_size:
        raise ValueError(f"vocab_size: {model_config.vocab_size} is smaller than the tokenizer's vocabulary")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    endoftext, im_end = write_tokenizer(tok, out, model_config.max_position_embeddings)
    data = data | {"bos_token_id": endoftext, "eos_token_id": endoftext}
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")
    generation = {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    weights = random_weights(model_config, seed, resolve_dtype(dtype, model_config))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
