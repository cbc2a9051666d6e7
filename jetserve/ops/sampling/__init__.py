"""Sampling on the device: greedy/temperature/top-k/top-p/min-p draws reproducible per request, and log-probs."""

from jetserve.ops.sampling.reference import compute_logprobs, sample, top_logprobs

__all__ = ["compute_logprobs", "sample", "top_logprobs"]
