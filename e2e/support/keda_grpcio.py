"""grpcio stubs for KEDA's ``externalscaler.proto``, generated at run time with ``grpc_tools.protoc``.

grpcio is Google's implementation, from the same family as the grpc-go client inside KEDA: an
independent check on our grpclib server. The generated code is never committed; each test session
makes its own into a temporary folder.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

PROTOS = Path(__file__).resolve().parents[2] / "protos"
PROTO = "externalscaler.proto"


@dataclass(frozen=True, slots=True)
class KedaProto:
    """The generated ``externalscaler_pb2`` and ``externalscaler_pb2_grpc`` modules, with small builders."""

    pb2: ModuleType
    pb2_grpc: ModuleType

    def ref(self, metadata: dict[str, str], *, name: str = "app", namespace: str = "ml") -> Any:
        """A ``ScaledObjectRef`` as KEDA fills it."""
        return self.pb2.ScaledObjectRef(name=name, namespace=namespace, scalerMetadata=metadata)

    def metrics_request(self, metadata: dict[str, str], metric_name: str) -> Any:
        return self.pb2.GetMetricsRequest(scaledObjectRef=self.ref(metadata), metricName=metric_name)

    def stub(self, channel: Any) -> Any:
        """An ``ExternalScalerStub`` on a grpcio channel (sync or ``grpc.aio``)."""
        return self.pb2_grpc.ExternalScalerStub(channel)


def generate(out_dir: Path) -> KedaProto:
    """Run protoc on ``protos/externalscaler.proto`` into ``out_dir`` and import the result."""
    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTOS}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            PROTO,
        ],
        check=True,
        capture_output=True,
    )
    if "externalscaler_pb2" in sys.modules:  # a second session in one process: reuse, the proto is the same
        return KedaProto(sys.modules["externalscaler_pb2"], sys.modules["externalscaler_pb2_grpc"])
    # The _grpc module imports its sibling by its bare name, so the folder must be on the path while importing.
    sys.path.insert(0, str(out_dir))
    try:
        pb2 = importlib.import_module("externalscaler_pb2")
        pb2_grpc = importlib.import_module("externalscaler_pb2_grpc")
    finally:
        sys.path.remove(str(out_dir))
    return KedaProto(pb2, pb2_grpc)
