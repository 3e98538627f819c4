"""Network, where present: InfiniBand port state and error counters, NIC link state and speed, the
NIC/HCA PCIe link width and the expected NIC count (all from sysfs). A link trained at a fraction of
its width and a missing NIC both look healthy to a link-state check and halve a node's bandwidth,
so both are checked. One of the quick preflight's units (`preflight.runner`).
"""

from __future__ import annotations

import os
from pathlib import Path

from preflight.checks.base import CheckContext, CheckSpec
from preflight.checks.expectations import no_floor
from preflight.config import NetworkConfig
from preflight.result import CheckResult, failed, passed, skipped, warned

# Port counters that only grow on link trouble (IBTA PortCounters, as exposed by the kernel in
# /sys/class/infiniband/<dev>/ports/<n>/counters/). Nonzero means the link has had errors since boot.
IB_ERROR_COUNTERS = (
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "port_xmit_discards",
)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def ib_port_results(sysfs: Path) -> list[CheckResult]:
    results = []
    for dev in sorted((sysfs / "class" / "infiniband").iterdir()):
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
            label = f"{dev.name}/{port.name}"
            state, phys = _read(port / "state"), _read(port / "phys_state")
            rate, layer = _read(port / "rate"), _read(port / "link_layer")
            evidence = [f"{label}: state={state!r} phys_state={phys!r} rate={rate!r} link_layer={layer!r}"]
            errors = {}
            for counter in IB_ERROR_COUNTERS:
                text = _read(port / "counters" / counter)
                if text.isdigit() and int(text) > 0:
                    errors[counter] = int(text)
            evidence += [f"{label}: {k}={v}" for k, v in errors.items()]
            name = "network.ib_port"
            if "ACTIVE" not in state.upper() or "LINKUP" not in phys.upper().replace(" ", ""):
                results.append(
                    failed(
                        name,
                        f"{label} is not up ({state or '?'}, {phys or '?'})",
                        evidence=tuple(evidence),
                        remedy="check the cable, switch port and subnet manager",
                    )
                )
            elif errors:
                results.append(
                    warned(
                        name,
                        f"{label} is up but has error counters: {', '.join(errors)}",
                        evidence=tuple(evidence),
                        value=float(sum(errors.values())),
                        unit="count",
                        remedy="watch the link; reseat or replace the cable if the counters grow",
                    )
                )
            else:
                results.append(passed(name, f"{label} up at {rate or '?'}", evidence=tuple(evidence)))
    return results


def physical_nics(sysfs: Path) -> list[str]:
    """Physical NICs have a `device` link; virtual ones (lo, veth, bridges) do not."""
    net = sysfs / "class" / "net"
    return sorted(p.name for p in net.iterdir() if (p / "device").exists()) if net.is_dir() else []


def nic_count_result(cfg: NetworkConfig, sysfs: Path) -> CheckResult:
    found = physical_nics(sysfs)
    name, evidence = "network.nic_count", (f"physical NICs: {', '.join(found) or 'none'}",)
    if not cfg.expected_nic_count:
        return skipped(name, f"{len(found)} physical NIC(s); expected_nic_count is unset (0: not checked)")
    if len(found) < cfg.expected_nic_count:
        return failed(
            name,
            f"{len(found)} physical NIC(s), expected {cfg.expected_nic_count}",
            evidence=evidence,
            value=float(len(found)),
            unit="count",
            remedy="a NIC is missing: check its driver (dmesg), reseat it, or replace it",
        )
    if len(found) > cfg.expected_nic_count:
        return warned(
            name,
            f"{len(found)} physical NIC(s), more than the expected {cfg.expected_nic_count}",
            evidence=evidence,
            value=float(len(found)),
            unit="count",
            remedy="set [network] expected_nic_count to this node type's count",
        )
    return passed(
        name, f"{len(found)} physical NIC(s), as expected", evidence=evidence, value=float(len(found))
    )


