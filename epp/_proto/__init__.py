"""Generated protobuf/gRPC stubs for Envoy's ext_proc v3 API (subset).

Generated, do not edit: regenerate with ``make protos`` (``python tools/gen_protos.py``)
from the sources in ``protos/epp/_proto/``.
"""
