"""The edge: Envoy's ext_proc protocol, request parsing, and the one table of HTTP answers.

Nothing outside this package speaks ext_proc or knows an HTTP status code. See
:mod:`epp.extproc.processor` for the stream's state machine.
"""
