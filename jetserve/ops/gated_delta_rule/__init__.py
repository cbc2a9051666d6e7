"""Gated delta rule ops (JetBlock linear attention): prefill, decode, tree verify and commit on pool state slots."""

from __future__ import annotations

from jetserve.ops.gated_delta_rule.reference import (
    gated_delta_rule_commit,
    gated_delta_rule_decode,
    gated_delta_rule_prefill,
    gated_delta_rule_verify,
)

__all__ = [
    "gated_delta_rule_commit",
    "gated_delta_rule_decode",
    "gated_delta_rule_prefill",
    "gated_delta_rule_verify",
]