def _width(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value > 0 else None  # 0 or 255: a link the device cannot report (e.g. a VF)


def pcie_results(cfg: NetworkConfig, sysfs: Path) -> list[CheckResult]:
    """Each physical NIC's and HCA's PCIe link (the PCI device's sysfs attributes) at its full width."""
    if cfg.pcie_width_below_max == "ignore":
        return []
    devices = [(n, sysfs / "class" / "net" / n / "device") for n in physical_nics(sysfs)]
    ib = sysfs / "class" / "infiniband"
    devices += [(d.name, d / "device") for d in sorted(ib.iterdir())] if ib.is_dir() else []
    results, seen = [], set()
    for label, device in devices:
        pci = device.resolve() if device.exists() else device
        if pci in seen:  # an HCA and its IPoIB interface are one PCI function
            continue
        seen.add(pci)
        cur, top = _read(device / "current_link_width"), _read(device / "max_link_width")
        speed, top_speed = _read(device / "current_link_speed"), _read(device / "max_link_speed")
        evidence = (
            f"{label}: current_link_width={cur!r} max_link_width={top!r} "
            f"current_link_speed={speed!r} max_link_speed={top_speed!r}",
        )
        width, widest = _width(cur), _width(top)
        if width is None or widest is None:
            continue  # no PCIe link attributes (a virtual function, a platform device): nothing to judge
        if width < widest:
            make = failed if cfg.pcie_width_below_max == "fail" else warned
            results.append(
                make(
                    "network.nic_pcie",
                    f"{label} PCIe link x{width}, below its max x{widest}",
                    evidence=evidence,
                    value=float(width),
                    unit="lanes",
                    remedy="the link trained narrow: reseat the card or riser, check the slot; replace if it stays",
                )
            )
        else:
            results.append(
                passed("network.nic_pcie", f"{label} PCIe x{width} ({speed or '?'})", evidence=evidence)
            )
    return results


def nic_results(cfg: NetworkConfig, sysfs: Path) -> list[CheckResult]:
    net = sysfs / "class" / "net"
    names = list(cfg.nics) if cfg.nics else physical_nics(sysfs)
    if not names:
        return [skipped("network.nic_link", "no physical NIC found in sysfs (and none configured)")]
    results = []
    for nic in names:
        base = net / nic
        if not base.exists():
            results.append(
                failed("network.nic_link", f"{nic} does not exist", remedy="check the NIC and its driver")
            )
            continue
        oper, carrier, speed = _read(base / "operstate"), _read(base / "carrier"), _read(base / "speed")
        evidence = (f"{nic}: operstate={oper!r} carrier={carrier!r} speed={speed!r}",)
        if oper != "up" or carrier != "1":
            results.append(
                failed(
                    "network.nic_link",
                    f"{nic} link is down ({oper or '?'})",
                    evidence=evidence,
                    remedy="check the cable and switch port",
                )
            )
        else:
            results.append(_speed_result(nic, speed, cfg.min_speed_mbps, evidence))
    return results


def _speed_result(nic: str, speed: str, floor_mbps: int, evidence: tuple[str, ...]) -> CheckResult:
    """An up link at a known speed passes (above the floor); an unknown one (-1, empty: the driver
    cannot say, or a virtual NIC) is a warning, never a pass that hides a link trained down."""
    try:
        mbps = int(speed)
    except ValueError:
        mbps = -1
    if mbps <= 0:
        return warned(
            "network.nic_link",
            f"{nic} is up but its link speed is unknown ({speed or 'no speed file'})",
            evidence=evidence,
            remedy="check the driver (ethtool); set [network] nics to the fabric's interfaces",
        )
    if floor_mbps and mbps < floor_mbps:
        return failed(
            "network.nic_link",
            f"{nic} is up at {mbps} Mb/s, below the {floor_mbps} Mb/s floor",
            evidence=evidence,
            value=float(mbps),
            unit="Mb/s",
            remedy="the link trained down: reseat or replace the cable or transceiver",
        )
    note = "" if floor_mbps else no_floor("network.min_speed_mbps")
    return passed(
        "network.nic_link",
        f"{nic} up at {mbps} Mb/s{note}",
        evidence=evidence,
        value=float(mbps),
        unit="Mb/s",
        threshold=float(floor_mbps) if floor_mbps else None,
    )


def run_network(ctx: CheckContext) -> list[CheckResult]:
    cfg = ctx.config.network
    sysfs = Path(cfg.sysfs_root)
    results: list[CheckResult] = []
    if (sysfs / "class" / "infiniband").is_dir() and os.listdir(sysfs / "class" / "infiniband"):
        results += ib_port_results(sysfs)
    elif cfg.require_ib:
        results.append(
            failed(
                "network.ib_port",
                "no InfiniBand device in sysfs, but require_ib is set",
                remedy="check the HCA and its driver (mlx5_core)",
            )
        )
    else:
        results.append(skipped("network.ib_port", "no InfiniBand device on this node"))
    return results + nic_results(cfg, sysfs) + [nic_count_result(cfg, sysfs)] + pcie_results(cfg, sysfs)


SPEC = CheckSpec(
    name="network",
    run=run_network,
    timeout_s=lambda c, m: c.network.timeout_s,
    modes=lambda c: c.network.modes,
)
