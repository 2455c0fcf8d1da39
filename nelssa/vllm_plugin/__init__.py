"""vLLM plugin entry point (``vllm.general_plugins``)."""


def register() -> None:
    """Called by vLLM in every process; NELSSA's components register themselves here."""
