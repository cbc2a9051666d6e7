"""The OpenAI-compatible HTTP server over the engine, its metrics, and the serving benchmark (`jetserve serve`,
`jetserve bench serving`)."""
