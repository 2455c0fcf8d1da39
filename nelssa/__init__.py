"""NELSSA for vLLM: mixed-length serving with long-context sparse attention on a host memory tier."""

__version__ = "0.1.0"
