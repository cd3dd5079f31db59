"""titan-pipe: train -> convert -> export -> evaluate for LLaMA-family models."""

__version__ = "0.1.0"
