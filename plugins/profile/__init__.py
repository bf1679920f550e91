"""The built-in profile handler."""
