"""ImageInputs: one request's images on their way through the engine (tiles → embeddings computed once), and the
splice of those embeddings into a prefill batch in place of the placeholder tokens, chunk by chunk."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ImageInputs:
    """The images of one request, shared by all its choices. Row r of `embeds` belongs at prompt position
    `positions[r]`; positions are sorted, so any chunk of the prompt takes one contiguous run of rows."""

    pixel_values: torch.Tensor  # [N_tiles, C, S, S] float32 (host): normalised tiles, all images in prompt order
    positions: np.ndarray  # [M] int64, ascending: prompt positions of the image placeholder tokens
    num_images: int
    embeds: torch.Tensor | None = None  # [M, hidden] on the model's device once the engine encoded the tiles

    def __post_init__(self) -> None:
        assert self.positions.ndim == 1 and np.all(np.diff(self.positions) > 0), "positions must be ascending"

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def rows_in(self, start: int, end: int) -> tuple[int, int]:
        """The run [a, b) of embedding rows whose positions fall in the prompt span [start, end)."""
        a, b = np.searchsorted(self.positions, [start, end])
        return int(a), int(b)


def spliced_input_embeds(
    embedding: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    images: Sequence[ImageInputs | None],
    start_positions: Sequence[int],
    num_new_tokens: Sequence[int],
) -> torch.Tensor | None:
    """The input embeddings [T, hidden] of a packed prefill batch (`input_ids` [T], embedded by `embedding`; sequence i
    brings positions [start_positions[i], + num_new_tokens[i])) with each image row placed at its placeholder
    position; None when no chunk of this batch covers an image placeholder (the ids' own embeddings serve then)."""
    rows: list[np.ndarray] = []
    pieces: list[torch.Tensor] = []
    offset = 0
    for inputs, start, n in zip(images, start_positions, num_new_tokens, strict=True):
        if inputs is not None:
            a, b = inputs.rows_in(start, start + n)
            if b > a:
                assert inputs.embeds is not None, "the engine encodes a request's images before it runs"
                rows.append(inputs.positions[a:b] - start + offset)
                pieces.append(inputs.embeds[a:b])
        offset += n
    if not rows:
        return None
    assert offset == input_ids.shape[0]
    embeds = embedding(input_ids)  # [T, hidden]
    index = torch.from_numpy(np.concatenate(rows)).to(embeds.device, non_blocking=True)  # [R]
    embeds[index] = torch.cat(pieces).to(embeds.dtype)
    return embeds
