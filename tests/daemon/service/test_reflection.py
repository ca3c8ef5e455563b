"""grpcurl-style discovery through server reflection: list, describe, then call with only what was discovered."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2 as alpha_pb2

from gpusnap.daemon.service import reflection
from tests.conftest import DaemonProc

GPUSNAP_SERVICES = {"gpusnap.v1.OperationService", "gpusnap.v1.SnapshotService", "gpusnap.v1.NodeService"}


class _Client:
    """A reflection client of one version: it knows only the request/response classes and the path."""

    def __init__(self, channel: grpc.Channel, service: str, request: Any, response: Any):
        self.call = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=request.SerializeToString,
            response_deserializer=response.FromString,
        )
        self.request = request

    def ask(self, **fields: Any) -> Any:
        (answer,) = list(self.call(iter([self.request(**fields)]), timeout=10))
        return answer

    def services(self) -> set[str]:
        return {s.name for s in self.ask(list_services="").list_services_response.service}

    def pool_for(self, symbol: str) -> descriptor_pool.DescriptorPool:
        """A fresh pool with the file defining ``symbol`` and, recursively, its imports."""
        pool = descriptor_pool.DescriptorPool()
        files: dict[str, descriptor_pb2.FileDescriptorProto] = {}

        def add(blobs: Iterable[bytes]) -> None:
            for blob in blobs:
                fdp = descriptor_pb2.FileDescriptorProto.FromString(blob)
                files.setdefault(fdp.name, fdp)

        add(self.ask(file_containing_symbol=symbol).file_descriptor_response.file_descriptor_proto)
        added: set[str] = set()

        def load(name: str) -> None:
            if name in added:
                return
            if name not in files:
                add(self.ask(file_by_filename=name).file_descriptor_response.file_descriptor_proto)
            for dep in files[name].dependency:
                load(dep)
            pool.Add(files[name])
            added.add(name)

        for name in list(files):
            load(name)
        return pool


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_discovery_with_one_reflection_version(daemon: DaemonProc, version: str) -> None:
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        if version == "v1":
            client = _Client(channel, reflection.V1_SERVICE_NAME, reflection.V1Request, reflection.V1Response)
        else:
            client = _Client(
                channel,
                reflection.V1ALPHA_SERVICE_NAME,
                alpha_pb2.ServerReflectionRequest,
                alpha_pb2.ServerReflectionResponse,
            )
        names = client.services()
        assert GPUSNAP_SERVICES <= names
        assert {"grpc.health.v1.Health", reflection.V1_SERVICE_NAME, reflection.V1ALPHA_SERVICE_NAME} <= names
        for name in names:  # every listed service can be described
            service = client.pool_for(name).FindServiceByName(name)
            assert service.methods, name
        ops = client.pool_for("gpusnap.v1.OperationService").FindServiceByName("gpusnap.v1.OperationService")
        assert {"Checkpoint", "Restore", "WaitOperation"} <= {m.name for m in ops.methods}

        # Call GetNodeInfo with message classes built only from the discovered descriptors.
        node = client.pool_for("gpusnap.v1.NodeService").FindServiceByName("gpusnap.v1.NodeService")
        method = node.methods_by_name["GetNodeInfo"]
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary(
            f"/{node.full_name}/GetNodeInfo",
            request_serializer=req_cls.SerializeToString,
            response_deserializer=resp_cls.FromString,
        )
        answer = call(req_cls(), timeout=10)
        assert answer.node.host.criu_version.startswith("4.")
        assert answer.node.store_path == str(daemon.store)


def test_unknown_symbol_is_not_found_on_v1(daemon: DaemonProc) -> None:
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        client = _Client(channel, reflection.V1_SERVICE_NAME, reflection.V1Request, reflection.V1Response)
        answer = client.ask(file_containing_symbol="no.such.Service")
        assert answer.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
