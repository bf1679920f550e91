"""The built-in scorers: each gives every candidate a score in [0, 1] (one module per scorer)."""
