"""A pool fed by a Kubernetes InferencePool: its selector picks Pods, its targetPorts their ports.

Follows GIE's endpoint picker: the InferencePool (``inference.networking.k8s.io/v1``) in one
namespace names ``spec.selector.matchLabels`` and ``spec.targetPorts``; every Pod in that
namespace matching the selector that is Ready and has no ``deletionTimestamp`` contributes one
endpoint ``podIP:port`` per target port.

Both objects are followed with the API's list-then-watch protocol: list (which returns a
collection ``resourceVersion``), then watch from that version with ``allowWatchBookmarks`` so
the server can move our version forward while nothing changes. A watch stream that ends
normally (servers close them every few minutes) is resumed from the last version seen, by
lightkube. ``410 Gone`` (the version was compacted away), whether it comes back as the HTTP
status of the watch request or as an ``ERROR`` event inside the stream, means events were lost:
list again and publish the fresh state, so a Pod deleted during the gap cannot linger. Any
other error backs off exponentially (0.1 s doubling to 5 s) and relists. When the pool's
selector or ports change, the Pod list/watch restarts with the new selector.

lightkube (docs/discovery.md says why) does the configuration (in-cluster service account by
default, a kubeconfig file, or a plain URL), authentication, TLS and the decoding of watch
streams. Its public ``watch()`` cannot send ``allowWatchBookmarks``, so :func:`_watch` builds
the same request through its generic client with that parameter added.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx2
from lightkube import AsyncClient, ConfigError, KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ApiError
from lightkube.core.selector import build_selector
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod
from lightkube.types import OnErrorAction, OnErrorResult

from epp.discovery.source import Publish
from epp.discovery.spec import KubernetesSpec, format_endpoint
from epp.roles import ROLE_LABEL, Role, parse_role

log = logging.getLogger(__name__)
# lightkube's HTTP client logs every request at INFO, each watch reconnection included.
logging.getLogger("httpx2").setLevel(logging.WARNING)

InferencePool = create_namespaced_resource(
    "inference.networking.k8s.io", "v1", "InferencePool", "inferencepools"
)

# Error back-off: first retry soon (a restarting API server is back in well under a second),
# then doubling to a cap so a long outage costs the API server little.
BACKOFF_START = 0.1
BACKOFF_MAX = 5.0
# How often a kind the cluster does not serve (its CRD not installed) is asked for again.
ABSENT_RETRY = 30.0


class Gone(Exception):
    """410: the resourceVersion we hold is too old; relist."""


@dataclass(frozen=True, slots=True)
class PoolTarget:
    """What an InferencePool selects: label selector and ports."""

    selector: tuple[tuple[str, str], ...]
    ports: tuple[int, ...]


def make_client(spec: KubernetesSpec) -> AsyncClient:
    if spec.api_url is not None:
        # No credentials: a test server or a local ``kubectl proxy``.
        config = KubeConfig.from_one(cluster=Cluster(server=spec.api_url), user=User())
        return AsyncClient(config, namespace=spec.namespace)
    if spec.kubeconfig is not None:
        return AsyncClient(KubeConfig.from_file(spec.kubeconfig), namespace=spec.namespace)
    # In-cluster service account, else $KUBECONFIG / ~/.kube/config (lightkube's from_env).
    return AsyncClient(namespace=spec.namespace)


def pool_target(pool: Any) -> PoolTarget:
    """Selector and ports of an InferencePool object; ValueError if it has neither."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = tuple(int(p["number"]) for p in spec.get("targetPorts") or ())
    if not labels or not ports:
        raise ValueError("InferencePool needs spec.selector.matchLabels and spec.targetPorts")
    return PoolTarget(tuple(sorted((str(k), str(v)) for k, v in labels.items())), ports)


def pod_endpoints(pod: Pod, ports: tuple[int, ...]) -> tuple[str, ...]:
    """``podIP:port`` per target port for a Ready pod that is not being deleted, else ()."""
    meta, status = pod.metadata, pod.status
    if meta is None or status is None or meta.deletionTimestamp is not None or not status.podIP:
        return ()
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())
    return tuple(format_endpoint(status.podIP, port) for port in ports) if ready else ()


def pod_role(pod: Pod) -> Role | None:
    """The Pod's prefill/decode role from llm-d's ``llm-d.ai/role`` label; None (both) when it
    has none or one epp does not know (logged: such a Pod still serves whole requests)."""
    labels = (pod.metadata.labels if pod.metadata is not None else None) or {}
    value = labels.get(ROLE_LABEL)
    if value is None:
        return None
    role = parse_role(value)
    if role is None:
        name = pod.metadata.name if pod.metadata is not None else "?"
        log.warning("Pod %s: unknown %s=%r, serving as both", name, ROLE_LABEL, value)
    return role


