"""Pretraining of a Jet-Nemotron-architecture model on token streams: AdamW, warmup + cosine, gradient clipping, bf16
autocast on CUDA, resumable checkpoints (model, optimizer, data position, RNG) saved every N steps and when a time
budget runs out, held-out perplexity, a loss-curve PNG, and export to the Hugging Face layout `load_model` reads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from jetserve.config import ModelConfig
from jetserve.model.jet_nemotron import FP32_PARAMETERS, JetNemotronForCausalLM
from jetserve.model.loader import load_model
from jetserve.train.forward import GDR_IMPLS, causal_lm_loss

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
STATE_FILE = "state.pt"
PORTABLE_STATE_FILE = "train_state.json"
MAX_SHARD_BYTES = 15 * 2**20  # the device tool hands back files of at most 16 MiB


def model_config(
    vocab_size: int,
    hidden: int,
    layer_types: list[str],
    intermediate: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    jet_heads: int,
    jet_head_dim: int,
    window: int,
    max_positions: int = 4096,
) -> dict[str, Any]:
    """A `jet_nemotron` config.json (tied embeddings, Qwen2 attention with q/k/v biases, JetBlock expand_v 2)."""
    return {
        "architectures": ["JetNemotronForCausalLM"],
        "model_type": "jet_nemotron",
        "hidden_size": hidden,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "layer_types": layer_types,
        "efficient_attention_config": {
            "jet": {
                "mode": "chunk",
                "expand_v": 2.0,
                "num_heads": jet_heads,
                "head_dim": jet_head_dim,
                "norm_eps": "1e-5",
                "conv_size": 4,
                "dconv_generator_reduction": 8,
            },
            "swa": {"window_size": window},
        },  # fmt: skip
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    }


def preset(name: str, vocab_size: int) -> dict[str, Any]:
    """`default`: the shipped model (about 16.0 M parameters, 32 MB in bf16); `micro`: tests (all three kinds)."""
    if name == "default":
        kinds = ["jet", "jet", "swa", "jet", "attn", "jet", "swa", "jet"]
        return model_config(vocab_size, 384, kinds, 896, 6, 2, 64, 3, 64, window=256)
    if name == "micro":
        return model_config(vocab_size, 32, ["jet", "swa", "attn"], 64, 2, 1, 16, 2, 8, window=8, max_positions=512)
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--config: {name!r} is neither a preset (default, micro) nor a config.json file")
    return json.loads(path.read_text()) | {"vocab_size": vocab_size}


@dataclass
class TrainConfig:
    seq_len: int = 1024
    batch_size: int = 32
    max_steps: int = 4000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 250
    eval_batches: int = 8
    save_every: int = 500
    seed: int = 0
    gdr_impl: str = "auto"


@dataclass
class History:
    """What the loss curve plots: (step, train loss) every step, (step, held-out loss) at each evaluation."""

    train: list[tuple[int, float]] = field(default_factory=list)
    heldout: list[tuple[int, float]] = field(default_factory=list)


class TokenStream:
    """Training rows of `seq_len + 1` tokens cut from one concatenated stream at window-aligned offsets, visited in a
    permutation that depends only on (seed, epoch): the position (epoch, index) is all a resume needs."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, shuffle: bool = True) -> None:
        self.tokens = tokens  # [N] uint16/int32
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.num_rows = (len(tokens) - 1) // seq_len
        if self.num_rows < 1:
            raise ValueError(f"data: {len(tokens)} tokens are fewer than one row of seq_len + 1 = {seq_len + 1}")
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def seek(self, epoch: int, index: int) -> None:
        self.epoch, self.index = epoch, index
        self._order = self._permutation(epoch)

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """[B, seq_len + 1] int64 rows."""
        rows = []
        for _ in range(batch_size):
            if self.index == self.num_rows:
                self.seek(self.epoch + 1, 0)
            start = int(self._order[self.index]) * self.seq_len
            rows.append(torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64)))
            self.index += 1
        return torch.stack(rows)


