"""The Jet-Nemotron model, written against `jetserve.ops` only."""
