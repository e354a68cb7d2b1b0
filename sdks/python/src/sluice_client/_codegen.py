"""Generate the protobuf modules from the repository's ``proto/`` directory.

Used twice: by ``setup.py`` when a wheel is built (the stubs go into the
wheel), and on import from a source checkout, where nothing was built (the
stubs go into ``src/sluice_client/_proto`` and are regenerated when a
``.proto`` file changes). Generated files are never committed.

Only the standard library is imported at module level: ``setup.py`` loads
this file by path, before the package's dependencies exist.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator

# The protobuf package the generated modules live in, under ``_proto``:
# ``sluice/v1/*.proto`` become ``sluice_client._proto.sluice.v1.*_pb2``.
PACKAGE = "sluice_client._proto"
STAMP = ".stamp"

_HERE = pathlib.Path(__file__).resolve().parent
# src/sluice_client -> src -> python -> sdks -> the repository.
_REPO = _HERE.parents[3]


def source_proto_root() -> pathlib.Path | None:
    """The repository's ``proto/`` when this module runs from a source
    checkout of ``sdks/python``, else None (an installed wheel)."""
    if not (_HERE.parents[1] / "pyproject.toml").is_file():
        return None
    root = _REPO / "proto"
    if (root / "sluice" / "v1" / "admission.proto").is_file():
        return root
    return None


def proto_files(proto_root: pathlib.Path) -> list[pathlib.Path]:
    return sorted((proto_root / "sluice" / "v1").glob("*.proto"))


def fingerprint(proto_root: pathlib.Path) -> str:
    """A hash of every ``.proto`` file's name and content."""
    digest = hashlib.sha256()
    for proto in proto_files(proto_root):
        digest.update(proto.name.encode())
        digest.update(b"\0")
        digest.update(proto.read_bytes())
    return digest.hexdigest()


def _rewrite_imports(path: pathlib.Path) -> None:
    # protoc writes `from sluice.v1 import jobs_pb2`: a top-level `sluice`
    # package. Inside this package the modules import each other by their
    # full name instead.
    text = path.read_text()
    text = re.sub(r"^from sluice\.v1 import", f"from {PACKAGE}.sluice.v1 import", text, flags=re.MULTILINE)
    text = re.sub(r"^import sluice\.v1\.", f"import {PACKAGE}.sluice.v1.", text, flags=re.MULTILINE)
    path.write_text(text)


def generate(proto_root: pathlib.Path, out: pathlib.Path) -> None:
    """Generate ``out/sluice/v1/*_pb2.py`` and ``.pyi`` from ``proto_root``
    (``out`` is the ``sluice_client/_proto`` directory). Needs grpcio-tools."""
    from grpc_tools import protoc  # type: ignore[import-untyped]  # only needed to generate

    protos = proto_files(proto_root)
    if not protos:
        raise RuntimeError(f"no .proto files under {proto_root}/sluice/v1")
    # protoc's own well-known types (google/protobuf/*.proto) ship with grpc_tools.
    import grpc_tools

    well_known = pathlib.Path(grpc_tools.__file__).resolve().parent / "_proto"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".gen-") as scratch:
        arguments = [
            "grpc_tools.protoc",
            f"--proto_path={proto_root}",
            f"--proto_path={well_known}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            *[str(proto.relative_to(proto_root)) for proto in protos],
        ]
        if protoc.main(arguments) != 0:
            raise RuntimeError("protoc failed: " + " ".join(arguments))
        generated = pathlib.Path(scratch) / "sluice"
        for module in generated.rglob("*.py*"):
            _rewrite_imports(module)
        (generated / "__init__.py").write_text("")
        (generated / "v1" / "__init__.py").write_text("")
        (generated / STAMP).write_text(fingerprint(proto_root) + "\n")
        target = out / "sluice"
        if target.exists():
            shutil.rmtree(target)
        os.replace(generated, target)


@contextlib.contextmanager
def _locked(directory: pathlib.Path) -> Iterator[None]:
    """One generator at a time (two processes importing at once)."""
    try:
        import fcntl
    except ImportError:  # not on POSIX: no lock
        yield
        return
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_source_stubs() -> None:
    """In a source checkout, (re)generate the stubs when missing or stale;
    in an installed package, do nothing (the wheel carries them)."""
    proto_root = source_proto_root()
    if proto_root is None:
        return
    out = _HERE / "_proto"
    stamp = out / "sluice" / STAMP
    wanted = fingerprint(proto_root)
    if stamp.is_file() and stamp.read_text().strip() == wanted:
        return
    with _locked(out):
        if stamp.is_file() and stamp.read_text().strip() == wanted:
            return
        try:
            generate(proto_root, out)
        except ImportError as error:
            raise ImportError(
                "sluice_client runs from a source checkout without generated stubs: "
                "install grpcio-tools (pip install grpcio-tools==1.85.1), or install the "
                "package (pip install sdks/python), which generates them at build time"
            ) from error
        print(f"sluice_client: generated protobuf modules from {proto_root}", file=sys.stderr)
