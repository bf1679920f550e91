"""The built-in pickers: each turns scored candidates into the endpoints to try (one module per picker)."""
