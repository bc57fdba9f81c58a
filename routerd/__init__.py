"""routerd: one dependable daemon in front of many vLLM servers."""

__version__ = "0.1.0"
__all__ = ["__version__"]
