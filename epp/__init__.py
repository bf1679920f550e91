"""epp: an Endpoint Picker for LLM inference, as an Envoy ext_proc service.

See README.md for the architecture. Plugin authors: :mod:`epp.scheduling.runner` is the plugin API.
"""

__version__ = "0.1.0"
