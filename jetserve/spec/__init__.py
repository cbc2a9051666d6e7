"""EAGLE-3 speculative decoding: the draft model, the draft tree, and (with the engine) drafting and verification."""
