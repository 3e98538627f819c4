"""Fixtures for the backend tests: a real 4-node Slurm cluster on loopback, started per test
(``slurm_cluster``) or once per module (``slurm_cluster_module``, for tests that leave it as they found it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.backends.slurm_cluster import SlurmCluster, missing_binaries

REPO = Path(__file__).resolve().parents[2]
PROLOG = REPO / "deploy" / "slurm" / "prolog.sh"


def _skip_reason() -> str | None:
    missing = missing_binaries()
    if missing:
        return f"Slurm binaries missing ({', '.join(missing)}): apt-get install slurmctld slurmd slurm-client"
    if os.geteuid() != 0:
        return "the throwaway Slurm cluster runs slurmd as root"
    return None


@contextlib.contextmanager
def _cluster(tmp_path_factory: pytest.TempPathFactory, nodes: int = 4) -> Iterator[SlurmCluster]:
    """Four nodes (node1..node4, or `nodes`) on 127.0.0.1; the prolog is deploy/slurm/prolog.sh with a
    stand-in preflight that FAILs (exit 1) on the nodes listed in ``<root>/preflight-fails``
    and cannot run (exit 2) on those in ``<root>/preflight-errors``."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    # Short path: slurmd's spool sockets must fit in sun_path (108 bytes).
    root = tmp_path_factory.mktemp("slurm")
    fake_preflight = root / "fake-preflight"
    fake_preflight.write_text(
        "#!/bin/bash\n"
        "# Stand-in for `preflight run --quick`: FAIL (exit 1) on the nodes listed in preflight-fails.\n"
        f'if grep -qx "$SLURMD_NODENAME" {root}/preflight-fails 2>/dev/null; then\n'
        '  echo "gpu_matmul FAIL: 41 TFLOPS, expected >= 300"; exit 1; fi\n'
        f'if grep -qx "$SLURMD_NODENAME" {root}/preflight-errors 2>/dev/null; then\n'
        '  echo "cannot load NVML"; exit 2; fi\n'
        'echo "all checks passed"; exit 0\n'
    )
    fake_preflight.chmod(0o755)
    prolog_conf = root / "prolog.conf"
    prolog_conf.write_text(f"RUNWARDEN_PREFLIGHT={fake_preflight}\nSLURM_CONF={root}/slurm.conf\n")
    wrapper = root / "prolog"
    # Slurm's Prolog= takes no arguments and a bare environment: point the hook at its config.
    wrapper.write_text(f"#!/bin/bash\nexport RUNWARDEN_PROLOG_CONF={prolog_conf}\nexec {PROLOG}\n")
    wrapper.chmod(0o755)
    cluster = SlurmCluster(root, nodes=nodes, prolog=str(wrapper))
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()


@pytest.fixture
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with _cluster(tmp_path_factory) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def slurm_cluster_module(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[SlurmCluster]:
    """One cluster for the module: `SLURM_NODES` nodes where the module sets it, else four."""
    with _cluster(tmp_path_factory, getattr(request.module, "SLURM_NODES", 4)) as cluster:
        yield cluster
