"""Tensor parallelism: process groups, the sharded layers and weight sharding at load (the multi-rank engine that
uses them is `jetserve.engine.tensor_parallel`)."""
