"""Envoy on the gateway side: bootstrap files that put this picker in front of a pool (see :mod:`.bootstrap`)."""
