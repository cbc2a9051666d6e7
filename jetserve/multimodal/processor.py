"""Image preprocessing as a jet_vlm checkpoint's processor does it, on the host (never inside the engine's step loop):
data-URL decoding with limits, dynamic tiling, resize/rescale/normalise (SigLIP image processor), and expansion of
each image placeholder token into the run of tokens its embeddings fill.

Layout (the NVILA processor JetVLM adopted): a request with one image cuts it into tiles (the tile grid whose aspect
ratio is closest to the image's, `min_tiles`..`max_tiles` tiles, plus a thumbnail of the whole image when there is
more than one); a request with several images gives each one tile (the image squashed to the tile size). Each tile
becomes `tokens_per_tile` image tokens followed by a line feed; with a single image each tile is followed by a second
line feed (NVILA's processor appends "\\n" after every tile's placeholder in that case).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jetserve.config import VLMConfig
from jetserve.multimodal.inputs import ImageInputs

DATA_URL_RE = re.compile(r"data:(?P<mime>image/[A-Za-z0-9.+-]+)?(?P<params>(;[^;,]*)*?);base64,", re.ASCII)


class ImageError(ValueError):
    """An image the request cannot use; the message names the problem (the server adds where it was)."""


@dataclass(frozen=True)
class ImageLimits:
    max_images_per_request: int = 16
    max_image_bytes: int = 20 << 20  # encoded size of one image
    max_image_pixels: int = 40_000_000  # width x height of one decoded image (decompression-bomb guard)


@dataclass(frozen=True)
class ProcessorConfig:
    """preprocessor_config.json (SigLIP image processor keys) plus the tiling keys (`image_aspect_ratio`: "dynamic"
    tiles single images, "resize" never tiles; `min_tiles`, `max_tiles`). Defaults are the NVILA processor's."""

    tile_size: int
    resample: int = 3  # PIL bicubic
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    is_dynamic: bool = True
    min_tiles: int = 1
    max_tiles: int = 12

    @classmethod
    def from_pretrained(cls, path: str | Path, config: VLMConfig) -> ProcessorConfig:
        """Read `path/preprocessor_config.json` (the defaults when the checkpoint has none)."""
        file = Path(path) / "preprocessor_config.json"
        data: dict[str, Any] = json.loads(file.read_text()) if file.is_file() else {}
        size = data.get("size") or {}
        height = size.get("height", size.get("shortest_edge", config.vision.image_size))
        width = size.get("width", height)
        if height != width or height != config.vision.image_size:
            raise ValueError(
                f"{file}: size {height}x{width} must be square and equal the vision tower's image_size "
                f"{config.vision.image_size}"
            )
        aspect = data.get("image_aspect_ratio", "dynamic")
        if aspect not in ("dynamic", "resize"):
            raise ValueError(f"{file}: image_aspect_ratio {aspect!r} is not supported (dynamic, resize)")
        processor = cls(
            tile_size=int(height),
            resample=int(data.get("resample", 3)),
            do_resize=bool(data.get("do_resize", True)),
            do_rescale=bool(data.get("do_rescale", True)),
            rescale_factor=float(data.get("rescale_factor", 1 / 255)),
            do_normalize=bool(data.get("do_normalize", True)),
            image_mean=tuple(float(x) for x in data.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(float(x) for x in data.get("image_std", (0.5, 0.5, 0.5))),
            is_dynamic=aspect == "dynamic",
            min_tiles=int(data.get("min_tiles", 1)),
            max_tiles=int(data.get("max_tiles", 12)),
        )
        if not 1 <= processor.min_tiles <= processor.max_tiles:
            raise ValueError(f"{file}: need 1 ≤ min_tiles ({processor.min_tiles}) ≤ max_tiles ({processor.max_tiles})")
        return processor


def decode_data_url(url: str, limits: ImageLimits) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL."""
    match = DATA_URL_RE.match(url)
    if match is None:
        raise ImageError("not a base64 data URL (expected data:image/<type>;base64,<data>)")
    payload = url[match.end() :]
    if len(payload) > (limits.max_image_bytes + 2) // 3 * 4 + 4:
        raise ImageError(f"image too large: over {limits.max_image_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data URL's base64 payload does not decode") from None


def decode_image(data: bytes, limits: ImageLimits) -> Any:
    """Encoded bytes → an RGB PIL image, refusing oversized files and images before their pixels are decoded."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_image_bytes:
        raise ImageError(f"image too large: {len(data)} bytes (at most {limits.max_image_bytes})")
    if not data:
        raise ImageError("empty image")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise ImageError(f"image too large: {width}x{height} pixels (at most {limits.max_image_pixels})")
        image.load()
        return image.convert("RGB")
    except ImageError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"not a decodable image ({type(e).__name__}: {e})") from None


