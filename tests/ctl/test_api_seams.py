"""The Controller servicer's seams are typed: each RPC handler takes its own request and returns its own response."""

from __future__ import annotations

import typing
from collections.abc import Iterator

import pytest

from controller.api.service import ControllerServicer
from runwarden.v1 import controller_pb2

SERVICE = controller_pb2.DESCRIPTOR.services_by_name["Controller"]
METHODS = list(SERVICE.methods)


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_every_rpc_handler_takes_its_own_request_type(method: typing.Any) -> None:
    handler = getattr(ControllerServicer, method.name)
    hints = typing.get_type_hints(handler)
    assert hints["request"].DESCRIPTOR.full_name == method.input_type.full_name
    response = hints["return"]
    if method.server_streaming:
        assert typing.get_origin(response) is Iterator
        (response,) = typing.get_args(response)
    assert response.DESCRIPTOR.full_name == method.output_type.full_name
