"""Build hook: generate the protobuf modules into the wheel.

The ``.proto`` files are the repository's ``proto/`` (``../../proto`` from
here), or ``SLUICE_PROTO_DIR``, or the ``proto/`` an sdist carries (copied in
when the sdist is made). Everything else is in ``pyproject.toml``.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = pathlib.Path(__file__).resolve().parent


def _codegen():  # type: ignore[no-untyped-def]
    # Loaded by path: the package itself needs grpcio and protobuf, which a
    # build environment does not have.
    spec = importlib.util.spec_from_file_location("_sluice_codegen", HERE / "src" / "sluice_client" / "_codegen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def proto_root() -> pathlib.Path:
    candidates = [os.environ.get("SLUICE_PROTO_DIR", ""), str(HERE.parent.parent / "proto"), str(HERE / "proto")]
    for candidate in candidates:
        if candidate and (pathlib.Path(candidate) / "sluice" / "v1" / "admission.proto").is_file():
            return pathlib.Path(candidate)
    raise RuntimeError(
        "cannot find the .proto files: build from the repository (sdks/python), or set SLUICE_PROTO_DIR"
    )


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        super().run()
        codegen = _codegen()
        if self.editable_mode:
            # An editable install imports from src/: generate there.
            codegen.generate(proto_root(), HERE / "src" / "sluice_client" / "_proto")
        else:
            codegen.generate(proto_root(), pathlib.Path(self.build_lib) / "sluice_client" / "_proto")


class SdistWithProtos(sdist):
    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        shutil.copytree(proto_root() / "sluice", pathlib.Path(base_dir) / "proto" / "sluice")


setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProtos})
