"""/metrics scrape time on a long event log: the incremental windowed rates vs re-reading the log.

    .venv/bin/python bench/bench_metrics.py [--events 1000000] [--scrapes 15] [--baseline-scrapes 3]
                                            [--append 5] [--out bench/results/bench_metrics.json]

1. writes a synthetic event log of --events lines (plain Python, no torch): one run of 64 nodes,
   an event every 2.5 s (checkpoint commits, every ~400 events an incident with its recovery
   phases and a RESTART, burn-in results), so 1 M events are about 29 days;
2. incremental (`WindowedRatesCollector`, what the controller serves): the backlog folded once at
   start (timed), then --scrapes scrapes, each after --append new lines were appended (a 15 s
   scrape interval at this rate holds ~6): median scrape time;
3. re-read per scrape (what the controller did before: `read_events` + `compute_goodput` behind
   `GoodputCollector`): median of --baseline-scrapes scrapes;
4. checks both give the same whole-run goodput, prints markdown for BENCHMARKS.md and the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry, generate_latest

from controller.goodput.metrics import WindowedRatesCollector, register_goodput_metrics
from controller.goodput.report import compute_goodput
from runwarden.eventlog import decode_line, read_events

T0 = 1_764_547_200.0
STEP_S = 2.5
NODES = 64
INCIDENT_EVERY = 400
RUN = "llm"


class LogWriter:
    """Event lines in the protobuf JSON mapping, written as text (encode_entry is 40x slower)."""

    def __init__(self) -> None:
        self.seq = 0
        self.last_ts = T0
        self.attempt = 1
        self.step = 0

    def line(self, ts: float, kind: str, detail: str = "") -> str:
        self.seq += 1
        self.last_ts = ts
        extra = f", {detail}" if detail else ""
        return (
            f'{{"attempt": "{self.attempt}", "kind": "EVENT_KIND_{kind}", "run": "{RUN}", '
            f'"seq": "{self.seq}", "step": "{self.step}", "ts": {ts:.6f}{extra}}}\n'
        )

    def start(self) -> list[str]:
        nodes = ", ".join(f'"n{i}"' for i in range(NODES))
        return [
            self.line(T0, "RUN_START", f'"run_detail": {{"nodes": {NODES}, "spares": 4}}'),
            self.line(
                T0 + 1, "PREFLIGHT_RESULT", '"preflight": {"summary": {"mode": "quick", "passed": true}}'
            ),
            self.line(T0 + 2, "LAUNCH", f'"launch": {{"nodes": [{nodes}], "rendezvous_id": "{RUN}-1"}}'),
            self.line(T0 + 3, "LOAD_DONE"),
            self.line(T0 + 4, "FIRST_STEP"),
        ]

    def cycle(self, i: int, ts: float) -> list[str]:
        """The lines for slot i (one slot = one event in steady state, an incident every N)."""
        if i % INCIDENT_EVERY == INCIDENT_EVERY - 1:
            self.attempt += 1
            node = f"n{i % NODES}"
            return [
                self.line(
                    ts,
                    "DETECTION",
                    f'"detection": {{"detector": "DETECTOR_HANG", "latency_s": 30.0, "nodes": ["{node}"], "reason": "hang"}}',
                ),
                self.line(
                    ts + 0.5,
                    "ATTRIBUTION",
                    f'"attribution": {{"blame_method": "BLAME_METHOD_HEARTBEAT", "suspects": [{{"node": "{node}"}}]}}',
                ),
                self.line(ts + 0.7, "RESTART"),
                self.line(ts + 0.8, "QUARANTINE", f'"quarantine": {{"node": "{node}", "reason": "hang"}}'),
                self.line(
                    ts + 0.9,
                    "SPARE_TAKEN",
                    f'"spare": {{"node": "s{i}", "replaces": "{node}", "source": "spare"}}',
                ),
                self.line(
                    ts + 1.2,
                    "PREFLIGHT_RESULT",
                    '"preflight": {"summary": {"mode": "quick", "passed": true}}',
                ),
                self.line(ts + 1.4, "LAUNCH", f'"launch": {{"rendezvous_id": "{RUN}-{self.attempt}"}}'),
                self.line(ts + 1.8, "LOAD_DONE"),
                self.line(ts + 2.2, "FIRST_STEP"),
            ]
        if i % 97 == 0:
            return [
                self.line(
                    ts,
                    "PREFLIGHT_RESULT",
                    f'"message": "burn-in of s{i}: failed", "preflight": {{"node": "s{i}", "summary": {{"mode": "burn_in", "passed": false}}}}',
                )
            ]
        self.step += 10
        return [self.line(ts, "CHECKPOINT_COMMIT", '"checkpoint": {"path": "/ckpt", "save_duration_s": 0.4}')]


def write_log(path: Path, events: int) -> tuple[LogWriter, float]:
    w = LogWriter()
    lines = w.start()
    i = 0
    while w.seq < events:
        lines += w.cycle(i, T0 + 10 + i * STEP_S)
        i += 1
    path.write_text("".join(lines[:events]))
    w.seq = events
    return w, T0 + 10 + i * STEP_S


def scrape(registry: CollectorRegistry) -> tuple[float, str]:
    t = time.perf_counter()
    text = generate_latest(registry).decode()
    return time.perf_counter() - t, text


def goodput_line(text: str) -> str:
    return next(
        line for line in text.splitlines() if line.startswith(f'runwarden_goodput_ratio{{run="{RUN}"}}')
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--scrapes", type=int, default=15)
    ap.add_argument("--baseline-scrapes", type=int, default=3)
    ap.add_argument("--append", type=int, default=5, help="lines appended before each incremental scrape")
    ap.add_argument("--out", type=Path, default=Path("bench/results/bench_metrics.json"))
    args = ap.parse_args()
    if args.events < 100 or args.scrapes < 1 or args.baseline_scrapes < 1 or args.append < 0:
        ap.error("need --events >= 100 and at least one scrape of each kind")
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        log = Path(tmp) / "events.jsonl"
        t = time.perf_counter()
        writer, end_ts = write_log(log, args.events)
        gen_s = time.perf_counter() - t
        size_mb = log.stat().st_size / 1e6
        decode_line(log.read_bytes().split(b"\n", 1)[0])  # the hand-written lines are valid events
        now = [end_ts]

        collector = WindowedRatesCollector(log, clock=lambda: now[0])
        incremental = CollectorRegistry()
        incremental.register(collector)
        t = time.perf_counter()
        collector.catch_up()
        backlog_s = time.perf_counter() - t
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        times = []
        i = args.events
        for _ in range(args.scrapes):
            with open(log, "a") as f:
                for _ in range(args.append):
                    ts = end_ts + (i - args.events) * STEP_S
                    f.write("".join(writer.cycle(i, ts)))
                    i += 1
            now[0] = writer.last_ts  # the re-read's report ends at the last event: the same instant
            took, text = scrape(incremental)
            times.append(took)
        inc_text = text
        total_events = writer.seq

        baseline = CollectorRegistry()
        register_goodput_metrics(baseline, lambda: [compute_goodput(read_events(log).entries, run=RUN)])
        base_times = []
        for _ in range(args.baseline_scrapes):
            took, base_text = scrape(baseline)
            base_times.append(took)
    same = goodput_line(inc_text).split()[-1] == goodput_line(base_text).split()[-1]
    inc_ms = statistics.median(times) * 1000
    base_ms = statistics.median(base_times) * 1000
    result = {
        "events_at_start": args.events,
        "events_at_end": total_events,
        "log_mb": round(size_mb, 1),
        "generate_s": round(gen_s, 2),
        "incremental_backlog_s": round(backlog_s, 2),
        "incremental_rss_mb_after_backlog": round(rss_mb),
        "incremental_scrape_ms_median": round(inc_ms, 3),
        "incremental_scrape_ms_all": [round(x * 1000, 3) for x in times],
        "lines_appended_per_scrape": args.append,
        "reread_scrape_ms_median": round(base_ms, 1),
        "reread_scrape_ms_all": [round(x * 1000, 1) for x in base_times],
        "ratio": round(base_ms / inc_ms),
        "same_whole_run_goodput": same,
        "goodput_incremental": goodput_line(inc_text),
        "goodput_reread": goodput_line(base_text),
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(
        f"| {args.events:,} events ({size_mb:.0f} MB) | {inc_ms:.2f} ms (median of {args.scrapes}, "
        f"+{args.append} lines each) | {base_ms / 1000:.2f} s (median of {args.baseline_scrapes}) | "
        f"{base_ms / inc_ms:,.0f}x | backlog folded once at start: {backlog_s:.1f} s |"
    )
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
