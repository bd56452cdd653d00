"""One point of a sweep: a headless Locust run in its own process (Locust's gevent never enters the runner),
its CSVs, HTML report, log and exact tallies in one folder, read back into one row of figures."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCUSTFILES = Path(__file__).resolve().parent / "locustfiles"


@dataclass
class Point:
    label: str                       # folder name under points/
    locustfile: str                  # file name under loadtests/locustfiles/
    users: int
    host: str
    args: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sweep:
    out: Path
    duration_s: float
    processes: int = 0               # Locust --processes: 0 = one process
    extra_args: list[str] = field(default_factory=list)
    api_key: str = ""
    record_responses: bool = False   # every answer's ids in points/<label>/responses.jsonl
    done: int = 0
    total: int = 0

    def run(self, point: Point) -> dict[str, Any]:
        folder = self.out / "points" / point.label
        folder.mkdir(parents=True, exist_ok=True)
        users = str(point.users)
        cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILES / point.locustfile), "--headless",
               "-u", users, "-r", users, "-t", f"{self.duration_s:g}s", "--stop-timeout", "10", "--host", point.host,
               "--csv", str(folder / "locust"), "--html", str(folder / "report.html"), "--only-summary",
               "--loglevel", "WARNING", "--logfile", str(folder / "locust.log"), "--exit-code-on-error", "0",
               "--tally-out", str(folder / "tally.json"), *point.args, *self.extra_args]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.record_responses:
            cmd += ["--responses-out", str(folder / "responses.jsonl")]
        if self.processes:
            cmd += ["--processes", str(self.processes)]
        (folder / "command.txt").write_text(" ".join(cmd) + "\n")
        self.done += 1
        print(f"[{self.done}/{self.total or '?'}] {point.label}: {point.users} users, {self.duration_s:g} s ...",
              end="", file=sys.stderr, flush=True)
        started = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=open(folder / "stderr.txt", "wb"),
                              timeout=self.duration_s + 180)
        stats = folder / "locust_stats.csv"
        if not stats.exists():
            print(file=sys.stderr)
            raise RuntimeError(f"Locust exited with {proc.returncode} and wrote no stats: see {folder / 'stderr.txt'}")
        final = folder / "final_stats.json"  # written by common.py at exit: Locust's figures after the last request
        requests = {k: v for k, v in json.loads(final.read_text()).items() if k != "None Aggregated"} \
            if final.exists() else read_stats(stats)
        row = {**point.meta, "label": point.label, "users": point.users,
               "wall_s": round(time.perf_counter() - started, 1),
               "requests": requests, "tally": json.loads((folder / "tally.json").read_text())
               if (folder / "tally.json").exists() else {}, "folder": str(folder.relative_to(self.out))}
        return row


def read_stats(path: Path) -> dict[str, dict[str, Any]]:
    """Locust's <prefix>_stats.csv as {"TYPE name": figures}; the Aggregated row is left out because it mixes
    latencies with the synthetic figures (recall, read-your-writes)."""
    out = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["Name"] == "Aggregated":
                continue
            out[f"{r['Type']} {r['Name']}"] = {
                "count": int(r["Request Count"]), "failures": int(r["Failure Count"]),
                "avg": float(r["Average Response Time"]), "median": _num(r["Median Response Time"]),
                "p99": _num(r["99%"]), "rps": float(r["Requests/s"])}
    return out


def _num(text: str) -> float | None:
    return None if text in ("", "N/A") else float(text)


# -- exact latency percentiles from the tallies: log buckets 1% wide --------------------------------------------
def latency_bucket(ms: float) -> int:
    """The bucket of a latency: 100 x ln(microseconds), so a bucket's lower edge is within 1% of any value in it."""
    return int(math.log(max(1.0, ms * 1000)) * 100)


def percentiles(tally: dict[str, int], name: str, qs: tuple[float, ...] = (50, 99)) -> dict[str, float | None]:
    prefix = f"latency:{name}:"
    buckets = sorted((int(k[len(prefix):]), n) for k, n in tally.items() if k.startswith(prefix))
    total = sum(n for _, n in buckets)
    out: dict[str, float | None] = {}
    for q in qs:
        if not total:
            out[f"p{q:g}_ms"] = None
            continue
        rank, seen = math.ceil(total * q / 100), 0
        for bucket, n in buckets:
            seen += n
            if seen >= rank:
                out[f"p{q:g}_ms"] = round(math.exp(bucket / 100) / 1000, 3)  # bucket of microseconds -> ms
                break
    return out
