"""What the agent and its ranks agree on, and the one nodeagent module both processes import (no
torch, no gRPC): the path of the agent's progress socket, and the flight recorder's per-rank socket
layout and environment. The launcher sets the environment, the ranks (nodeagent.trainer) bind these
paths, the agent (nodeagent.daemon) finds and reads them."""

from __future__ import annotations

from pathlib import Path

FR_ENV_SOCKET_DIR = "RUNWARDEN_FR_SOCKET_DIR"  # set by the launcher; one socket per rank inside it
FR_JSON_HANDLER = "fr_trace_json"  # the worker server's handler the agent asks: POST /handler/<it>
FR_ENV_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
FR_DEFAULT_BUFFER_SIZE = 2000
FR_MAX_SOCKET_PATH = 107  # bytes: sun_path is 108 with the terminating NUL


def progress_socket_path(agent_socket: str) -> str:
    """The agent's datagram socket for progress reports, beside its gRPC unix socket."""
    return agent_socket + ".progress"


def fr_socket_path(socket_dir: Path, rank: int) -> Path:
    """Where rank `rank`'s flight-recorder server listens."""
    return socket_dir / f"rank{rank}.sock"


def fr_pg_config_path(socket_path: Path) -> Path:
    """The real pg_config a rank writes beside its socket (the agent merges it into the dump)."""
    return socket_path.with_suffix(".pg.json")
