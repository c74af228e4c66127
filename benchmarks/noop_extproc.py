"""A no-op ext_proc server: the floor a Python ext_proc stands on, for overhead comparisons.

It answers exactly like epp on the wire (same routing header and metadata, same full-duplex body
echo, and the response messages of the rendered processing mode answered or echoed unread) but
makes no decision: the destination is fixed and no body is parsed. The stream loop is shared
with :mod:`benchmarks.floor_extproc`, which reads and parses what every picker must.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from epp._proto import ext_proc_pb2, ext_proc_pb2_grpc, processing_mode_pb2
from epp.errors import RequestError
from epp.extproc import responses
from epp.server import GRPC_OPTIONS

_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
# Response messages answered unread (epp's response path reads them; these servers do not).
_CONTINUE = {
    "response_headers": responses.CONTINUE_RESPONSE_HEADERS,
    "response_trailers": responses.CONTINUE_RESPONSE_TRAILERS,
    "request_trailers": responses.CONTINUE_REQUEST_TRAILERS,
}
_NO_HEADERS = ext_proc_pb2.HttpHeaders()


class NoopProcessor(ext_proc_pb2_grpc.ExternalProcessorServicer):
    # Whether decide() reads the buffered body: each read of a bytes field copies it out of the
    # message, and the no-op must not pay for that.
    reads_body = False

    def __init__(self, destinations: Sequence[str]) -> None:
        self.destinations = list(destinations)
        # The buffered answer of each destination, built once (gRPC only serializes it).
        self.buffered_answers = {d: responses.route_in_body(d, []) for d in self.destinations}

    def decide(self, headers: ext_proc_pb2.HttpHeaders, body: bytes) -> str:
        """The request's destination; raises :class:`RequestError` to refuse it. The no-op's
        is fixed: it reads neither the headers nor the body."""
        return self.destinations[0]

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_proc_pb2.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc_pb2.ProcessingResponse]:
        full_duplex = response_full_duplex = False
        headers = _NO_HEADERS
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
            elif kind == "request_headers":
                headers = message.request_headers
                if not full_duplex:
                    yield responses.CONTINUE_REQUEST_HEADERS
            elif kind == "request_body":
                if not full_duplex:
                    data = message.request_body.body if self.reads_body else b""
                elif message.request_body.end_of_stream:
                    body.append(message.request_body.body)
                    data = b"".join(body)
                else:
                    body.append(message.request_body.body)
                    continue
                try:
                    destination = self.decide(headers, data)
                except RequestError as error:
                    yield responses.error_response(error)
                    return
                if not full_duplex:
                    yield self.buffered_answers[destination]
                else:
                    yield responses.route_in_headers(destination, [], len(data))
                    for chunk in responses.body_chunks(data):
                        yield chunk


class SpinProcessor(NoopProcessor):
    """The no-op plus ``spin`` seconds of CPU burnt in a tight loop per request (a tiny working
    set: no data touched, no allocation), to measure what a given amount of per-request
    Python work costs the whole server through gRPC (benchmarks/spin_calibration.py)."""

    def __init__(self, destinations: Sequence[str], spin: float) -> None:
        super().__init__(destinations)
        self.spin = spin

    def decide(self, headers: ext_proc_pb2.HttpHeaders, body: bytes) -> str:
        until = time.thread_time() + self.spin
        while time.thread_time() < until:
            pass
        return self.destinations[0]


def serve(name: str, make: Callable[[list[str]], NoopProcessor]) -> None:
    """Run the processor ``make`` builds from ``--destination`` on ``--port`` under uvloop;
    with ``--spin-us``, a :class:`SpinProcessor` instead."""
    parser = argparse.ArgumentParser(description=f"{name} ext_proc server (benchmarks)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--destination", action="append", required=True, help="repeatable")
    parser.add_argument(
        "--spin-us", type=float, default=0.0, help="CPU µs burnt per request (SpinProcessor)"
    )
    args = parser.parse_args()
    processor = make(args.destination)
    if args.spin_us > 0:
        processor = SpinProcessor(args.destination, args.spin_us / 1e6)

    async def main() -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        ext_proc_pb2_grpc.add_ExternalProcessorServicer_to_server(processor, server)
        server.add_insecure_port(f"127.0.0.1:{args.port}")
        await server.start()
        print(f"{name} ext_proc ready", flush=True)
        await server.wait_for_termination()

    import uvloop

    uvloop.run(main())


if __name__ == "__main__":
    serve("noop", NoopProcessor)
