"""Hostile clients (issue 34): each attack against a real `switchyard serve`, with its resource ceiling watched.

    python loadtests/hostile.py                          # every attack at the issue's sizes
    python loadtests/hostile.py --scale cheap            # small sizes, a few seconds each (what CI runs)
    python loadtests/hostile.py --only slow-bodies --only sql-guard --param payload-keys.variants='[[8, 50000]]'

For each attack, a service of the attack's profile (fresh data directory, embedded PostgreSQL, an API key; the quota
attacks add a small request quota, the frame attack front processes) with an honest collection. Before each attack,
once the service has settled (no background work), the honest client's p99 alone; then, from the end of the attack's
setup (its seeded collections, once settled again) to its end: the RSS of the service's processes (summed) and of
its largest PostgreSQL process (baseline and peak), the in-flight gauges of /metrics, the honest client's p50/p99
and refusals, and every status the attack got back. An attack passes when the service answered it as the issue
demands, nothing answered 5xx, the honest client was never refused and kept p99 under 3x its unloaded p99, and RSS
stayed within 200 MB of its baseline. Prints a markdown table; JSON and the table go to
results_dir("hostile") (loadtests/processes.py). Exits 1 when an attack fails (0 with --report-only).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtests import hostile_attacks as attacks  # noqa: E402
from loadtests import hostile_probes as probes  # noqa: E402
from loadtests.benchkit import Service, results_dir, save_json, versions, wait_for_quiet  # noqa: E402
from loadtests.hostile_kit import (  # noqa: E402
    HONEST_COLLECTION,
    HONEST_DIM,
    HONEST_ROWS,
    Ctx,
    HonestClient,
    Target,
    Watch,
    bounded,
    wait_job,
)
from service.admission.priority import lower_priority  # noqa: E402

RESULTS = results_dir("hostile")
QUOTA = {"SWITCHYARD_QUOTA_REQUESTS_PER_S": "20", "SWITCHYARD_QUOTA_BURST": "20"}
PROFILES: dict[str, dict[str, Any]] = {  # the service each attack runs against
    "main": {"key": True, "env": {}},
    "fronts": {"key": True, "env": {"SWITCHYARD_FRONTS": "1"}},
    "quota": {"key": True, "env": QUOTA, "pace_s": 0.1},  # the honest client stays under its key's quota
    "quota-open": {"key": False, "env": QUOTA, "pace_s": 0.1},
}


@dataclass
class Attack:
    name: str
    item: str  # the item number
    run: Callable[[Ctx], None]
    full: dict[str, Any]  # parameters at the sizes
    cheap: dict[str, Any]  # a version of a few seconds
    profile: str = "main"
    ssb: bool = False  # needs an SSB dataset loaded
    honest: bool = True  # an honest client alongside (not where it would share the attacker's identity)
    budget_s: float = 120  # the attack stops sending at its deadline; the runner waits this long at most
    doc: str = field(default="")


ATTACKS = [
    Attack("slow-bodies", "1", attacks.slow_bodies,
           {"extra": 16, "min_sockets": 128, "max_sockets": 1024, "hold_s": 20, "keyed": 2},
           {"extra": 8, "min_sockets": 16, "max_sockets": 512, "hold_s": 3, "keyed": 0}, budget_s=60),
    Attack("payload-keys", "2", attacks.payload_keys, {"variants": [[8, 50_000], [20_000, 2_000]]},
           {"variants": [[8, 2_000], [2_000, 200]]}),
    Attack("recall-matrix", "3", attacks.recall_matrix, {"rows": 20_000, "sample": 10_000, "timeout_s": 120},
           {"rows": 2_000, "sample": 2_000, "timeout_s": 30}, budget_s=180),
    Attack("filter-cache", "4", attacks.filter_cache, {"rounds": 4, "filters": 1_100, "filter_kb": 50},
           {"rounds": 1, "filters": 60, "filter_kb": 50}, budget_s=300),
    Attack("sql-blowup", "5", probes.sql_blowup,
           {"depth": 9, "repeat_n": 1_000_000_000, "agg_depth": 4, "timeout_s": 30},
           {"depth": 5, "repeat_n": 1_000_000, "agg_depth": 2, "timeout_s": 10}, ssb=True, budget_s=400),
    Attack("content-type", "6", attacks.content_type, {}, {}, budget_s=180),
    Attack("frame-flood", "7", attacks.frame_flood, {"declared_mb": 400, "send_mb": 400},
           {"declared_mb": 400, "send_mb": 32}, profile="fronts", budget_s=60),
    Attack("quota-rotation", "8", attacks.quota_rotation, {"requests": 2_000}, {"requests": 100}, profile="quota"),
    Attack("quota-rotation-open", "8", attacks.quota_rotation, {"requests": 2_000}, {"requests": 100},
           profile="quota-open", honest=False),
    Attack("sql-guard", "9", probes.sql_guard, {}, {}, ssb=True),
    Attack("date-overflow", "10", probes.date_overflow, {"repeats": 5}, {"repeats": 5}, ssb=True),
    Attack("bad-input", "11", probes.bad_input, {}, {}, ssb=True),
    Attack("zero-cosine", "13", probes.zero_cosine, {}, {}),
]
BY_NAME = {a.name: a for a in ATTACKS}


@dataclass
class Criteria:
    p99_factor: float = 3.0
    rss_mb: float = 200.0


class Services:
    """One running service per profile, started on first use (and again if an attack killed it)."""

    def __init__(self, workdir: Path, extra_env: dict[str, str], ssb_sf: float) -> None:
        self.workdir, self.extra_env, self.ssb_sf = workdir, extra_env, ssb_sf
        self.running: dict[str, tuple[Service, Target]] = {}
        self.with_ssb: set[str] = set()

    def get(self, profile: str, ssb: bool) -> Target:
        entry = self.running.get(profile)
        if entry is not None and entry[0].proc is not None and entry[0].proc.poll() is not None:
            print(f"  the {profile} service is gone (exit {entry[0].proc.returncode}): starting a new one",
                  file=sys.stderr)
            self.running.pop(profile)
            self.with_ssb.discard(profile)
            entry = None
        if entry is None:
            entry = self._start(profile)
            self.running[profile] = entry
        if ssb and profile not in self.with_ssb:
            self._load_ssb(entry[1])
            self.with_ssb.add(profile)
        return entry[1]

    def _start(self, profile: str) -> tuple[Service, Target]:
        spec = PROFILES[profile]
        key = secrets.token_urlsafe(16) if spec["key"] else None
        env = {**spec["env"], **self.extra_env, **({"SWITCHYARD_API_KEY": key} if key else {})}
        folder = Path(tempfile.mkdtemp(prefix=f"{profile}-", dir=self.workdir))
        service = Service(folder / "data", env=env, benchmark_env=False)
        print(f"starting the {profile} service ({folder}) ...", file=sys.stderr)
        service.start()
        assert service.proc is not None
        target = Target(service.url, key, service.proc.pid, folder / "data", folder / "data" / "postgres",
                        profile, env)
        with httpx.Client(base_url=target.url, headers=target.headers(), timeout=120) as http:
            http.post("/v1/collections", json={"name": HONEST_COLLECTION, "dim": HONEST_DIM}).raise_for_status()
            rng = np.random.default_rng(3)
            http.put(f"/v1/collections/{HONEST_COLLECTION}/points", json={
                "ids": list(range(HONEST_ROWS)), "vectors": rng.standard_normal((HONEST_ROWS, HONEST_DIM)).round(4)
                .tolist()}).raise_for_status()
        HonestClient(target, spec.get("pace_s", 0.01)).measure(1.0)  # warm-up
        return service, target

    def _load_ssb(self, target: Target) -> None:
        print(f"  generating SSB scale factor {self.ssb_sf} ...", file=sys.stderr)
        with httpx.Client(base_url=target.url, headers=target.headers(), timeout=120) as http:
            accepted = http.post("/v1/olap/ssb/generate", json={"scale_factor": self.ssb_sf})
            accepted.raise_for_status()
            state = wait_job(http, accepted.json(), 600)
            if state != "succeeded":
                raise RuntimeError(f"SSB generation ended {state}")

    def close(self) -> None:
        for service, _ in self.running.values():
            service.stop()


def settle(target: Target, max_s: float) -> None:
    """Wait until the service and its PostgreSQL use under 0.15 of a core (background index builds, an SSB
    dataset's copy into PostgreSQL), so the honest client measures the service, not the work setup left running."""
    wait_for_quiet(max_s, 0.15, lambda: target.service_processes() + target.postgres_processes())


def run_attack(attack: Attack, params: dict[str, Any], target: Target, latency_s: float,
               criteria: Criteria, min_window_s: float = 3.0, settle_s: float = 60.0) -> dict[str, Any]:
    """One attack with its watch and its honest client; the record of what happened and whether it passed. The
    honest client's reference is measured just before, with the service settled (settle); the attack's window
    (honest latencies, memory baseline) starts when its setup is done (Ctx.begin)."""
    print(f"== {attack.name} (item {attack.item}) on {target.profile}", file=sys.stderr)
    pace_s = PROFILES[target.profile].get("pace_s", 0.01)
    unloaded: dict[str, Any] | None = None  # latency_s 0: no reference, no latency criterion (CI)
    # The watch runs through the reference too: its /metrics scrapes cost the service's event loop time, and the
    # honest client's p99 alone must be measured under the same observer as its p99 under attack.
    watch = Watch(target)
    base = watch.start()
    if latency_s > 0:
        settle(target, max_s=settle_s)
        unloaded = HonestClient(target, pace_s).measure(latency_s)
        print(f"   honest client alone: p50 {unloaded['p50_ms']} ms, p99 {unloaded['p99_ms']} ms", file=sys.stderr)
        base = watch.rebase(peaks=True)
    ctx = Ctx(target, params, attack.budget_s)
    honest = HonestClient(target, pace_s) if attack.honest else None
    if honest is not None:
        honest.start()

    def begin() -> None:  # the attack's setup is done: the window starts once the service has settled
        nonlocal base
        if latency_s > 0:
            settle(target, max_s=settle_s)
        base = watch.rebase()

    ctx.on_begin = begin
    started = time.monotonic()
    failure: list[str] = []

    def body() -> None:
        # The attacker's own CPU is not the service's: on a real deployment it is another machine's. Here it shares
        # the cores with the service and the honest client, so its thread (and the threads it starts) yields to them.
        lower_priority()
        try:
            attack.run(ctx)
        except Exception:  # noqa: BLE001 - an attack that breaks is reported, never the end of the suite
            failure.append(traceback.format_exc(limit=3))

    finished = bounded(body, attack.budget_s + 30)
    seconds = time.monotonic() - started
    # Memory that grows just after the attack counts too; the honest client gets enough calls for a p99.
    time.sleep(max(1.0, min_window_s - seconds))
    honest_result = honest.stop(since=ctx.began) if honest is not None else None
    watch.stop()
    if not target.alive():
        ctx.expect("the service still runs", False, "the service process is gone (killed, or it died)")
    if not finished:
        ctx.expect("attack finished within its budget", False, f"still running after {attack.budget_s + 30:.0f} s")
    if failure:
        ctx.expect("attack ran", False, failure[0].strip().splitlines()[-1])
    mb = lambda b: round(b / 2**20, 1)  # noqa: E731
    rss = {"baseline_mb": mb(base["rss"]), "peak_mb": mb(max(watch.rss, default=base["rss"])),
           "pg_baseline_mb": mb(base["pg_rss"]), "pg_peak_mb": mb(max(watch.pg_rss, default=base["pg_rss"]))}
    rss["delta_mb"] = round(rss["peak_mb"] - rss["baseline_mb"], 1)
    rss["pg_delta_mb"] = round(rss["pg_peak_mb"] - rss["pg_baseline_mb"], 1)
    fives = {s: n for s, n in ctx.statuses.items() if s.startswith("5") and len(s) == 3}
    verdict: dict[str, bool] = {
        "answers": all(c["ok"] for c in ctx.checks),
        "no_5xx": not fives and not any(s.startswith("5") for s in (honest_result or {}).get("statuses", {})),
        "rss": max(rss["delta_mb"], rss["pg_delta_mb"]) < criteria.rss_mb,
    }
    if honest_result is not None:
        verdict["honest_not_refused"] = honest_result["refused"] == 0 and honest_result["calls"] > 0
    if honest_result is not None and unloaded is not None:
        limit = criteria.p99_factor * (unloaded["p99_ms"] or 0)
        verdict["honest_p99"] = honest_result["p99_ms"] is not None and honest_result["p99_ms"] < limit
    record = {"attack": attack.name, "item": attack.item, "profile": target.profile, "params": params,
              "seconds": round(seconds, 1), "skipped": ctx.skipped, "statuses": dict(ctx.statuses), "fivexx": fives,
              "checks": ctx.checks, "notes": ctx.notes, "rss": rss,
              "inflight": {"peak": max(watch.inflight, default=None), "limit_min": min(watch.limits, default=None),
                           "metrics_errors": watch.metrics_errors},
              "honest": honest_result, "honest_unloaded": unloaded, "verdict": verdict,
              "passed": ctx.skipped is not None or all(verdict.values())}
    print(f"   {'skipped: ' + ctx.skipped if ctx.skipped else 'passed' if record['passed'] else 'FAILED'}: "
          f"{verdict} in {seconds:.1f} s", file=sys.stderr)
    return record


def table(records: list[dict[str, Any]], criteria: Criteria) -> str:
    rows = ["| attack | item | result | RSS MB base -> peak (delta) | PG process delta MB | in-flight peak / limit "
            "| honest p50 / p99 ms (alone p99) | honest refused | statuses | failed |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["skipped"]:
            rows.append(f"| {r['attack']} | {r['item']} | skipped | | | | | | | {r['skipped']} |")
            continue
        h, u, rss, inflight = r["honest"], r["honest_unloaded"], r["rss"], r["inflight"]
        bad = [c["check"] + (f" ({c['detail']})" if c["detail"] else "") for c in r["checks"] if not c["ok"]]
        failed = [f"criterion {k}" for k, ok in r["verdict"].items() if not ok and k != "answers"]
        if bad:
            failed.append(f"{len(bad)} of {len(r['checks'])} checks: " + "; ".join(bad))
        honest = f"{h['p50_ms']} / {h['p99_ms']} ({u['p99_ms'] if u else 'n/a'})" if h else "n/a"
        refused = (f"{h['refused']} of {h['calls']}" + (f" {h['statuses']}" if h["refused"] else "")) if h else "n/a"
        statuses = ", ".join(f"{s}x{n}" for s, n in sorted(r["statuses"].items()))
        rows.append(f"| {r['attack']} | {r['item']} | {'pass' if r['passed'] else '**FAIL**'} | "
                    f"{rss['baseline_mb']:.0f} -> {rss['peak_mb']:.0f} ({rss['delta_mb']:+.0f}) | "
                    f"{rss['pg_delta_mb']:+.0f} | {inflight['peak']} / {inflight['limit_min']} | {honest} | "
                    f"{refused} | {statuses} | {'; '.join(failed)[:400].replace('|', '/')} |")
    rows.append(f"\nCriteria: the service's answers as the issue demands, no 5xx, honest client never refused and p99 "
                f"< {criteria.p99_factor:g}x alone, RSS (service processes, and the largest PostgreSQL process) "
                f"within {criteria.rss_mb:g} MB of its baseline.")
    return "\n".join(rows)


def run_suite(names: list[str] | None = None, scale: str = "full", overrides: dict[str, dict[str, Any]] | None = None,
              extra_env: dict[str, str] | None = None, criteria: Criteria | None = None,
              workdir: Path | None = None, latency_s: float | None = None,
              min_window_s: float | None = None) -> dict[str, Any]:
    """Every named attack (all by default) against services started here; the report (records and table)."""
    criteria = criteria or Criteria()
    chosen = [BY_NAME[n] for n in names] if names else ATTACKS
    env = dict(extra_env or {})
    if scale == "cheap":
        env.setdefault("SWITCHYARD_MAX_BODY_BYTES", str(2**20))  # the content-type attack's body stays small
    workdir = workdir or Path(tempfile.mkdtemp(prefix="switchyard-hostile-"))
    services = Services(workdir, env, 0.01)
    records = []
    try:
        for attack in sorted(chosen, key=lambda a: list(PROFILES).index(a.profile)):
            params = {**(attack.cheap if scale == "cheap" else attack.full), **(overrides or {}).get(attack.name, {})}
            target = services.get(attack.profile, attack.ssb)
            records.append(run_attack(attack, params, target, (2.0 if scale == "cheap" else 5.0)
                                      if latency_s is None else latency_s,
                                      criteria, min_window_s or (3.0 if scale == "cheap" else 5.0),
                                      settle_s=15.0 if scale == "cheap" else 60.0))
    finally:
        services.close()
    records.sort(key=lambda r: ATTACKS.index(BY_NAME[r["attack"]]))
    return {"what": "hostile clients (issue 34)", "scale": scale, "env": env, "records": records,
            "criteria": vars(criteria), "table": table(records, criteria), "passed": all(r["passed"] for r in records),
            "versions": versions("fastapi", "uvicorn", "duckdb", "asyncpg")}


def _overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, _, value = item.partition("=")
        attack, _, key = name.partition(".")
        if attack not in BY_NAME or not key or not value:
            raise SystemExit(f"--param wants ATTACK.KEY=JSON with ATTACK one of {', '.join(BY_NAME)}: {item!r}")
        out.setdefault(attack, {})[key] = json.loads(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=list(BY_NAME), help="run this attack (repeatable)")
    parser.add_argument("--scale", choices=["full", "cheap"], default="full",
                        help="full: the issue's sizes; cheap: small sizes, a few seconds each")
    parser.add_argument("--param", action="append", default=[], metavar="ATTACK.KEY=JSON",
                        help="override one attack parameter, e.g. recall-matrix.rows=50000")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="more service settings for every profile, e.g. SWITCHYARD_FRONTS=2")
    parser.add_argument("--p99-factor", type=float, default=3.0)
    parser.add_argument("--rss-mb", type=float, default=200.0)
    parser.add_argument("--report-only", action="store_true", help="exit 0 even when an attack fails")
    parser.add_argument("--out", type=Path, help="folder for the JSON and the table (default: results_dir('hostile'))")
    parser.add_argument("--list", action="store_true", help="list the attacks and their parameters")
    args = parser.parse_args(argv)
    if args.list:
        for a in ATTACKS:
            print(f"{a.name:20} item {a.item:3} profile {a.profile:11} full {a.full} cheap {a.cheap}")
        return 0
    report = run_suite(args.only, args.scale, _overrides(args.param), dict(e.split("=", 1) for e in args.env),
                       Criteria(args.p99_factor, args.rss_mb))
    print(report["table"])
    out = args.out or RESULTS
    stamp = time.strftime("%Y%m%d-%H%M%S")
    save_json(out / f"hostile-{stamp}.json", report)
    (out / f"hostile-{stamp}.md").write_text(report["table"] + "\n")
    print(f"wrote {out / f'hostile-{stamp}.json'}", file=sys.stderr)
    return 0 if report["passed"] or args.report_only else 1


if __name__ == "__main__":
    sys.exit(main())
