"""P/D serving with NELSSA: the length-routing OpenAI proxy (``nelssa-proxy``) and the launcher's helpers."""
