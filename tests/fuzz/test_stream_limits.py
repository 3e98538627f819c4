"""Streams are bounded: open WatchEvents streams must not starve the Controller API's other RPCs.

The API serves with a 16-thread pool; WatchEvents streams are capped at half of it, and the
extras are refused with RESOURCE_EXHAUSTED, so 16 idle watchers cannot make GetStatus wait.
"""

from __future__ import annotations

import grpc
import pytest

from runwarden.v1 import controller_pb2, controller_pb2_grpc
from tests.ctl.conftest import LiveController

pytestmark = [pytest.mark.timeout(120)]


def test_idle_watch_streams_do_not_starve_other_rpcs(live: LiveController) -> None:
    channels = [grpc.insecure_channel(live.address) for _ in range(16)]
    streams = [
        controller_pb2_grpc.ControllerStub(c).WatchEvents(controller_pb2.WatchEventsRequest(), timeout=60)
        for c in channels
    ]
    try:
        for s in streams:  # each is being served (or was refused with a clear status)
            try:
                next(s)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        channel = grpc.insecure_channel(live.address)
        reply = controller_pb2_grpc.ControllerStub(channel).GetStatus(
            controller_pb2.GetStatusRequest(), timeout=5
        )
        assert reply.runs
        channel.close()
    finally:
        for s in streams:
            s.cancel()
        for c in channels:
            c.close()
