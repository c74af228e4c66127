"""Reading Envoy's ext_proc messages (headers, metadata) and what a traced response's span
shows."""

from __future__ import annotations

from epp._proto import ext_proc_pb2
from epp.lifecycle import Outcome
from epp.wire import LB_NAMESPACE, SERVED, SUBSET_HINT_KEY, SUBSET_HINT_NAMESPACE


def span_attributes(outcome: Outcome) -> dict[str, object]:
    """What a traced response's span shows (epp.tracing)."""
    attributes: dict[str, object] = {
        "http.response.status_code": outcome.status,
        "epp.response.complete": outcome.complete,
        "epp.response.streamed": outcome.streamed,
    }
    optional = {
        "epp.served_endpoint": outcome.served,
        "epp.ttft_seconds": outcome.ttft,
        "epp.tpot_seconds": outcome.tpot,
    }
    usage = outcome.usage
    if usage is not None:
        optional["gen_ai.usage.input_tokens"] = usage.prompt
        optional["gen_ai.usage.output_tokens"] = usage.completion
        optional["epp.usage.cached_tokens"] = usage.cached
    attributes.update((k, v) for k, v in optional.items() if v is not None)
    return attributes


def read_headers(
    message: ext_proc_pb2.HttpHeaders, into: dict[str, str], only: frozenset[str] | None = None
) -> dict[str, str]:
    """The headers of ``message`` (``only``: just those, the others' values left unread)."""
    for h in message.headers.headers:
        key = h.key
        if only is not None and key not in only:
            continue
        raw = h.raw_value  # each read copies the bytes out of the message
        into[key] = raw.decode("utf-8", "replace") if raw else h.value
    return into


def served_metadata(message: ext_proc_pb2.ProcessingRequest) -> str | None:
    """The served endpoint as GIE gateways report it (``envoy.lb`` metadata), or None."""
    if not message.HasField("metadata_context"):
        return None
    namespace = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
    # GIE names the metadata key like the header.
    if namespace is None or SERVED not in namespace.fields:
        return None
    return namespace.fields[SERVED].string_value or None


def subset_hint(message: ext_proc_pb2.ProcessingRequest) -> list[str] | None:
    """The gateway's allowed endpoints (``envoy.lb.subset_hint``), or None when absent."""
    if not message.HasField("metadata_context"):
        return None
    namespace = message.metadata_context.filter_metadata.get(SUBSET_HINT_NAMESPACE)
    if namespace is None or SUBSET_HINT_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_HINT_KEY]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values]
    return [a.strip() for a in value.string_value.split(",") if a.strip()]
