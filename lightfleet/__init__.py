"""lightfleet: a fleet of light node agents that drives the real controller at scale (KWOK's idea).

Contract. A light agent is what the controller sees of a node, and nothing more. It holds a real etcd
lease (TTL 5 s by default) on its real `NodeRecord` through the project's own `runwarden.store`,
serves the real NodeAgent gRPC API on 127.0.0.1 with one port per agent (requests validated by the
real agent's nodeagent.daemon.validate; refusals with its status codes and messages), writes the
real `NodeProgress` of `local_ranks` ranks (8 by default) once per progress interval and the exit
record at once, follows each run's stop key and policy record, and publishes real `EvidenceRecord`s.
Hundreds to a thousand agents share one OS process (grpc.aio servers on one asyncio loop, every
lease refreshed over one LeaseKeepAlive stream), so 2,048 nodes fit on a small machine.

It does NOT run torch, torchrun, ranks, preflight checks, flight recorders or anything on a GPU. A
preflight is a configurable delay and a result (a failing check is injected); a launch starts a step
clock that every node of the attempt shares (lightfleet.agent), so steps, commits, planned stops and
hangs agree across nodes and processes; a hang's flight-recorder dumps are synthesized so that the
controller's real analysis blames the culprit rank's node. ReportProgress, InjectFault and
MeasureAllReduce answer UNIMPLEMENTED. Faults (crash, hang, lease-loss, xid, slow-preflight,
fail-preflight, drain, clear: lightfleet.faults) come in as lines on stdin or through the Python API
(`Fleet.inject`, `Hosted.inject`, `LightProcess.apply`).

Modules: settings (latencies and clocks), agent (one agent's behaviour, no I/O), faults (the control
language), leases (the shared keepalive stream), server (the gRPC service), process (one OS process
of agents; `python -m lightfleet.process`, `Hosted` for tests), fleet and __main__ (K processes).

Run it against the etcd the controller uses, then start `controller run` with `[controller] nodes`
below the fleet's size (the rest are spares)::

    python -m lightfleet --etcd 127.0.0.1:2379 --nodes 256 --procs 2 --first-port 20000 \\
        --preflight-s 5:30 --step-s 1
    # after its "ready: ..." line, type faults: crash light-0017 / hang light-0003 culprit-rank 5
"""
