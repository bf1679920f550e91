"""The built-in data producers: per-request data computed before scheduling (one module per producer)."""
