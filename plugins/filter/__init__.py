"""The built-in filters: each narrows the candidates before the scorers run (one module per filter)."""
