"""Helpers the VLM tests share (a module of its own: `conftest` names collide across test folders)."""

from __future__ import annotations

import base64
import io

import numpy as np

from jetserve.engine.config import EngineConfig

MAX_MODEL_LEN = 512


def png_bytes(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def vlm_engine_config(checkpoint: str, **overrides) -> EngineConfig:
    fields = dict(model=checkpoint, dtype="float32", device="cpu", max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
                  cpu_cache_bytes=64 << 20)  # fmt: skip
    return EngineConfig(**(fields | overrides))
