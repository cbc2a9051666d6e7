"""Image preprocessing: data URLs and limits, the tile grid choice, normalisation against transformers'
SiglipImageProcessor, and the placeholder expansion layout."""

import base64
import io

import numpy as np
import pytest
import torch
from vlm_helpers import data_url, png_bytes

from jetserve.config import VLMConfig
from jetserve.multimodal.processor import (
    ImageError,
    ImageLimits,
    ImageProcessor,
    ProcessorConfig,
    decode_data_url,
    decode_image,
    tile_grid,
    tile_image,
)


def test_decode_and_limits():
    png = png_bytes(7, 5, seed=0)
    limits = ImageLimits(max_image_bytes=10_000, max_image_pixels=100)
    assert decode_data_url(data_url(png), limits) == png
    assert decode_image(png, limits).size == (7, 5)
    with pytest.raises(ImageError, match="base64"):
        decode_data_url("data:image/png;base64,@@@", limits)
    with pytest.raises(ImageError, match="not a base64 data URL"):
        decode_data_url("data:text/plain,hello", limits)
    with pytest.raises(ImageError, match="not a decodable image"):
        decode_image(b"definitely not an image", limits)
    with pytest.raises(ImageError, match="too large: 20x20 pixels"):
        decode_image(png_bytes(20, 20, seed=1), limits)
    with pytest.raises(ImageError, match="too large"):
        decode_image(png_bytes(40, 40, seed=2), ImageLimits(max_image_bytes=100))
    with pytest.raises(ImageError, match="too large"):
        decode_data_url(data_url(b"x" * 20_000), limits)


def test_tile_grid():
    # Closest aspect ratio; on a tie the larger grid wins only when the image covers over half of its area.
    assert tile_grid(800, 400, tile_size=40, min_tiles=1, max_tiles=12) == (4, 2)
    assert tile_grid(800, 400, tile_size=384, min_tiles=1, max_tiles=12) == (2, 1)
    assert tile_grid(100, 1000, tile_size=384, min_tiles=1, max_tiles=12) == (1, 10)
    assert tile_grid(500, 500, tile_size=384, min_tiles=1, max_tiles=12) == (1, 1)
    assert tile_grid(500, 500, tile_size=100, min_tiles=2, max_tiles=4) == (2, 2)


def test_tile_image_and_thumbnail():
    from PIL import Image

    image = Image.open(io.BytesIO(png_bytes(80, 40, seed=3))).convert("RGB")
    tiles = tile_image(image, tile_size=20, min_tiles=1, max_tiles=12)
    assert len(tiles) == 4 * 2 + 1 and all(t.size == (20, 20) for t in tiles)  # grid (4, 2) + the thumbnail
    resized = np.asarray(image.resize((80, 40)))
    np.testing.assert_array_equal(np.asarray(tiles[5]), resized[20:40, 20:40])  # row-major: row 1, column 1
    np.testing.assert_array_equal(np.asarray(tiles[-1]), np.asarray(image.resize((20, 20))))


def test_normalise_matches_siglip_image_processor(vlm_checkpoint):
    transformers = pytest.importorskip("transformers")
    processor = ImageProcessor.from_pretrained(vlm_checkpoint, line_feed_id=10)
    image = decode_image(png_bytes(57, 33, seed=4), ImageLimits())
    ours = processor._normalise(image)  # squashed to 40x40, bicubic
    hf = transformers.SiglipImageProcessor(size={"height": 40, "width": 40}, resample=3)
    expected = torch.as_tensor(np.asarray(hf(image, return_tensors="np")["pixel_values"][0]))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_expand_layout(vlm_checkpoint):
    config = VLMConfig.from_hf(vlm_checkpoint)
    processor = ImageProcessor(config, ProcessorConfig(tile_size=40, max_tiles=4), line_feed_id=10)
    img, lf, n = config.image_token_id, 10, 9
    wide = decode_image(png_bytes(160, 40, seed=5), ImageLimits())  # aspect 4 → a 4x1 grid + thumbnail
    (tiles,) = processor.tiles([wide])
    assert tiles.shape == (5, 3, 40, 40)
    ids, inputs = processor.expand([1, img, 2], [tiles])
    # One image: each tile is n image tokens and two line feeds.
    assert ids == [1] + ([img] * n + [lf, lf]) * 5 + [2]
    assert inputs.positions.tolist() == [1 + t * (n + 2) + k for t in range(5) for k in range(n)]
    assert inputs.num_images == 1 and inputs.pixel_values.shape == (5, 3, 40, 40)
    # Several images: one tile each (no tiling), one line feed.
    small = decode_image(png_bytes(10, 30, seed=6), ImageLimits())
    both = processor.tiles([wide, small])
    assert [t.shape[0] for t in both] == [1, 1]
    ids, inputs = processor.expand([img, 3, img], both)
    assert ids == [img] * n + [lf, 3] + [img] * n + [lf]
    assert inputs.positions.tolist() == list(range(n)) + list(range(n + 2, 2 * n + 2))
    with pytest.raises(ImageError, match="2 image placeholder"):
        processor.expand([img, img], [tiles])
    with pytest.raises(ImageError, match="video"):
        processor.expand([img, config.video_token_id], [tiles])


def test_data_url_roundtrip_mimes():
    png = png_bytes(3, 3, seed=7)
    for mime in ("image/png", "image/jpeg", "image/webp"):
        url = f"data:{mime};base64,{base64.b64encode(png).decode()}"
        assert decode_data_url(url, ImageLimits()) == png
