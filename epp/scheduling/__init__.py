"""Scheduling: the runner that drives the plugins, the plugin registry, and the config that builds them."""
