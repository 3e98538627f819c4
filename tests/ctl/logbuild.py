"""Building hand-written event logs for the goodput and CLI tests."""

from __future__ import annotations

from runwarden.eventlog import LogEntry
from runwarden.v1 import common_pb2, events_pb2

E = events_pb2


class LogBuilder:
    """Appends events with increasing seq; each helper takes the event's timestamp first."""

    def __init__(self, run: str = "llm", nodes: int = 4) -> None:
        self.run = run
        self.events: list[LogEntry] = []
        self.attempt = 0
        self.step = 0
        self.nodes = nodes
        self.flags: set[int] = set()  # seq of each detection after which the attempt went on

    def _add(self, ts: float, kind: int, **detail: object) -> LogEntry:
        ev = LogEntry(
            seq=len(self.events) + 1,
            ts=ts,
            run=self.run,
            attempt=self.attempt,
            step=self.step,
            kind=kind,
            **detail,
        )
        self.events.append(ev)
        return ev

    def start(self, ts: float) -> None:
        self._add(ts, E.EVENT_KIND_RUN_START, run_detail=E.RunDetail(nodes=self.nodes, spares=1))

    def preflight(self, ts: float, node: str = "n0", passed: bool = True) -> None:
        summary = common_pb2.PreflightSummary(mode="quick", passed=passed, fail_count=0 if passed else 1)
        self._add(ts, E.EVENT_KIND_PREFLIGHT_RESULT, preflight=E.PreflightDetail(node=node, summary=summary))

    def launch(self, ts: float, resume_step: int = -1) -> None:
        self.attempt += 1
        nodes = [f"n{i}" for i in range(self.nodes)]
        self._add(
            ts,
            E.EVENT_KIND_LAUNCH,
            launch=E.LaunchDetail(
                rendezvous_id=f"{self.run}-{self.attempt}", nodes=nodes, resume_step=resume_step
            ),
        )

    def load_done(self, ts: float) -> None:
        self._add(ts, E.EVENT_KIND_LOAD_DONE)

    def first_step(self, ts: float) -> None:
        self._add(ts, E.EVENT_KIND_FIRST_STEP)

    def commit(self, ts: float, step: int, save_s: float) -> None:
        self.step = step
        self._add(
            ts,
            E.EVENT_KIND_CHECKPOINT_COMMIT,
            checkpoint=E.CheckpointDetail(path=f"/ckpt/{step}", save_duration_s=save_s),
        )

    def detect(
        self,
        ts: float,
        latency_s: float,
        node: str = "n2",
        detector: int = E.DETECTOR_HANG,
        *,
        flag_only: bool = False,
        reason: str = "test",
    ) -> None:
        self._add(
            ts,
            E.EVENT_KIND_DETECTION,
            detection=E.DetectionDetail(
                detector=detector, nodes=[node], latency_s=latency_s, reason=reason, flag_only=flag_only
            ),
        )

    def flag(self, ts: float, latency_s: float, node: str = "n2", *, legacy: bool = False) -> None:
        """A detection after which the attempt goes on: a straggler left running, as the supervisor
        logs it (``legacy``: as it did before ``flag_only``, by its wording alone)."""
        reason = "persistent straggler over 20 steps: rank 2; quarantine candidate at the next restart; "
        self.flags.add(len(self.events) + 1)
        self.detect(
            ts,
            latency_s,
            node,
            E.DETECTOR_STRAGGLER,
            flag_only=not legacy,
            reason=reason + "not killed mid-run",
        )

    def evidence_flag(self, ts: float, latency_s: float, node: str = "n1") -> None:
        """Fatal evidence noted while the controller is blind (the attempt goes on)."""
        self.flags.add(len(self.events) + 1)
        self.detect(ts, latency_s, node, E.DETECTOR_EVIDENCE, flag_only=True, reason=f"fatal xid on {node}")

    def attribute(
        self,
        ts: float,
        node: str | None = "n2",
        kind: int = common_pb2.EVIDENCE_KIND_XID,
        severity: int = common_pb2.SEVERITY_FATAL,
    ) -> None:
        if node is None:
            detail = E.AttributionDetail(method="none")
        else:
            evidence = common_pb2.Evidence(node=node, kind=kind, severity=severity)
            detail = E.AttributionDetail(
                method="hardware", suspects=[E.Suspect(node=node, evidence=[evidence])]
            )
        self._add(ts, E.EVENT_KIND_ATTRIBUTION, attribution=detail)

    def attribute_detail(self, ts: float, detail: events_pb2.AttributionDetail) -> None:
        self._add(ts, E.EVENT_KIND_ATTRIBUTION, attribution=detail)

    def quarantine(self, ts: float, node: str = "n2") -> None:
        self._add(ts, E.EVENT_KIND_QUARANTINE, quarantine=E.QuarantineDetail(node=node, reason="xid 79"))

    def spare(self, ts: float, node: str = "n4", replaces: str = "n2") -> None:
        self._add(
            ts, E.EVENT_KIND_SPARE_TAKEN, spare=E.SpareDetail(node=node, replaces=replaces, source="spare")
        )

    def stop(self, ts: float) -> None:
        self._add(ts, E.EVENT_KIND_STOP_REQUEST, stop=E.StopDetail(reason="drain", requested_by="op"))

    def exit(self, ts: float, classification: str = "stop") -> None:
        self._add(ts, E.EVENT_KIND_EXIT, exit=E.ExitDetail(node="n0", classification=classification))

    def control_plane(self, ts: float) -> None:
        self._add(ts, E.EVENT_KIND_CONTROL_PLANE, message="the controller lost etcd")

    def end(self, ts: float, outcome: str = "completed") -> None:
        self._add(ts, E.EVENT_KIND_RUN_END, run_detail=E.RunDetail(nodes=self.nodes, outcome=outcome))

    def startup(self, t0: float) -> None:
        """RUN_START at t0, preflight +10, launch +20, loaded +30, first step +40."""
        self.start(t0)
        self.preflight(t0 + 10)
        self.launch(t0 + 20)
        self.load_done(t0 + 30)
        self.first_step(t0 + 40)
