"""Fixtures shared with the node agent's and controllerctl's tests."""

from tests.ctl.conftest import live  # noqa: F401
from tests.nodeagent.conftest import agent_factory  # noqa: F401