def load_tokens(specs: list[str]) -> np.ndarray:
    """Concatenate token files; `FILE.npy:K` repeats that file K times (a mixture weight)."""
    parts = []
    for spec in specs:
        path, _, repeat = spec.partition(":")
        if not Path(path).is_file():
            raise ValueError(f"--data: no file {path}")
        count = int(repeat) if repeat else 1
        if count < 1:
            raise ValueError(f"--data {spec}: the repeat count must be ≥ 1")
        parts += [np.load(path, mmap_mode="r")] * count
    return np.concatenate(parts)


@torch.no_grad()
def init_weights(model: JetNemotronForCausalLM, seed: int, std: float = 0.02) -> None:
    """GPT-style init: N(0, std) matrices and embedding, output projections scaled by 1/sqrt(2L), zero biases, unit
    norms; Mamba-style A_log and dt_bias; the dynamic conv starts as the identity on the current token."""
    gen = torch.Generator().manual_seed(seed)
    num_layers = model.config.num_hidden_layers
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            value = torch.empty(param.shape).uniform_(1.0, 16.0, generator=gen).log()
        elif leaf == "dt_bias":
            dt = torch.empty(param.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
            value = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            value = torch.ones(param.shape)
        elif name.endswith("kernel_generator.w2.bias"):
            width = model.config.jet.conv_size
            value = torch.zeros(param.shape).view(-1, width)
            value[:, -1] = 1.0  # κ = e_{W-1}: v̂_t = u_t
            value = value.view(param.shape)
        elif leaf == "bias":
            value = torch.zeros(param.shape)
        else:
            scale = std / math.sqrt(2 * num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            value = torch.randn(param.shape, generator=gen) * scale
        param.copy_(value.to(param.dtype))


def build_model(config: dict[str, Any], device: torch.device, seed: int) -> JetNemotronForCausalLM:
    model = JetNemotronForCausalLM(ModelConfig.from_dict(config)).to(device=device, dtype=torch.float32)
    model.init_rope(device)
    init_weights(model, seed)
    return model


def build_optimizer(model: JetNemotronForCausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """Weight decay on matrices only (not embeddings' norms, biases, A_log, dt_bias)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if param.dim() >= 2 and name.rsplit(".", 1)[-1] not in FP32_PARAMETERS else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine down to cfg.lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def train_step(
    model: JetNemotronForCausalLM, opt: torch.optim.Optimizer, rows: torch.Tensor, step: int, cfg: TrainConfig
) -> float:
    """One optimizer step on rows [B, T+1]; returns the loss."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    device = next(model.parameters()).device
    rows = rows.to(device, non_blocking=True)
    with _autocast(device):
        loss = causal_lm_loss(model, rows[:, :-1], rows[:, 1:], gdr_impl=cfg.gdr_impl)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return loss.item()


@torch.no_grad()
def evaluate(model: JetNemotronForCausalLM, heldout: np.ndarray, cfg: TrainConfig) -> float:
    """Mean next-token loss over the first `eval_batches` batches of held-out rows (a fixed set)."""
    stream = TokenStream(heldout, min(cfg.seq_len, len(heldout) - 1), seed=0, shuffle=False)
    device = next(model.parameters()).device
    num_rows = min(stream.num_rows, cfg.eval_batches * cfg.batch_size)
    losses = []
    for lo in range(0, num_rows, cfg.batch_size):
        rows = stream.next_batch(min(cfg.batch_size, num_rows - lo)).to(device)
        with _autocast(device):
            losses.append(float(causal_lm_loss(model, rows[:, :-1], rows[:, 1:], gdr_impl=cfg.gdr_impl)) * len(rows))
    return sum(losses) / num_rows


def save_state(
    path: Path, model: JetNemotronForCausalLM, opt: torch.optim.Optimizer, step: int, stream: TokenStream,
    history: History, cfg: TrainConfig, config: dict[str, Any],
) -> None:  # fmt: skip
    """Everything a resume needs, written atomically (a crash mid-save keeps the previous file)."""
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "data": stream.position(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "history": asdict(history),
        "train_config": asdict(cfg),
        "model_config": config,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_state(
    path: Path, model: JetNemotronForCausalLM, opt: torch.optim.Optimizer, stream: TokenStream
) -> tuple[int, History]:
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    stream.seek(**state["data"])
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    history = History(**{k: [tuple(x) for x in v] for k, v in state["history"].items()})
    return state["step"], history


def save_portable(
    path: Path, model: JetNemotronForCausalLM, config: dict[str, Any], tokenizer_dir: str | Path, step: int,
    stream: TokenStream, history: History,
) -> None:  # fmt: skip
    """A resume point small enough to carry between machines: bf16 weights in the HF layout plus the step, data
    position and history (no optimizer moments: a resume from it restarts them)."""
    export_checkpoint(model, config, tokenizer_dir, path)
    state = {"step": step, "data": stream.position(), "history": asdict(history)}
    (path / PORTABLE_STATE_FILE).write_text(json.dumps(state) + "\n")


def load_portable(path: Path, model: JetNemotronForCausalLM, stream: TokenStream) -> tuple[int, History]:
    device = next(model.parameters()).device
    model.load_state_dict(load_model(path, dtype="float32", device=device).state_dict())
    state = json.loads((path / PORTABLE_STATE_FILE).read_text())
    stream.seek(**state["data"])
    history = History(**{k: [tuple(x) for x in v] for k, v in state["history"].items()})
    return state["step"], history


def plot_curve(history: History, path: Path, title: str = "") -> bool:
    """Train loss (and a moving average) and held-out loss per step; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if history.train:
        steps, losses = zip(*history.train, strict=True)
        ax.plot(steps, losses, color="#9ecae1", linewidth=0.6, label="train")
        window = max(1, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1 :], smooth, color="#08519c", linewidth=1.4, label=f"train (mean of {window})")
    if history.heldout:
        steps, losses = zip(*history.heldout, strict=True)
        ax.plot(steps, losses, "o-", color="#e6550d", markersize=3, label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def export_checkpoint(
    model: JetNemotronForCausalLM,
    config: dict[str, Any],
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write config.json, model.safetensors (sharded with an index above `max_shard_bytes`; no lm_head.weight; A_log
    and dt_bias in fp32) and the tokenizer files: the layout `jetserve.model.loader.load_model` reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if not src.is_file():
            raise ValueError(f"tokenizer: {src} is missing")
        shutil.copyfile(src, out / name)
    generation = json.loads((out / "generation_config.json").read_text())
    eos = generation.get("eos_token_id")
    config = config | {
        "bos_token_id": generation.get("bos_token_id"),
        "eos_token_id": eos[-1] if isinstance(eos, list) else eos,
        "torch_dtype": {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {}
    for name, param in model.state_dict().items():
        keep_fp32 = name.rsplit(".", 1)[-1] in FP32_PARAMETERS
        tensors[name] = param.detach().to("cpu", torch.float32 if keep_fp32 else dtype).contiguous()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def _progress(total: int, initial: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc="pretrain", unit="step", mininterval=5.0, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Train until max_steps (then evaluate and export) or until the time budget runs out (then save and pause).
    Returns 0 either way; `out/done` exists once training has finished."""
    start_time = time.monotonic()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = HFTokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json")).get_vocab_size(True)
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig()) if getattr(args, k, None) is not None})
    if cfg.gdr_impl not in GDR_IMPLS:
        raise ValueError(f"--gdr-impl: {cfg.gdr_impl!r} is not one of {', '.join(GDR_IMPLS)}")
    if args.init:
        config = json.loads((Path(args.init) / "config.json").read_text())
        for key in ("bos_token_id", "eos_token_id", "torch_dtype"):
            config.pop(key, None)
    else:
        config = preset(args.config, vocab_size)
    if config["vocab_size"] < vocab_size:
        raise ValueError(f"vocab_size: the model's {config['vocab_size']} is smaller than the tokenizer's {vocab_size}")
    torch.manual_seed(cfg.seed)
    model = build_model(config, device, cfg.seed)
    if args.init:
        model.load_state_dict(load_model(args.init, dtype="float32", device=device).state_dict())
    opt = build_optimizer(model, cfg)
    stream = TokenStream(load_tokens(args.data), cfg.seq_len, cfg.seed)
    heldout = load_tokens(args.heldout) if args.heldout else None
    state_path = out / STATE_FILE
    step, history = 0, History()
    portable = Path(args.portable) if args.portable else None
    if state_path.is_file():
        step, history = load_state(state_path, model, opt, stream)
        print(f"pretrain: resumed {state_path} at step {step}", file=sys.stderr)
    elif portable is not None and (portable / PORTABLE_STATE_FILE).is_file():
        step, history = load_portable(portable, model, stream)
        print(f"pretrain: resumed the portable state {portable} at step {step} (fresh AdamW moments)", file=sys.stderr)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"pretrain: {num_params / 1e6:.2f} M parameters, {stream.num_rows} rows of {cfg.seq_len} tokens, "
          f"{cfg.max_steps} steps of {cfg.batch_size} rows on {device}", file=sys.stderr)  # fmt: skip
    bar = _progress(cfg.max_steps, step)
    budget_s = args.max_minutes * 60 if args.max_minutes is not None else math.inf
    paused = False
    while step < cfg.max_steps:
        loss = train_step(model, opt, stream.next_batch(cfg.batch_size), step, cfg)
        if not math.isfinite(loss):
            raise RuntimeError(f"pretrain: loss became {loss} at step {step}; lower --lr")
        step += 1
        history.train.append((step, loss))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr_at(step - 1, cfg):.2e}", refresh=False)
        if heldout is not None and (step % cfg.eval_every == 0 or step == cfg.max_steps):
            history.heldout.append((step, evaluate(model, heldout, cfg)))
        out_of_time = time.monotonic() - start_time > budget_s
        if step % cfg.save_every == 0 or step == cfg.max_steps or out_of_time:
            save_state(state_path, model, opt, step, stream, history, cfg, config)
            if portable is not None:
                save_portable(portable, model, config, args.tokenizer, step, stream, history)
            plot_curve(history, out / "loss.png", title=f"{out.name}: {num_params / 1e6:.1f} M parameters")
        if out_of_time and step < cfg.max_steps:
            paused = True
            break
    if bar is not None:
        bar.close()
    summary = {"step": step, "max_steps": cfg.max_steps, "num_parameters": num_params}
    if history.train:
        summary["train_loss"] = float(np.mean([loss for _, loss in history.train[-50:]]))
    if history.heldout:
        summary["heldout_loss"] = history.heldout[-1][1]
        summary["heldout_perplexity"] = math.exp(history.heldout[-1][1])
    if not plot_curve(history, out / "loss.png", title=f"{out.name}: {num_params / 1e6:.1f} M parameters"):
        summary["loss_curve"] = "not drawn: matplotlib is not installed"
    if paused:
        print(f"pretrain: PAUSED at step {step}/{cfg.max_steps} (time budget); run the same command to resume")
    else:
        if args.export:
            export_checkpoint(model, config, args.tokenizer, args.export)
            summary["export"] = str(args.export)
        (out / "done").write_text(json.dumps(summary) + "\n")
        print(f"pretrain: DONE at step {step}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jetserve.train.pretrain", description=__doc__)
    p.add_argument("--data", action="append", required=True, help="token file (.npy); FILE:K repeats it K times")
    p.add_argument("--heldout", action="append", help="held-out token file(s) (.npy) for perplexity")
    p.add_argument("--tokenizer", required=True, help="folder with tokenizer.json, tokenizer_config.json, ...")
    p.add_argument("--config", default="default", help="default | micro | path to a config.json")
    p.add_argument("--init", help="start from this HF checkpoint's weights (a later training phase)")
    p.add_argument("--out", required=True, help="run folder: state.pt, loss.png, summary.json, done")
    p.add_argument("--export", help="write the trained model here (HF layout) when training finishes")
    p.add_argument("--max-minutes", type=float, help="save and pause after this many minutes (resume: rerun)")
    p.add_argument("--portable", help="also keep a small bf16 resume point here (used when OUT has no state.pt)")
    p.add_argument("--device")
    for name, default in asdict(TrainConfig()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=None, help=f"default {default}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"pretrain: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
