"""Command-line flags for EngineConfig: one `--field-name` flag per field, so new engine knobs appear unasked."""

from __future__ import annotations

import argparse
import dataclasses

from jetserve.assets import resolve_checkpoint
from jetserve.engine.config import DTYPES, EngineConfig

_SCALARS = {"int": int, "float": float, "str": str}


def positive_int(text: str) -> int:
    """An argparse `type` for a count flag: an int ≥ 1, else a usage error."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be ≥ 1")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
    """Add a flag per EngineConfig field (its default, its type) except the fields in `skip`, which the command
    sets through flags of its own."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type).replace(" ", "")
        optional = kind.endswith("|None")
        kind = kind.removesuffix("|None")
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            continue
        assert kind in _SCALARS, f"EngineConfig.{f.name}: no flag for a field of type {f.type}"
        choices = DTYPES if f.name == "dtype" else None
        help_text = "(default: decided at start)" if optional and f.default is None else "(default: %(default)s)"
        if f.name == "draft":
            help_text = "EAGLE-3 draft folder, or `default` (the embedded default model's draft); speculation on"
        group.add_argument(flag, type=_SCALARS[kind], default=f.default, choices=choices, help=help_text)


def engine_config_from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    """The EngineConfig the flags describe; `overrides` supply the skipped fields (e.g. `model`)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    values |= overrides
    for what in ("model", "draft"):  # `default`: the embedded default model / its draft
        if what in values:
            values[what] = resolve_checkpoint(values[what], what)
    return EngineConfig(**values)
