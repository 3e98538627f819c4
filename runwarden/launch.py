"""The torchrun line and the collective environment: the one rule every launcher follows.

Both sides import it: the controller's scheduler backends (controller/backends/base.py wraps it for an
`AttemptSpec`) and the node agent, which builds its own node's line from its own config and a
structured launch request. Nothing here knows about either side. `torchrun_argv` gives one
rendezvous per attempt and no in-place restarts.
"""

from __future__ import annotations

from collections.abc import Sequence

# How torchrun is started when nothing else is configured: `python -m torch.distributed.run` under the
# interpreter of whoever launches it (the console script `torchrun` may belong to another environment).
TORCHRUN_MODULE = ("-m", "torch.distributed.run")

# How many of its attempt's peers a node is told of (`TorchrunLaunch.peers`): the ones it asks, when its
# own lease cannot be renewed, whether they can renew theirs. A few suffice to tell an etcd outage from
# a partition of this host; all of them made every launch O(nodes) in size and the attempt's O(nodes^2)
# (2,047 addresses in each of 2,048 requests).
LIVENESS_PEERS = 8


def liveness_peers(nodes: Sequence[str], rank: int, k: int = LIVENESS_PEERS) -> list[str]:
    """The `k` nodes after node rank `rank` in the attempt's order, wrapping: each node is asked by `k`
    others, never the first few by everyone."""
    return [nodes[(rank + j) % len(nodes)] for j in range(1, min(k, len(nodes) - 1) + 1)]


def torchrun_argv(
    *,
    prefix: Sequence[str],
    nnodes: int,
    nproc_per_node: int,
    endpoint: str,
    rdzv_id: str,
    command: Sequence[str],
    node_rank: int | None = None,
    is_host: bool | None = None,
    local_addr: str = "",
    no_python: bool = True,
) -> list[str]:
    """torchrun's argv for one attempt.

    node_rank / is_host: given when each node's torchrun is started on its own (one agent per node);
    None when a scheduler starts the same line everywhere and c10d ranks the nodes. no_python:
    `command` is a full argv with its own interpreter; False when it starts at a script torchrun runs
    with its own interpreter.

    The line (one rendezvous per attempt, no in-place restarts):

        <prefix> --nnodes=N --nproc-per-node=P [--node-rank=R] --rdzv-backend=c10d
                 --rdzv-endpoint=HOST:PORT --rdzv-id=<run>-<attempt> [--rdzv-conf=is_host=true|false]
                 [--local-addr=ADDR] --max-restarts=0 [--no-python] <command...>

    * ``--max-restarts=0``: every failure goes through the supervisor, which can blame and replace a
      node; torchrun restarting in place would hide the failure and reuse a bad node.
    * ``--rdzv-conf=is_host``: said explicitly when each node's line is started on its own (node rank 0
      hosts the c10d store; torch's own guess compares host names, which a container or a namespace
      host gets wrong).
    * ``--local-addr``: the address torch advertises for this node -- as the master address when c10d
      makes it global rank 0, and in the rendezvous. Without it torch advertises the host name, which on
      many hosts resolves to loopback.
    """
    if not prefix:
        raise ValueError("torchrun prefix: must be a non-empty argv")
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nnodes and nproc_per_node must be >= 1, got {nnodes} and {nproc_per_node}")
    if not command:
        raise ValueError("command: must be a non-empty argv")
    return [
        *prefix,
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        *([] if node_rank is None else [f"--node-rank={node_rank}"]),
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
        *([] if is_host is None else [f"--rdzv-conf=is_host={'true' if is_host else 'false'}"]),
        *([f"--local-addr={local_addr}"] if local_addr else []),
        "--max-restarts=0",
        *(["--no-python"] if no_python else []),
        *command,
    ]


def collective_env(ifname: str) -> dict[str, str]:
    """The socket interface gloo and NCCL use for their connections ({} when unset: torch's default)."""
    if not ifname:
        return {}
    return {"GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname}


def endpoint(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets (what torchrun's endpoint parser expects)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
