"""Network checks read sysfs; the tests build a sysfs tree laid out as the kernel's (files, not mocks)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from preflight.config import NetworkConfig, PreflightConfig
from preflight.result import CheckResult, CheckStatus
from preflight.runner import run_preflight


def ib_port(root: Path, dev: str, port: int, state: str, phys: str, **counters: int) -> None:
    base = root / "class" / "infiniband" / dev / "ports" / str(port)
    (base / "counters").mkdir(parents=True)
    (base / "state").write_text(state + "\n")
    (base / "phys_state").write_text(phys + "\n")
    (base / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (base / "link_layer").write_text("InfiniBand\n")
    for name in ("symbol_error", "link_downed", "port_rcv_errors"):
        (base / "counters" / name).write_text(f"{counters.get(name, 0)}\n")


def nic(root: Path, name: str, oper: str, carrier: str, physical: bool = True, speed: str = "100000") -> None:
    base = root / "class" / "net" / name
    base.mkdir(parents=True)
    (base / "operstate").write_text(oper + "\n")
    (base / "carrier").write_text(carrier + "\n")
    (base / "speed").write_text(speed + "\n")
    if physical:
        (base / "device").mkdir()


def run(root: Path, **kw: object) -> list[CheckResult]:
    cfg = dataclasses.replace(PreflightConfig(), network=NetworkConfig(sysfs_root=str(root), **kw))
    return list(run_preflight(cfg, "quick", only=("network",)).results)


def test_ib_ports_up_down_and_with_errors(tmp_path: Path) -> None:
    ib_port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "5: LinkUp")
    ib_port(tmp_path, "mlx5_1", 1, "1: DOWN", "3: Disabled")
    ib_port(tmp_path, "mlx5_2", 1, "4: ACTIVE", "5: LinkUp", symbol_error=12, link_downed=1)
    nic(tmp_path, "eth0", "up", "1")
    results = run(tmp_path)
    ib = [r for r in results if r.name == "network.ib_port"]
    assert [r.status for r in ib] == [CheckStatus.PASS, CheckStatus.FAIL, CheckStatus.WARN]
    assert "mlx5_1/1 is not up" in ib[1].message
    assert "mlx5_2/1: symbol_error=12" in ib[2].evidence


def test_no_infiniband_is_skip_unless_required(tmp_path: Path) -> None:
    nic(tmp_path, "eth0", "up", "1")
    assert run(tmp_path)[0].status is CheckStatus.SKIP
    assert run(tmp_path, require_ib=True)[0].status is CheckStatus.FAIL


def test_nic_link_state(tmp_path: Path) -> None:
    nic(tmp_path, "eth0", "up", "1")
    nic(tmp_path, "eth1", "down", "0")
    nic(tmp_path, "veth9", "up", "1", physical=False)
    results = [r for r in run(tmp_path) if r.name == "network.nic_link"]
    assert [(r.status, r.evidence[0].split(":")[0]) for r in results] == [
        (CheckStatus.PASS, "eth0"),
        (CheckStatus.FAIL, "eth1"),
    ]
    configured = [r for r in run(tmp_path, nics=("veth9", "ib9")) if r.name == "network.nic_link"]
    assert [r.status for r in configured] == [CheckStatus.PASS, CheckStatus.FAIL]


def test_no_physical_nic_is_skip(tmp_path: Path) -> None:
    nic(tmp_path, "lo", "unknown", "1", physical=False)
    results = [r for r in run(tmp_path) if r.name == "network.nic_link"]
    assert [r.status for r in results] == [CheckStatus.SKIP]


def test_an_unknown_link_speed_warns_and_a_slow_link_fails_under_its_floor(tmp_path: Path) -> None:
    nic(tmp_path, "eth0", "up", "1", speed="-1")
    nic(tmp_path, "eth1", "up", "1", speed="25000")
    nic(tmp_path, "eth2", "up", "1", speed="100000")
    results = [r for r in run(tmp_path, min_speed_mbps=100000) if r.name == "network.nic_link"]
    assert [r.status for r in results] == [CheckStatus.WARN, CheckStatus.FAIL, CheckStatus.PASS]
    assert "speed is unknown (-1)" in results[0].message
    assert "25000 Mb/s, below the 100000 Mb/s floor" in results[1].message
    unset = [r for r in run(tmp_path) if r.name == "network.nic_link"]
    assert [r.status for r in unset] == [CheckStatus.WARN, CheckStatus.PASS, CheckStatus.PASS]
