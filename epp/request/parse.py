"""An OpenAI HTTP request turned into an :class:`InferenceRequest`: the checks on headers alone
(before any body arrives), parsing the body, and writing the engine priority back into it."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

from epp import wire
from epp.errors import (
    RequestError,
    bad_request,
    body_too_large,
    model_not_found,
    unknown_path,
    unsupported_media_type,
)
from epp.request.decode import load_body, too_deep
from epp.request.identity import RequestPolicy, identity, session
from epp.request.inference import InferenceRequest, api_for_path
from epp.request.prompts import PROMPT_READERS, check_encodable, max_tokens, optional


def parse_request(
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    policy: RequestPolicy,
    models: Collection[str] | None = None,
) -> InferenceRequest:
    """:func:`parse_decoded` without the decoded body."""
    return parse_decoded(path, headers, body, policy, models)[0]


def parse_decoded(
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    policy: RequestPolicy,
    models: Collection[str] | None = None,
) -> tuple[InferenceRequest, dict[str, Any]]:
    """Parse an OpenAI request body (returned decoded too, so that nothing decodes it twice);
    raise :class:`~epp.errors.RequestError` if malformed (400) or, when ``models`` are given,
    if it names none of them (404).

    The model is checked before the rest of the body, as OpenAI does (an unknown model is 404
    ``model_not_found`` whatever else the body lacks): the model decides where a request could
    go and which API fields its engine would want, so it is the first thing to get right.
    """
    api = api_for_path(path)
    if api is None:
        raise unknown_path(headers.get(":method", "POST"), path)
    data = load_body(body)

    model = data.get("model")
    if model is None:
        raise bad_request("Missing required field 'model'.", "model")
    if not isinstance(model, str) or not model:
        raise bad_request("Field 'model' must be a non-empty string.", "model")
    if models is not None and model not in models:
        raise model_not_found(model, list(models))

    try:
        prompt, token_ids, messages = PROMPT_READERS[api](data)
    except RecursionError:
        raise too_deep() from None
    check_encodable(prompt)
    priority, fairness_id, objective = identity(headers, policy)
    request = InferenceRequest(
        request_id=headers.get(wire.REQUEST_ID) or os.urandom(12).hex(),
        path=path,
        api=api,
        model=model,
        prompt=prompt,
        messages=messages,
        prompt_token_ids=token_ids,
        max_tokens=max_tokens(api, data),
        stream=optional(data, "stream", bool) or False,
        priority=priority,
        fairness_id=fairness_id,
        objective=objective,
        session=session(headers, policy.session_header),
        body_size=len(body),
        headers=headers,
    )
    return request, data


def set_engine_priority(request: InferenceRequest, data: dict[str, Any]) -> bool:
    """Write the request's priority into the decoded body as vLLM's ``priority`` field; True
    when the body changed (and must be re-serialised).

    epp's priorities rank higher as more important, vLLM serves the lower value first: the
    field is the negated priority. Whatever the client put there is overwritten (priority comes
    from trusted sources only, :func:`identity`), and vLLM's default of 0 needs no field.
    """
    wanted = -request.priority
    current = data.get("priority", 0)
    if type(current) is int and current == wanted:
        return False
    if wanted == 0:
        del data["priority"]
    else:
        data["priority"] = wanted
    return True


def check_headers(headers: Mapping[str, str], max_body_bytes: int) -> RequestError | None:
    """What the request headers alone show to be refused, answered before any body arrives
    (so a client that waits for ``100 Continue``, or reads while it sends, is spared the
    upload): a path that is no inference API (404), a declared body over the limit (413), a
    Content-Type that is not JSON (415). None when the headers are acceptable."""
    path = headers.get(":path", "")
    if api_for_path(path) is None:
        return unknown_path(headers.get(":method", "POST"), path)
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        return body_too_large(int(declared), max_body_bytes)
    content_type = headers.get("content-type")
    if content_type is not None and not _is_json_media_type(content_type):
        return unsupported_media_type(content_type)
    return None


def _is_json_media_type(value: str) -> bool:
    """``application/json`` or a ``+json`` type, parameters (charset) ignored. An absent
    Content-Type is accepted as JSON, as the engine (FastAPI) accepts it."""
    media = value.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )
