"""The protobuf messages of ``proto/sluice/v1`` (generated at build time).

``from sluice_client.proto import jobs_pb2, admission_pb2`` gives the same
messages the services use: ``jobs_pb2.JobRequest``, ``admission_pb2.JobView``,
``refresh_pb2.RefreshTask``, ...
"""

from __future__ import annotations

from . import _codegen

# From a source checkout nothing was built: generate the modules now (only
# when missing or older than the .proto files).
_codegen.ensure_source_stubs()

from ._proto.sluice.v1 import admission_pb2 as admission_pb2  # noqa: E402
from ._proto.sluice.v1 import jobs_pb2 as jobs_pb2  # noqa: E402
from ._proto.sluice.v1 import limits_pb2 as limits_pb2  # noqa: E402
from ._proto.sluice.v1 import rate_pb2 as rate_pb2  # noqa: E402
from ._proto.sluice.v1 import refresh_pb2 as refresh_pb2  # noqa: E402

__all__ = ["admission_pb2", "jobs_pb2", "limits_pb2", "rate_pb2", "refresh_pb2"]
