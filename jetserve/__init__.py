"""jetserve: a fast, exact inference engine for Jet-Nemotron hybrid language models."""

__version__ = "0.1.0"
