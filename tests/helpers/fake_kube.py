"""A local HTTP server that speaks the Kubernetes API's list and watch protocol for Pods,
InferencePools, InferenceModelRewrites and InferenceObjectives, so the discovery client can be
tested without a kube-apiserver.

What it implements, as the API documents it (API Concepts: "Efficient detection of changes",
"Watch bookmarks", "410 Gone responses"):

* ``GET /api/v1/namespaces/NS/pods`` and
  ``GET /apis/inference.networking.k8s.io/v1/namespaces/NS/inferencepools``: a list with the
  collection's ``metadata.resourceVersion``; ``labelSelector`` (``k=v,...``) and
  ``fieldSelector`` (``metadata.name=x``) filter it.
* ``?watch=true&resourceVersion=R``: a chunked stream of JSON lines ``{"type", "object"}`` with
  every change after R (ADDED / MODIFIED / DELETED; an object that stops matching a label
  selector arrives as DELETED, one that starts matching as ADDED). Without R, synthetic ADDED
  events for the current objects come first. ``allowWatchBookmarks=true`` lets
  :meth:`FakeKube.bookmark` send BOOKMARK events carrying only a newer resourceVersion.
* 410 Gone for an R older than the last :meth:`FakeKube.compact`, either as the HTTP status of
  the watch request (``gone_as="status"``) or as an ``ERROR`` event with a Status object in a
  200 stream (``gone_as="event"``); :meth:`FakeKube.expire_watches` sends that ERROR event into
  the open streams and closes them.
* :meth:`FakeKube.close_watches` ends every open stream cleanly (as servers do after
  ``timeoutSeconds``); :meth:`FakeKube.partition` / :meth:`FakeKube.heal` keep clients from
  reconnecting their watches meanwhile; :meth:`FakeKube.fail_next` answers the next requests
  with 500.

The server runs on its own event loop in a thread, so it serves epp subprocesses as well as
code on a test's loop; every control method is synchronous and thread-safe. ``requests``
records each request's path and query.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

POOL_GROUP = "inference.networking.k8s.io"
REWRITE_GROUP = "llm-d.ai"
OLD_GROUP = "inference.networking.x-k8s.io"
# kind key (the plural, prefixed with the group for custom resources of several groups) ->
# (apiVersion, Kind).
KINDS = {
    "pods": ("v1", "Pod"),
    "inferencepools": (f"{POOL_GROUP}/v1", "InferencePool"),
    **{
        f"{group}/{plural}": (f"{group}/v1alpha2", kind)
        for group in (REWRITE_GROUP, OLD_GROUP)
        for plural, kind in (
            ("inferencemodelrewrites", "InferenceModelRewrite"),
            ("inferenceobjectives", "InferenceObjective"),
        )
    },
}


@dataclass
class _Event:
    rv: int
    kind: str
    namespace: str
    old: dict[str, Any] | None
    new: dict[str, Any] | None


@dataclass(eq=False)
class _Watch:
    kind: str
    namespace: str
    labels: dict[str, str]
    fields: dict[str, str]
    bookmarks: bool
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


def pod(
    name: str,
    ip: str,
    labels: Mapping[str, str],
    *,
    ready: bool = True,
    namespace: str = "default",
    deleting: bool = False,
) -> dict[str, Any]:
    """A Pod object as the API returns it (only the fields discovery reads, plus phase)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def inference_pool(
    name: str, labels: Mapping[str, str], ports: list[int], namespace: str = "default"
) -> dict[str, Any]:
    return {
        "apiVersion": f"{POOL_GROUP}/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": dict(labels)},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
        },
    }


def rewrites_kind(group: str = REWRITE_GROUP) -> str:
    return f"{group}/inferencemodelrewrites"


def objectives_kind(group: str = REWRITE_GROUP) -> str:
    return f"{group}/inferenceobjectives"


def model_rewrite(
    name: str,
    pool: str,
    rules: list[dict[str, Any]],
    group: str = REWRITE_GROUP,
    namespace: str = "default",
) -> dict[str, Any]:
    """An InferenceModelRewrite (``rules`` as the CRD spells them)."""
    return {
        "apiVersion": f"{group}/v1alpha2",
        "kind": "InferenceModelRewrite",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"poolRef": {"name": pool}, "rules": rules},
    }


