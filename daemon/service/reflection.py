"""gRPC server reflection under both ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

grpcio-reflection serves only ``v1alpha``; clients that speak only ``v1`` (newer grpcurl, Postman,
grpcui) got UNIMPLEMENTED. ``v1`` is a rename of ``v1alpha`` with the same messages and field
numbers (grpc/grpc ``src/proto/grpc/reflection/v1/reflection.proto``), so the same servicer answers
both: the ``v1`` descriptor is derived from the ``v1alpha`` one at import (package renamed) and added to
the default pool, so ``v1`` clients can also describe the reflection service itself.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as alpha_pb2

ALPHA_PACKAGE = "grpc.reflection.v1alpha"
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME


def _v1_file() -> Any:
    """The ``grpc/reflection/v1/reflection.proto`` descriptor, built from ``v1alpha``'s."""
    pool = descriptor_pool.Default()
    name = "grpc/reflection/v1/reflection.proto"
    try:
        return pool.FindFileByName(name)
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    alpha_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name = name
    fdp.package = V1_PACKAGE
    fdp.ClearField("options")
    old, new = f".{ALPHA_PACKAGE}.", f".{V1_PACKAGE}."
    for msg in fdp.message_type:
        for field in msg.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new)
    for service in fdp.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    pool.Add(fdp)
    return pool.FindFileByName(name)


V1_DESCRIPTOR = _v1_file()
V1Request: Any = message_factory.GetMessageClass(V1_DESCRIPTOR.message_types_by_name["ServerReflectionRequest"])
V1Response: Any = message_factory.GetMessageClass(V1_DESCRIPTOR.message_types_by_name["ServerReflectionResponse"])


def enable(service_names: tuple[str, ...], server: grpc.Server | grpc.aio.Server) -> None:
    """Serve reflection for ``service_names`` (plus both reflection services) on ``server``.

    Both paths run grpcio-reflection's servicer; ``v1`` requests are decoded as ``v1alpha`` messages,
    which are the same on the wire.
    """
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    servicer: Any = (
        reflection.aio.ReflectionServicer(names)
        if isinstance(server, grpc.aio.Server)
        else reflection.ReflectionServicer(names)
    )
    handler = grpc.method_handlers_generic_handler(
        V1_SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=alpha_pb2.ServerReflectionRequest.FromString,
                response_serializer=alpha_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))
