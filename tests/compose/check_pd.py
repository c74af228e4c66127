"""Bring up docker-compose.yml with docker-compose.pd.yml under podman-compose and check that
requests go prefill/decode as docs/pd.md says.

1. ``up``: the compose stack with the P/D overlay: one prefill and one decode simulated replica
   (NIXL connector), ``epp pd-sidecar`` in front of the decode one under the name ``sim``.
2. Both epps see the two replicas ready, each in its role's pool.
3. A long prompt through Envoy: epp names the prefill replica (its decision record), the
   prefill replica serves the prefill leg, the decode engine loads the prompt's KV
   (``vllm:external_prefix_cache_hits_total`` rises) and answers (``x-served-by``).
4. A short prompt stays on the decode replica: decode-only, no prefill leg.
5. ``down``, always.

Run by tests/compose/run.sh after check_stack.py (the images exist by then).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

from check_stack import EPPS, Stack, StackError, http, step, wait_for

# Run inside a simulator container: it listens on the container's address, not loopback.
_READ_METRICS = (
    "import socket, urllib.request; "
    "ip = socket.gethostbyname(socket.gethostname()); "
    "print(urllib.request.urlopen(f'http://{ip}:8000/metrics').read().decode())"
)


def counter(stack: Stack, service: str, name: str) -> float:
    """The sum of ``name``'s samples on the one container of ``service``."""
    (container,) = stack.containers(service)
    text = stack.podman("exec", container, "python", "-c", _READ_METRICS)
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def address(stack: Stack, service: str) -> str:
    (container,) = stack.containers(service)
    ip = stack.podman(
        "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", container
    ).strip()
    return f"{ip}:8000"


def ready_roles(stack: Stack) -> bool:
    """Both epps see two ready endpoints, in the pools ``main`` (decode) and ``prefill``."""
    for epp in EPPS:
        found = stack.endpoints(epp) or {}
        pools = {e.get("pool") for e in found.values() if isinstance(e, dict) and e.get("ready")}
        if pools != {"main", "prefill"}:
            return False
    return True


def complete(stack: Stack, request_id: str, prompt: str) -> dict[str, str]:
    status, headers, body = http(
        f"{stack.url('ENVOY_PORT')}/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 4},
        {"x-request-id": request_id},
    )
    if status != 200:
        raise StackError(f"{request_id}: HTTP {status} through Envoy: {body[:300]!r}")
    return headers


def check(stack: Stack) -> None:
    step(f"podman-compose up with docker-compose.pd.yml (project {stack.project})")
    stack.run("up", "-d")
    wait_for("a 200 from /v1/completions", lambda: stack.complete("pd-warm-up")[0] == 200, 180)
    wait_for("both epps to see the decode and the prefill replica", lambda: ready_roles(stack), 60)
    prefill, engine = address(stack, "sim-prefill"), address(stack, "sim-decode")

    step("a long prompt goes prefill/decode: P runs the prefill leg, D loads the KV")
    legs = counter(stack, "sim-prefill", "vllm:request_success_total")
    loaded = counter(stack, "sim-decode", "vllm:external_prefix_cache_hits_total")
    long_id = f"pd-long-{uuid.uuid4().hex[:8]}"
    # Over the overlay's threshold (256 uncached tokens; epp counts 4 characters a token).
    headers = complete(stack, long_id, f"{long_id} " + "a long document to summarise " * 60)
    epp, record = wait_for("the long prompt's decision", lambda: stack.decided(long_id), 10, 0.2)
    split = record.get("disaggregation") or {}
    if split.get("decision_type") != "prefill-decode" or split.get("prefill") != prefill:
        raise StackError(f"{epp} did not split the long prompt onto {prefill}: {record}")
    if headers.get("x-served-by") != engine:
        raise StackError(f"the decode engine {engine} did not answer: {headers}")
    after = counter(stack, "sim-prefill", "vllm:request_success_total")
    moved = counter(stack, "sim-decode", "vllm:external_prefix_cache_hits_total") - loaded
    if after != legs + 1 or moved <= 0:
        raise StackError(f"prefill legs {legs} -> {after}, KV tokens loaded on D {moved}")
    print(f"    {epp}: prefill on {prefill}, decode on {engine}, {moved:.0f} tokens loaded")

    step("a short prompt stays on the decode replica")
    short_id = f"pd-short-{uuid.uuid4().hex[:8]}"
    complete(stack, short_id, f"hi {short_id}")
    epp, record = wait_for("the short prompt's decision", lambda: stack.decided(short_id), 10, 0.2)
    if (record.get("disaggregation") or {}).get("decision_type") != "decode-only":
        raise StackError(f"{epp} split a short prompt: {record}")
    if counter(stack, "sim-prefill", "vllm:request_success_total") != after:
        raise StackError("the short prompt reached the prefill replica")


def main() -> int:
    compose = sys.argv[1:] or ["podman-compose"]
    stack = Stack(compose, ("docker-compose.yml", "docker-compose.pd.yml"), "epp-compose-pd")
    failed = True
    try:
        check(stack)
        failed = False
    except (StackError, subprocess.CalledProcessError) as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        print(f"last logs of the stack:\n{stack.logs()}", file=sys.stderr)
    finally:
        if os.environ.get("EPP_COMPOSE_KEEP") and failed:
            print(f"kept project {stack.project} (EPP_COMPOSE_KEEP)", file=sys.stderr)
        else:
            step("podman-compose down (P/D)")
            stack.down()
    if not failed:
        print("compose P/D stack: OK", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
