"""epp: an endpoint picker for LLM inference fleets.

Envoy streams each request to epp over gRPC ext_proc; epp reads the OpenAI body, picks the
replica that will serve it fastest and answers with ``x-gateway-destination-endpoint``.
"""

__version__ = "0.1.0"