def tile_grid(width: int, height: int, tile_size: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of the tile grid for an image: the grid with min_tiles..max_tiles tiles whose aspect ratio is
    closest to the image's; on a tie the later (larger) grid wins when the image covers more than half its area."""
    grids = {
        (i, j)
        for n in range(min_tiles, max_tiles + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if min_tiles <= i * j <= max_tiles
    }
    aspect = width / height
    best, best_diff = (1, 1), float("inf")
    for grid in sorted(grids, key=lambda g: g[0] * g[1]):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and width * height > 0.5 * tile_size * tile_size * grid[0] * grid[1]:
            best = grid
    return best


def tile_image(image: Any, tile_size: int, min_tiles: int, max_tiles: int) -> list[Any]:
    """Cut a PIL image into tiles of tile_size² (row-major), plus a whole-image thumbnail when there are several."""
    columns, rows = tile_grid(image.width, image.height, tile_size, min_tiles, max_tiles)
    resized = image.resize((columns * tile_size, rows * tile_size))
    tiles = [
        resized.crop((c * tile_size, r * tile_size, (c + 1) * tile_size, (r + 1) * tile_size))
        for r in range(rows)
        for c in range(columns)
    ]
    if len(tiles) > 1:
        tiles.append(image.resize((tile_size, tile_size)))
    return tiles


class ImageProcessor:
    """Turns a prompt's token ids and its decoded images into the expanded ids and the ImageInputs the engine takes."""

    def __init__(self, config: VLMConfig, processor: ProcessorConfig, line_feed_id: int) -> None:
        self.config = config
        self.processor = processor
        self.image_token_id = config.image_token_id
        self.video_token_id = config.video_token_id
        self.tokens_per_tile = config.vision.tokens_per_tile
        self.line_feed_id = line_feed_id

    @classmethod
    def from_pretrained(cls, path: str | Path, line_feed_id: int) -> ImageProcessor:
        config = VLMConfig.from_hf(path)
        return cls(config, ProcessorConfig.from_pretrained(path, config), line_feed_id)

    def tiles(self, images: list[Any]) -> list[torch.Tensor]:
        """Per image, its normalised tiles [n_i, 3, S, S] float32 (a single image is tiled when configured)."""
        p = self.processor
        out = []
        for image in images:
            if len(images) == 1 and p.is_dynamic:
                pieces = tile_image(image, p.tile_size, p.min_tiles, p.max_tiles)
            else:
                pieces = [image]
            out.append(torch.stack([self._normalise(piece) for piece in pieces]))
        return out

    def _normalise(self, image: Any) -> torch.Tensor:
        """One PIL tile → [3, S, S] float32: resize (bicubic), rescale, normalise, as SiglipImageProcessor does."""
        p = self.processor
        if p.do_resize and image.size != (p.tile_size, p.tile_size):
            image = image.resize((p.tile_size, p.tile_size), resample=p.resample)
        pixels = np.asarray(image, dtype=np.float64)  # [S, S, 3]
        if p.do_rescale:
            pixels = pixels * p.rescale_factor
        pixels = pixels.astype(np.float32)
        if p.do_normalize:
            pixels = (pixels - np.asarray(p.image_mean, np.float32)) / np.asarray(p.image_std, np.float32)
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))

    def expand(self, token_ids: list[int], tiles: list[torch.Tensor]) -> tuple[list[int], ImageInputs]:
        """Replace the k-th image token of `token_ids` with image k's run (see the module docstring); the number of
        image tokens must equal the number of images."""
        assert tiles, "a prompt without images needs no expansion"
        count = sum(t == self.image_token_id for t in token_ids)
        if count != len(tiles):
            raise ImageError(f"the prompt has {count} image placeholder(s) for {len(tiles)} image(s)")
        if self.video_token_id is not None and self.video_token_id in token_ids:
            raise ImageError("the prompt holds the video placeholder token; video input is not supported")
        suffix = [self.line_feed_id] * (2 if len(tiles) == 1 else 1)
        out: list[int] = []
        positions: list[int] = []
        images = iter(tiles)
        for token in token_ids:
            if token != self.image_token_id:
                out.append(token)
                continue
            for _ in range(next(images).shape[0]):
                positions.extend(range(len(out), len(out) + self.tokens_per_tile))
                out += [self.image_token_id] * self.tokens_per_tile + suffix
        return out, ImageInputs(torch.cat(tiles), np.asarray(positions, dtype=np.int64), len(tiles))
