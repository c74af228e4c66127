"""The grpc.aio ``ExternalProcessor`` service: one :class:`StreamHandler` per Envoy stream."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from epp import errors
from epp._proto import ext_proc_pb2, ext_proc_pb2_grpc
from epp.extproc import responses
from epp.extproc.stream import StreamHandler
from epp.observability import IN_FLIGHT
from epp.request import InferenceRequest
from epp.router import Router

log = logging.getLogger("epp.extproc")

_INTERNAL = errors.RequestError(
    500, "epp failed to process this request; see epp's log.", type="server_error"
)


class ExtProcServicer(ext_proc_pb2_grpc.ExternalProcessorServicer):
    def __init__(self, router: Router) -> None:
        self._router = router

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_proc_pb2.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_proc_pb2.ProcessingResponse]:
        handler = StreamHandler(self._router)
        IN_FLIGHT.inc()
        try:
            async for message in request_iterator:
                try:
                    answers = handler.handle(message)
                    if handler.pending is not None:
                        answers = await self._admit(handler, handler.pending.request)
                except Exception:
                    # A bug must cost one request a clear 500, never the process or a hang.
                    log.exception("unexpected error handling an ext_proc message")
                    yield responses.error_response(_INTERNAL)
                    return
                for answer in answers:
                    yield answer
                # Bookkeeping after the pick, off the answer path: the answer is sent.
                handler.settle()
        finally:
            # Envoy closes the stream when the HTTP exchange ends (response sent or reset), so
            # this is where the request stops counting against its endpoint (the one that
            # served it, after a retry), and where an unfinished response is recorded.
            handler.settle()
            handler.close()
            if handler.ticket is not None:
                self._router.finish(handler.ticket)
            IN_FLIGHT.dec()
            handler.end_trace()

    async def _admit(
        self, handler: StreamHandler, request: InferenceRequest
    ) -> Sequence[ext_proc_pb2.ProcessingResponse]:
        """Await the request's preparation and flow control, then route or refuse it."""
        trace = handler.context.trace
        started = time.perf_counter() if trace is not None else 0.0
        await self._router.prepare(request, handler.context.generation)
        refusal = None
        try:
            # Held here while the pool is saturated; a client that goes away cancels this
            # coroutine, which takes it out of the queue.
            await self._router.admit(handler.context, request)
        except errors.RequestError as error:
            refusal = error
        if trace is not None:
            trace.step(
                "epp.admission",
                started,
                {
                    "epp.admission.mode": handler.context.generation.config.flow_control.mode,
                    "epp.priority": request.priority,
                },
                None if refusal is None else refusal.message,
            )
        return handler.resume() if refusal is None else handler.refuse_pending(refusal)
