"""The embedded default model and its EAGLE-3 draft (trained by `jetserve.train`; see default-model/README.md).

`--model default` and `--draft default` on the command line name them.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path(__file__).parent / "default-model"
DEFAULT_DRAFT = Path(__file__).parent / "default-draft"
DEFAULT_NAME = "default"


def resolve_checkpoint(name: str | None, what: str) -> str | None:
    """`default` → the embedded checkpoint's folder (`what` is "model" or "draft"); anything else unchanged."""
    if name != DEFAULT_NAME:
        return name
    folder = DEFAULT_MODEL if what == "model" else DEFAULT_DRAFT
    if not (folder / "config.json").is_file():
        raise ValueError(f"--{what} default: the embedded default {what} is missing from this install ({folder})")
    return str(folder)
