"""Request control: one request's way from parsed to answered (admission, scheduling, accounting, hooks)."""
