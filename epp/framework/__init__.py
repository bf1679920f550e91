"""The plugin API (being assembled: see epp.scheduling.runner for now)."""
