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


def pcie(device: Path, width: str, max_width: str, speed: str = "16.0 GT/s PCIe") -> None:
    (device / "current_link_width").write_text(width + "\n")
    (device / "max_link_width").write_text(max_width + "\n")
    (device / "current_link_speed").write_text(speed + "\n")
    (device / "max_link_speed").write_text("16.0 GT/s PCIe\n")


def test_a_nic_missing_from_the_expected_count_fails_and_an_unset_count_says_so(tmp_path: Path) -> None:
    nic(tmp_path, "eth0", "up", "1")
    nic(tmp_path, "eth1", "up", "1")
    nic(tmp_path, "veth0", "up", "1", physical=False)  # virtual: not counted

    def count(**kw: object) -> CheckResult:
        return next(r for r in run(tmp_path, **kw) if r.name == "network.nic_count")

    assert count(expected_nic_count=2).status is CheckStatus.PASS
    short = count(expected_nic_count=4)
    assert short.status is CheckStatus.FAIL
    assert "2 physical NIC(s), expected 4" in short.message
    assert "eth0, eth1" in short.evidence[0]
    assert count(expected_nic_count=1).status is CheckStatus.WARN
    unset = count()
    assert unset.status is CheckStatus.SKIP
    assert "expected_nic_count is unset" in unset.message


def test_a_nic_or_hca_pcie_link_trained_narrow_fails_naming_the_widths(tmp_path: Path) -> None:
    nic(tmp_path, "eth0", "up", "1")
    nic(tmp_path, "eth1", "up", "1")
    nic(tmp_path, "eth2", "up", "1")
    pcie(tmp_path / "class" / "net" / "eth0" / "device", "16", "16")
    pcie(tmp_path / "class" / "net" / "eth1" / "device", "4", "16", speed="8.0 GT/s PCIe")
    pcie(tmp_path / "class" / "net" / "eth2" / "device", "0", "0")  # a VF: cannot say, not judged
    ib_port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "5: LinkUp")
    hca = tmp_path / "class" / "infiniband" / "mlx5_0" / "device"
    hca.mkdir()
    pcie(hca, "8", "16")
    results = [r for r in run(tmp_path) if r.name == "network.nic_pcie"]
    assert [(r.status, r.message.split()[0]) for r in results] == [
        (CheckStatus.PASS, "eth0"),
        (CheckStatus.FAIL, "eth1"),
        (CheckStatus.FAIL, "mlx5_0"),
    ]
    assert "PCIe link x4, below its max x16" in results[1].message
    assert "current_link_speed='8.0 GT/s PCIe'" in results[1].evidence[0]
    warn = [r.status for r in run(tmp_path, pcie_width_below_max="warn") if r.name == "network.nic_pcie"]
    assert warn == [CheckStatus.PASS, CheckStatus.WARN, CheckStatus.WARN]
    assert not [r for r in run(tmp_path, pcie_width_below_max="ignore") if r.name == "network.nic_pcie"]


def test_an_hca_and_its_ipoib_interface_are_judged_once(tmp_path: Path) -> None:
    ib_port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "5: LinkUp")
    pci = tmp_path / "devices" / "pci0000:00" / "0000:17:00.0"
    pci.mkdir(parents=True)
    pcie(pci, "16", "16")
    (tmp_path / "class" / "infiniband" / "mlx5_0" / "device").symlink_to(pci)
    ib0 = tmp_path / "class" / "net" / "ib0"
    ib0.mkdir(parents=True)
    for key, value in (("operstate", "up"), ("carrier", "1"), ("speed", "400000")):
        (ib0 / key).write_text(value + "\n")
    (ib0 / "device").symlink_to(pci)
    assert len([r for r in run(tmp_path) if r.name == "network.nic_pcie"]) == 1