def split(model: str | None, *targets: tuple[str, int]) -> dict[str, Any]:
    """One rewrite rule: ``model`` matched exactly (None: every model), weighted targets."""
    matches = [] if model is None else [{"model": {"type": "Exact", "value": model}}]
    return {
        "matches": matches,
        "targets": [{"modelRewrite": t, "weight": w} for t, w in targets],
    }


def inference_objective(
    name: str, pool: str, priority: int | None, group: str = REWRITE_GROUP
) -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": f"{group}/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


class FakeKube:
    def __init__(
        self, gone_as: Literal["status", "event"] = "status", absent: frozenset[str] = frozenset()
    ) -> None:
        self.gone_as = gone_as
        # Kinds not served (404, as for a CRD that is not installed).
        self.absent = absent
        self.requests: list[tuple[str, dict[str, str]]] = []
        self._rv = 1
        self._compacted = 0
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._events: list[_Event] = []
        self._watches: set[_Watch] = set()
        self._failures: dict[str, int] = {}
        self._connected: asyncio.Event | None = None
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- lifecycle

    def __enter__(self) -> FakeKube:
        self._thread.start()
        self._call(self._start)
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._shutdown)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _start(self) -> None:
        self._connected = asyncio.Event()
        self._connected.set()
        app = web.Application()
        for kind, (api_version, _) in KINDS.items():
            plural = kind.rpartition("/")[2]
            base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            if kind not in self.absent:
                app.router.add_get(f"{base}/namespaces/{{ns}}/{plural}", self._handle(kind))
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _shutdown(self) -> None:
        for watch in list(self._watches):
            watch.queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    def _call(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            result = fn()
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    # ---- controls (thread-safe)

    def put(self, kind: str, obj: dict[str, Any]) -> None:
        """Create or replace an object (``kind``: a key of :data:`KINDS`)."""
        self._call(lambda: self._change(kind, obj["metadata"], copy.deepcopy(obj)))

    def delete(self, kind: str, name: str, namespace: str = "default") -> None:
        self._call(lambda: self._change(kind, {"name": name, "namespace": namespace}, None))

    def compact(self) -> None:
        """Forget history: any resourceVersion older than now is 410 Gone from now on."""
        self._call(lambda: setattr(self, "_compacted", self._rv))

    def close_watches(self) -> None:
        def close() -> None:
            for w in list(self._watches):
                w.queue.put_nowait(None)

        self._call(close)

    def expire_watches(self) -> None:
        """Send ERROR 410 into every open watch stream, then close it."""

        def expire() -> None:
            for w in list(self._watches):
                w.queue.put_nowait({"type": "ERROR", "object": self._gone_status(0)})
                w.queue.put_nowait(None)

        self._call(expire)

    def bookmark(self) -> None:
        """A BOOKMARK with the current resourceVersion to every watch that allows them."""

        def send() -> None:
            for w in self._watches:
                if w.bookmarks:
                    api_version, kind = KINDS[w.kind]
                    obj = {
                        "apiVersion": api_version,
                        "kind": kind,
                        "metadata": {"resourceVersion": str(self._rv)},
                    }
                    w.queue.put_nowait({"type": "BOOKMARK", "object": obj})

        self._call(send)

    def partition(self) -> None:
        """Cut the clients off: open watches end and new watch requests wait for :meth:`heal`,
        so changes made meanwhile reach them only through what happens on reconnection."""

        def cut() -> None:
            assert self._connected is not None
            self._connected.clear()
            for w in list(self._watches):
                w.queue.put_nowait(None)

        self._call(cut)

    def heal(self) -> None:
        self._call(lambda: self._connected.set())  # type: ignore[union-attr]

    def fail_next(self, kind: str, count: int) -> None:
        """Answer the next ``count`` requests for ``kind`` (pods | inferencepools) with 500."""
        self._call(lambda: self._failures.__setitem__(kind, count))

    def open_watches(self) -> int:
        return int(self._call(lambda: len(self._watches)))

    # ---- internals (server loop only)

    def _change(self, kind: str, meta: Mapping[str, Any], new: dict[str, Any] | None) -> None:
        key = (kind, meta.get("namespace", "default"), meta["name"])
        old = self._objects.get(key)
        if old is None and new is None:
            return
        self._rv += 1
        if new is None:
            del self._objects[key]
            old = copy.deepcopy(old)
            assert old is not None
            old["metadata"]["resourceVersion"] = str(self._rv)
        else:
            new["metadata"]["resourceVersion"] = str(self._rv)
            new["metadata"].setdefault("namespace", key[1])
            # Kept from the first version, a second apart per creation (the API's resolution).
            created = (old or new)["metadata"].get("creationTimestamp") or _timestamp(self._rv)
            new["metadata"]["creationTimestamp"] = created
            self._objects[key] = new
        event = _Event(self._rv, kind, key[1], old, new)
        self._events.append(event)
        for w in self._watches:
            message = _as_seen_by(w, event)
            if message is not None:
                w.queue.put_nowait(message)

    def _gone_status(self, rv: int) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "message": f"too old resource version: {rv} ({self._compacted})",
            "reason": "Expired",
            "code": 410,
        }

    def _handle(self, kind: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.StreamResponse:
            query = dict(request.query)
            self.requests.append((request.path, query))
            if self._failures.get(kind, 0) > 0:
                self._failures[kind] -= 1
                return web.json_response({"kind": "Status", "code": 500}, status=500)
            namespace = request.match_info["ns"]
            labels = _selector(query.get("labelSelector", ""))
            fields = _selector(query.get("fieldSelector", ""))
            if query.get("watch") in ("true", "1"):
                assert self._connected is not None
                await self._connected.wait()
                return await self._watch(request, kind, namespace, labels, fields, query)
            api_version, kind_name = KINDS[kind]
            items = [
                o
                for (k, ns, _), o in sorted(self._objects.items())
                if k == kind and ns == namespace and _matches(o, labels, fields)
            ]
            return web.json_response(
                {
                    "apiVersion": api_version,
                    "kind": f"{kind_name}List",
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": items,
                }
            )

        return handler

    async def _watch(
        self,
        request: web.Request,
        kind: str,
        namespace: str,
        labels: dict[str, str],
        fields: dict[str, str],
        query: dict[str, str],
    ) -> web.StreamResponse:
        text = query.get("resourceVersion", "")
        since = int(text) if text.isdigit() else 0
        watch = _Watch(kind, namespace, labels, fields, query.get("allowWatchBookmarks") == "true")
        if since and since < self._compacted:
            if self.gone_as == "status":
                return web.json_response(self._gone_status(since), status=410)
            watch.queue.put_nowait({"type": "ERROR", "object": self._gone_status(since)})
            watch.queue.put_nowait(None)
        elif not since:
            for (k, ns, _), o in sorted(self._objects.items()):
                if k == kind and ns == namespace and _matches(o, labels, fields):
                    watch.queue.put_nowait({"type": "ADDED", "object": o})
        else:
            for event in self._events:
                if event.rv > since and (message := _as_seen_by(watch, event)):
                    watch.queue.put_nowait(message)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        self._watches.add(watch)
        try:
            while (message := await watch.queue.get()) is not None:
                await response.write(json.dumps(message).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watches.discard(watch)
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response


def _timestamp(seconds: int) -> str:
    hours, minutes = seconds // 3600 % 24, seconds // 60 % 60
    return f"2026-01-01T{hours:02d}:{minutes:02d}:{seconds % 60:02d}Z"


def _selector(text: str) -> dict[str, str]:
    pairs = [p.split("=", 1) for p in text.split(",") if p]
    return {k.strip(): v.strip() for k, v in pairs}


def _matches(obj: Mapping[str, Any], labels: Mapping[str, str], fields: Mapping[str, str]) -> bool:
    meta = obj["metadata"]
    have = meta.get("labels") or {}
    if any(have.get(k) != v for k, v in labels.items()):
        return False
    return all(meta.get(f.removeprefix("metadata.")) == v for f, v in fields.items())


def _as_seen_by(watch: _Watch, event: _Event) -> dict[str, Any] | None:
    """The event a selector-filtered watch sees for one change, if any."""
    if event.kind != watch.kind or event.namespace != watch.namespace:
        return None
    was = event.old is not None and _matches(event.old, watch.labels, watch.fields)
    now = event.new is not None and _matches(event.new, watch.labels, watch.fields)
    if now:
        return {"type": "MODIFIED" if was else "ADDED", "object": event.new}
    if was:
        # Deleted, or no longer selected: both are DELETED for this watch.
        gone = event.new if event.new is not None else event.old
        return {"type": "DELETED", "object": gone}
    return None
