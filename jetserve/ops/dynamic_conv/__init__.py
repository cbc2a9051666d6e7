"""Dynamic convolution (JetBlock step 2): varlen prefill, decode, tree verify and commit on the conv-window pool."""

from jetserve.ops.dynamic_conv.reference import (
    dynamic_conv_commit,
    dynamic_conv_decode,
    dynamic_conv_prefill,
    dynamic_conv_verify,
)

__all__ = ["dynamic_conv_commit", "dynamic_conv_decode", "dynamic_conv_prefill", "dynamic_conv_verify"]
