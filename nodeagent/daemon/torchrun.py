"""A structured launch (`LaunchWorkersRequest.torchrun`) -> this node's torchrun line and environment.

The controller says only what is per attempt (the command, the rendezvous endpoint and id, the node
count and this node's rank, whether it hosts the c10d store); everything about the host is the
agent's own and never chosen on the controller's host:

* the torchrun prefix (`torchrun` in config: by default this agent's own interpreter), and with
  `no_python` the command's executable too, must be in `allowed_executables`;
* `--nproc-per-node` is this node's rank count (`NodeFacts.local_ranks`);
* `--local-addr` is the host this agent advertises, so torch advertises an address peers can reach
  (as the master address when c10d makes this node global rank 0) instead of the host name;
* the collective interface (`collective_ifname`) becomes GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME;
* a node told to host the store must be told its own endpoint (its torch host and `rdzv_port`, as
  its node record says): anything else is a stale record, refused before anything starts;
* an unmodified script (`script_mode: SCRIPT_MODE_UNMODIFIED`) runs through the bootstrap:
  `rank_command` makes the command `-m nodeagent.trainer.bootstrap <command...>` (nodeagent.trainer.bootstrap),
  for torchrun's line and the warm path's hand-off alike.

The argv rule itself is `runwarden.launch.torchrun_argv`, the one the controller's backends use.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from runwarden import launch
from runwarden.net import free_port
from runwarden.v1 import agent_pb2

_WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})
BOOTSTRAP = ("-m", "nodeagent.trainer.bootstrap")


def rank_command(t: agent_pb2.TorchrunLaunch) -> tuple[str, ...]:
    """What each rank runs: the command, behind the bootstrap for an unmodified script."""
    if t.script_mode == agent_pb2.SCRIPT_MODE_UNMODIFIED:
        return (*BOOTSTRAP, *t.command)
    return tuple(t.command)


class TorchrunRefused(Exception):
    """The launch does not fit this node (not a malformed request: those fail validation first)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeFacts:
    """What this node contributes to its torchrun line (from its config and start-up)."""

    torchrun: tuple[str, ...]
    local_ranks: int
    torch_host: str  # "" when the advertised host is a wildcard: nothing to advertise
    rdzv_port: int
    collective_ifname: str


def torch_host(advertised_host: str) -> str:
    """The host torch should advertise for this node: the advertised host, unless it is a wildcard."""
    return "" if advertised_host in _WILDCARDS else advertised_host


def pick_rdzv_port() -> int:
    """A port free on every address right now and outside the kernel's ephemeral range: torch's c10d
    store listens on the wildcard address (a port free only on the advertised host could still
    clash), and it binds the port minutes later, at the first launch, by when an outgoing connection
    could hold a port taken from the ephemeral range as its source."""
    return free_port("")


def build(
    facts: NodeFacts, req: agent_pb2.LaunchWorkersRequest, rendezvous_id: str
) -> tuple[list[str], dict[str, str]]:
    """This node's torchrun argv and the environment it adds on top of the request's.

    Raises TorchrunRefused when the request cannot run here (no host to advertise, or a store this
    node is asked to host at an endpoint that is not its own)."""
    t = req.torchrun
    if not facts.torch_host:
        raise TorchrunRefused(
            "this agent advertises a wildcard host: set `advertise` to an address its peers can reach"
        )
    if t.is_host:
        host, port = split_endpoint(t.rdzv_endpoint)
        if not _same_host(host, facts.torch_host) or port != facts.rdzv_port:
            raise TorchrunRefused(
                f"torchrun.rdzv_endpoint {t.rdzv_endpoint!r} is not this node's own "
                f"({launch.endpoint(facts.torch_host, facts.rdzv_port)}), yet is_host is set: "
                "the controller used a stale node record"
            )
    argv = launch.torchrun_argv(
        prefix=facts.torchrun,
        nnodes=req.nnodes,
        nproc_per_node=facts.local_ranks,
        endpoint=t.rdzv_endpoint,
        rdzv_id=rendezvous_id,
        command=rank_command(t),
        node_rank=req.node_rank,
        is_host=t.is_host,
        local_addr=facts.torch_host,
        no_python=t.no_python,
    )
    return argv, launch.collective_env(facts.collective_ifname)


def split_endpoint(value: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port); ValueError if it is neither."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"an IPv6 host needs brackets: {value[:80]!r}")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"expected host:port with a port in 1..65535, got {value[:80]!r}")
    if len(host) > 253 or any(c.isspace() or c in "\0/[]" for c in host):
        raise ValueError(f"not a host name or address: {host[:80]!r}")
    return host, int(port)


def _same_host(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a.lower() == b.lower()
