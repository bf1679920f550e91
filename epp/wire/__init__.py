"""gRPC over HTTP/2 on asyncio: the picker's own servers (:mod:`epp.wire.server`), their connections
(:mod:`epp.wire.http2`) and the standard health service (:mod:`epp.wire.health`).

A leaf library: it imports nothing of the rest of epp. Why it exists instead of grpc.aio, and what
it costs, is in :mod:`epp.extproc.processor`'s docstring ("Transport").
"""
