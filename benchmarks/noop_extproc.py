"""A no-op ext_proc server: the floor a Python ext_proc stands on, for overhead comparisons.

It answers exactly like epp on the wire (same routing header and metadata, same full-duplex body
echo, and the response messages of the rendered processing mode answered or echoed unread) but
makes no decision: the destination is fixed and no body is parsed.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import grpc

from epp._proto import ext_proc_pb2, ext_proc_pb2_grpc, processing_mode_pb2
from epp.extproc import responses
from epp.server import GRPC_OPTIONS

_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
# Response messages answered unread (epp's response path reads them; the floor does not).
_CONTINUE = {
    "response_headers": responses.CONTINUE_RESPONSE_HEADERS,
    "response_trailers": responses.CONTINUE_RESPONSE_TRAILERS,
    "request_trailers": responses.CONTINUE_REQUEST_TRAILERS,
}


class NoopProcessor(ext_proc_pb2_grpc.ExternalProcessorServicer):
    def __init__(self, destination: str) -> None:
        self.destination = destination
        self.buffered_answer = responses.route_in_body(destination, [])

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_proc_pb2.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc_pb2.ProcessingResponse]:
        full_duplex = response_full_duplex = False
        body: list[bytes] = []
        async for message in request_iterator:
            if message.HasField("protocol_config"):
                full_duplex = message.protocol_config.request_body_mode == _FULL_DUPLEX
                response_full_duplex = message.protocol_config.response_body_mode == _FULL_DUPLEX
            kind = message.WhichOneof("request")
            if kind in _CONTINUE:
                yield _CONTINUE[kind]
            elif kind == "response_body":
                if not response_full_duplex:
                    yield responses.CONTINUE_RESPONSE_BODY
                    continue
                reply = message.response_body
                for answer in responses.body_chunks(reply.body, reply.end_of_stream, True):
                    yield answer
            elif kind == "request_headers" and not full_duplex:
                yield responses.CONTINUE_REQUEST_HEADERS
            elif kind == "request_body":
                if not full_duplex:
                    yield self.buffered_answer
                    continue
                body.append(message.request_body.body)
                if message.request_body.end_of_stream:
                    data = b"".join(body)
                    yield responses.route_in_headers(self.destination, [], len(data))
                    for chunk in responses.body_chunks(data):
                        yield chunk


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--destination", required=True)
    args = parser.parse_args()
    server = grpc.aio.server(options=GRPC_OPTIONS)
    ext_proc_pb2_grpc.add_ExternalProcessorServicer_to_server(
        NoopProcessor(args.destination), server
    )
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    print("noop ext_proc ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
