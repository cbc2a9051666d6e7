"""RMSNorm (plain and fused with the residual add), the JetBlock's per-head gated RMSNorm, and silu_and_mul."""

from jetserve.ops.norm.reference import gated_rms_norm, rms_norm, silu_and_mul

__all__ = ["gated_rms_norm", "rms_norm", "silu_and_mul"]
