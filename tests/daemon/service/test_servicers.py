"""The service edge's one style: a servicer is a coroutine on the server's loop, and a unary RPC does its work
(decode, the Daemon call, encode) on the ``rpc`` lane, within the caller's limits; a domain error ends the RPC
with its status, anything else with INTERNAL."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import grpc
import pytest

from gpusnap.daemon._proto import node_pb2
from gpusnap.daemon.api.errors import NotFoundError
from gpusnap.daemon.api.types import ROOT_CALLER, Caller
from gpusnap.daemon.service.limits import CallerLimits
from gpusnap.daemon.service.servicers import _Servicer


class _Aborted(Exception):
    pass


class _Context:
    """The parts of ``grpc.aio.ServicerContext`` the edge uses."""

    def __init__(self) -> None:
        self.status: grpc.Status | None = None
        self.done: list[Any] = []

    def peer(self) -> str:
        return "unix:"

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        self.status = status
        raise _Aborted

    def add_done_callback(self, callback: Any) -> None:
        self.done.append(callback)


class _Edge(_Servicer):
    def caller(self, context: Any) -> Caller:
        return ROOT_CALLER


@pytest.fixture
def edge() -> Any:
    lane = ThreadPoolExecutor(1, thread_name_prefix="gpusnap-rpc")
    yield _Edge(None, None, lane, CallerLimits(calls=1, queued=1, streams=1, unsent_per_connection=1 << 20))  # type: ignore[arg-type]
    lane.shutdown()


def test_the_work_runs_on_the_rpc_lane_and_its_answer_counts_until_sent(edge: _Edge) -> None:
    context = _Context()
    ran_on: list[str] = []

    def answer(caller: Caller) -> node_pb2.GetNodeInfoResponse:
        ran_on.append(threading.current_thread().name)
        return node_pb2.GetNodeInfoResponse(node=node_pb2.NodeInfo(store_path="n" * 100))

    response = asyncio.run(edge.unary(context, answer))  # type: ignore[arg-type]
    assert response.node.store_path == "n" * 100
    assert ran_on and ran_on[0].startswith("gpusnap-rpc")
    assert edge.limits._unsent_by_connection["unix:"] == response.ByteSize()
    context.done[0](None)  # sent
    assert not edge.limits._unsent_by_connection


def test_a_domain_error_ends_the_rpc_with_its_status_and_a_bug_with_internal(edge: _Edge) -> None:
    def missing(caller: Caller) -> node_pb2.GetNodeInfoResponse:
        raise NotFoundError("no snapshot abc", reason="SNAPSHOT_NOT_FOUND")

    def bug(caller: Caller) -> node_pb2.GetNodeInfoResponse:
        raise KeyError("oops")

    for work, code, words in (
        (missing, grpc.StatusCode.NOT_FOUND, "no snapshot abc"),
        (bug, grpc.StatusCode.INTERNAL, "KeyError"),
    ):
        context = _Context()
        with pytest.raises(_Aborted):
            asyncio.run(edge.unary(context, work))  # type: ignore[arg-type]
        assert context.status is not None and context.status.code is code and words in context.status.details
        assert not context.done, "no answer to count"
