"""What a piece of hardware evidence means: one definition, used by the agent, the core and goodput.

`is_fatal(ev)` is the only answer to "must this node stop running work?": an application-caused
record (Xid 13/31/43: the job's fault) never is; an uncorrectable ECC error, a row-remap failure or a
GPU off the bus always is, whatever the severity field says; anything else (an Xid, a link, a PCIe
record) is fatal when its agent marked it SEVERITY_FATAL.
"""

from __future__ import annotations

from runwarden.v1 import common_pb2

K = common_pb2.EvidenceKind

ALWAYS_FATAL_KINDS = frozenset({
    K.EVIDENCE_KIND_ECC_UNCORRECTABLE,
    K.EVIDENCE_KIND_ROW_REMAP_FAILURE,
    K.EVIDENCE_KIND_GPU_LOST,
})  # fmt: skip

# The short name of each kind, for messages and goodput causes ("hardware:<name>").
KIND_NAMES: dict[int, str] = {
    K.EVIDENCE_KIND_XID: "xid",
    K.EVIDENCE_KIND_ECC_UNCORRECTABLE: "ecc",
    K.EVIDENCE_KIND_ROW_REMAP_FAILURE: "row_remap",
    K.EVIDENCE_KIND_ROW_REMAP_PENDING: "row_remap",
    K.EVIDENCE_KIND_RETIRED_PAGES_PENDING: "retired_pages",
    K.EVIDENCE_KIND_GPU_LOST: "gpu_lost",
    K.EVIDENCE_KIND_THROTTLE: "throttle",
    K.EVIDENCE_KIND_PCIE_DEGRADED: "pcie",
    K.EVIDENCE_KIND_NETWORK: "network",
    K.EVIDENCE_KIND_PREFLIGHT_FAIL: "preflight",
    K.EVIDENCE_KIND_FLIGHT_RECORDER: "flight_recorder",
    K.EVIDENCE_KIND_HEARTBEAT: "heartbeat",
    K.EVIDENCE_KIND_STRAGGLER: "straggler",
    K.EVIDENCE_KIND_RECOVERY_ACTION: "recovery_action",
}


def is_fatal(ev: common_pb2.Evidence) -> bool:
    """The node must not run work until it is repaired (see the module docstring)."""
    if ev.severity == common_pb2.SEVERITY_APPLICATION:
        return False
    return ev.kind in ALWAYS_FATAL_KINDS or ev.severity == common_pb2.SEVERITY_FATAL


def kind_name(kind: int) -> str:
    """The proto name of an evidence kind, or its number when this build does not know it."""
    return K.Name(kind) if kind in K.values() else str(kind)  # type: ignore[arg-type]  # an int from the wire
