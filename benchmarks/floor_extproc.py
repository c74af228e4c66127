"""The floor ext_proc: the least work any endpoint picker must do, as fast as Python does it.

Per request it reads every request header once, parses the JSON body once with msgspec (as fast
as orjson at 1 KB and faster at 8 KB on this machine, docs/overhead.md; already epp's parser),
refuses a body that is not a JSON object naming its model (400, OpenAI-style), and picks the
next of its ``--destination`` addresses in turn. The answer is epp's: the
``x-gateway-destination-endpoint`` header and the same value in ``envoy.lb`` metadata (built
once per destination in buffered mode), the body echoed in full duplex, and the response-path
messages `epp envoy-config` turns on answered unread (the stream loop is the no-op's,
:class:`benchmarks.noop_extproc.NoopProcessor`). What it leaves out is everything epp decides
with: scores, metrics, state, and any bookkeeping of the response.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from benchmarks.noop_extproc import NoopProcessor, serve
from epp._proto import ext_proc_pb2
from epp.errors import bad_request, unknown_path

_decode = msgspec.json.Decoder().decode


class FloorProcessor(NoopProcessor):
    reads_body = True

    def __init__(self, destinations: Sequence[str]) -> None:
        super().__init__(destinations)
        self._turn = -1

    def decide(self, headers: ext_proc_pb2.HttpHeaders, body: bytes) -> str:
        fields = {h.key: h.raw_value for h in headers.headers.headers}
        path = fields.get(":path", b"")
        if not path.endswith(b"/completions"):
            raise unknown_path(fields.get(":method", b"").decode(), path.decode())
        try:
            request = _decode(body)
        except msgspec.DecodeError as error:
            raise bad_request(f"The body is not valid JSON: {error}") from None
        if not isinstance(request, dict) or not isinstance(request.get("model"), str):
            raise bad_request("The body must be a JSON object with a string 'model'.", "model")
        self._turn = (self._turn + 1) % len(self.destinations)
        return self.destinations[self._turn]


if __name__ == "__main__":
    serve("floor", FloorProcessor)
