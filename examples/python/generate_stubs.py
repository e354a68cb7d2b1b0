#!/usr/bin/env python3
"""Generate the Python gRPC and protobuf stubs from ../../proto into
./generated (not committed). Regenerates only when a .proto file is newer
than the stubs, so running it before every start is cheap.

    python generate_stubs.py            # needs grpcio-tools (requirements.txt)
"""

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent.parent / "proto"
OUT = HERE / "generated"


def stubs_are_fresh(protos):
    stamp = OUT / ".stamp"
    if not stamp.exists():
        return False
    built_at = stamp.stat().st_mtime
    return all(proto.stat().st_mtime <= built_at for proto in protos)


def main():
    protos = sorted((PROTO_ROOT / "sluice" / "v1").glob("*.proto"))
    if not protos:
        sys.exit(f"no .proto files under {PROTO_ROOT}")
    if stubs_are_fresh(protos):
        return
    from grpc_tools import protoc  # imported late: only needed to regenerate

    OUT.mkdir(exist_ok=True)
    arguments = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--python_out={OUT}",
        f"--grpc_python_out={OUT}",
        *[str(proto.relative_to(PROTO_ROOT)) for proto in protos],
    ]
    if protoc.main(arguments) != 0:
        sys.exit("protoc failed: " + " ".join(arguments))
    (OUT / ".stamp").touch()
    print(f"generated stubs for {len(protos)} proto files in {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