class KubernetesSource:
    def __init__(self, spec: KubernetesSpec) -> None:
        self._spec = spec

    async def run(self, publish: Publish) -> None:
        client = await connect(self._spec)
        pods: asyncio.Task[None] | None = None
        try:
            async for target in self._pool_targets(client):
                if pods is not None:
                    pods.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await pods
                    pods = None
                if target is None:
                    publish(frozenset())
                    continue
                log.info(
                    "InferencePool %s/%s selects %s on ports %s",
                    self._spec.namespace,
                    self._spec.pool_name,
                    ",".join(f"{k}={v}" for k, v in target.selector),
                    ",".join(map(str, target.ports)),
                )
                pods = asyncio.create_task(self._follow_pods(client, target, publish))
        finally:
            if pods is not None:
                pods.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pods
            await client.close()

    async def _pool_targets(self, client: AsyncClient) -> AsyncIterator[PoolTarget | None]:
        """The pool's target now and after each change; None while the pool does not exist
        or is invalid (no endpoints then, as GIE serves none without its pool)."""
        fields = {"metadata.name": self._spec.pool_name}
        current: PoolTarget | bool | None = False  # False: nothing yielded yet
        namespace = self._spec.namespace
        async for objects in list_watch(client, InferencePool, namespace, fields=fields):
            pool = objects.get(self._spec.pool_name)
            target: PoolTarget | None = None
            if pool is not None:
                try:
                    target = pool_target(pool)
                except (ValueError, KeyError, TypeError) as exc:
                    log.error("InferencePool %s: %s", self._spec.pool_name, exc)
            elif current is not None:
                log.warning(
                    "InferencePool %s/%s not found; the pool has no endpoints until it exists",
                    self._spec.namespace,
                    self._spec.pool_name,
                )
            if target != current:
                current = target
                yield target

    async def _follow_pods(self, client: AsyncClient, target: PoolTarget, publish: Publish) -> None:
        namespace = self._spec.namespace
        async for pods in list_watch(client, Pod, namespace, labels=dict(target.selector)):
            members: set[str] = set()
            roles: dict[str, Role] = {}
            for pod in pods.values():
                endpoints = pod_endpoints(pod, target.ports)
                members.update(endpoints)
                role = pod_role(pod)
                if role is not None:
                    roles.update((ep, role) for ep in endpoints)
            publish(frozenset(members), roles)


async def connect(spec: KubernetesSpec) -> AsyncClient:
    """A client for ``spec``'s cluster, retried until credentials are found."""
    while True:
        try:
            return make_client(spec)
        except (ConfigError, KeyError, OSError) as exc:
            log.error(
                "no Kubernetes credentials for InferencePool %s (%s: %s); run epp in a pod "
                "with a service account, or give kubeconfig / --kubeconfig; retrying in %gs",
                spec.pool_name,
                type(exc).__name__,
                exc,
                BACKOFF_MAX,
            )
            await asyncio.sleep(BACKOFF_MAX)


async def list_watch(
    client: AsyncClient,
    kind: Any,
    namespace: str,
    *,
    labels: Mapping[str, str] | None = None,
    fields: Mapping[str, str] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """The current objects by name after the list and after every event: list, watch from
    the list's version, relist on 410, back off on other errors. A kind the cluster does not
    serve (404: its CRD is not installed) is said once, then asked for again every
    :data:`ABSENT_RETRY` seconds, quietly."""
    delay = BACKOFF_START
    absent = False
    while True:
        try:
            listing = client.list(
                kind,
                namespace=namespace,
                labels=dict(labels) if labels else None,
                fields=dict(fields) if fields else None,
            )
            objects = {obj.metadata.name: obj async for obj in listing}
            yield objects
            version = listing.resourceVersion
            async for event, obj in _watch(client, kind, namespace, labels, fields, version):
                delay = BACKOFF_START  # the watch works again
                if event == "BOOKMARK":
                    continue  # only moves the version lightkube resumes from
                if event == "DELETED":
                    objects.pop(obj.metadata.name, None)
                else:  # ADDED, MODIFIED
                    objects[obj.metadata.name] = obj
                yield objects
        except Gone:
            log.info("%s watch: resourceVersion expired (410 Gone); relisting", kind.__name__)
        # Any other failure (transport, 5xx, a response lightkube cannot decode) ends this
        # list/watch only; the task must survive it and relist.
        except Exception as exc:
            if _status(exc) == 404:
                if not absent:
                    absent = True
                    log.info(
                        "%s is not served in %s (CRD not installed); looking again every %gs",
                        kind.__name__,
                        namespace,
                        ABSENT_RETRY,
                    )
                    yield {}
                await asyncio.sleep(ABSENT_RETRY)
                continue
            log.warning(
                "%s list/watch in %s failed (%s); retrying in %.1fs",
                kind.__name__,
                namespace,
                exc or type(exc).__name__,
                delay,
            )
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, BACKOFF_MAX)


def _status(exc: Exception) -> int | None:
    """The HTTP status an error of lightkube's carries, if any."""
    status = exc.status.code if isinstance(exc, ApiError) else None
    if isinstance(exc, httpx2.HTTPStatusError) and exc.response is not None:
        status = status or exc.response.status_code
    return status


def _raise(exc: Exception, _count: int) -> OnErrorResult:
    """lightkube on_error: every error ends the watch here; a 410 becomes :class:`Gone`."""
    if _status(exc) == 410:
        raise Gone() from exc
    return OnErrorResult(OnErrorAction.RAISE)


def _watch(
    client: AsyncClient,
    kind: Any,
    namespace: str,
    labels: Mapping[str, str] | None,
    fields: Mapping[str, str] | None,
    version: str | None,
) -> AsyncIterator[tuple[str, Any]]:
    """``client.watch`` plus ``allowWatchBookmarks=true`` (see the module docstring)."""
    generic = client._client
    request = generic.prepare_request(
        "list",
        res=kind,
        namespace=namespace,
        watch=True,
        params={
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "labelSelector": build_selector(dict(labels)) if labels else None,
            "fieldSelector": build_selector(dict(fields), for_fields=True) if fields else None,
        },
    )
    watch: AsyncIterator[tuple[str, Any]] = generic.watch(request, on_error=_raise)
    return watch
