"""Network, where present: InfiniBand port state and error counters, NIC link state (from sysfs)."""

from __future__ import annotations

import os
from pathlib import Path

from preflight.checks.base import CheckContext, CheckSpec
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


def nic_results(cfg: NetworkConfig, sysfs: Path) -> list[CheckResult]:
    net = sysfs / "class" / "net"
    if cfg.nics:
        names = list(cfg.nics)
    else:
        # Physical NICs have a `device` link; virtual ones (lo, veth, bridges) do not.
        names = sorted(p.name for p in net.iterdir() if (p / "device").exists()) if net.is_dir() else []
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
    return passed(
        "network.nic_link", f"{nic} up at {mbps} Mb/s", evidence=evidence, value=float(mbps), unit="Mb/s"
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
    return results + nic_results(cfg, sysfs)


SPEC = CheckSpec(
    name="network",
    run=run_network,
    timeout_s=lambda c, m: c.network.timeout_s,
    modes=lambda c: c.network.modes,
)
