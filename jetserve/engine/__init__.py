"""The engine: continuous batching over paged K/V and the JetBlock state pool."""
