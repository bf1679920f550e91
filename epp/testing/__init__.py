"""Test and demo harness: a real Envoy, simple backends, helpers shared by tests/, bench/ and the demo."""
