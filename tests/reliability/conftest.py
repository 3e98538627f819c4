"""A whole local deployment per test (tests/e2e's fixture): etcd, agents and controller processes."""

from tests.e2e.conftest import make_cluster  # noqa: F401
from tests.nodeagent.conftest import agent_factory  # noqa: F401
