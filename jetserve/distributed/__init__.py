"""Tensor parallelism: process groups, the sharded layers, weight sharding at load, and the multi-rank engine."""
