"""What VectorDBBench reported, per case and system, from its own result files (no VectorDBBench import): load
duration, QPS per concurrency and the largest, recall, nDCG, serial p99 latency; Switchyard/pgvector ratios; and
the ERROR / Traceback lines of its logs."""

from __future__ import annotations

import json
import os
import platform
import re
from importlib import metadata
from pathlib import Path

SWITCHYARD, PGVECTOR = "Switchyard", "PgVector"
NORMAL = ":)"  # VectorDBBench's ResultLabel.NORMAL; "x" is a failed case, "?" one out of its time limits
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# VectorDBBench's log lines ("<time> | ERROR | ...", its console adds colour), a traceback and its last line.
ERROR = re.compile(r"\|\s*(ERROR|CRITICAL)\b|^Traceback \(most recent call last\)|^\w+(\.\w+)*(Error|Exception): ")
WARNING = re.compile(r"\|\s*WARNING\b")
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \| (?P<level>[A-Z]+)(?:: | \|)"
                      r"(?P<message>.*?)(?: \(\d+\))?$")


def read_results(results_dir: Path, task_label: str) -> list[dict]:
    """The case results of one run (its task label) from VectorDBBench's result_<date>_<label>_<db>.json files."""
    cases = []
    for path in sorted(results_dir.glob(f"*/result_*_{task_label}_*.json")):
        run = json.loads(path.read_text())
        for case in run["results"]:
            cases.append({**case, "file": str(path), "run_id": run["run_id"]})
    return cases


def _message(line: str) -> str:
    """A log line without what makes repeats differ (time, process id) and with one level format: the console
    writes "LEVEL: msg (file:line) (pid)", the log file "LEVEL |msg (file:line)"."""
    m = LOG_LINE.match(line)
    return f"{m['level']} | {m['message'].strip()}" if m else line


def scan_logs(paths: list[Path]) -> dict:
    """ERROR / CRITICAL lines, tracebacks and exception lines, and WARNING lines, each message once with its count
    (the largest count in any one file: the console and the log file repeat the same lines)."""
    found: dict[str, dict[str, int]] = {"errors": {}, "warnings": {}}
    for path in paths:
        if not path.exists():
            continue
        counts: dict[tuple[str, str], int] = {}
        for raw in path.read_text(errors="replace").splitlines():
            line = ANSI.sub("", raw).rstrip()
            kind = "errors" if ERROR.search(line) else "warnings" if WARNING.search(line) else None
            if kind:
                key = (kind, _message(line))
                counts[key] = counts.get(key, 0) + 1
        for (kind, message), n in counts.items():
            found[kind][message] = max(found[kind].get(message, 0), n)
    return {kind: [{"line": line, "count": n} for line, n in lines.items()] for kind, lines in found.items()} | {
        "files": [str(p) for p in paths if p.exists()]}


def _case_key(case: dict) -> tuple[float, str]:
    """Unfiltered first, then label filters by share."""
    custom = case["task_config"]["case_config"].get("custom_case") or {}
    if custom.get("use_filter"):
        return custom["label_percentage"], f"label filter {custom['label_percentage'] * 100:g}%"
    return -1.0, "unfiltered"


def _system(case: dict) -> dict:
    m = case["metrics"]
    conc = [{"concurrency": c, "qps": q, "p99_s": p99}
            for c, q, p99 in zip(m["conc_num_list"], m["conc_qps_list"], m["conc_latency_p99_list"])]
    best = max(conc, key=lambda row: row["qps"], default=None)
    return {
        "label": case["label"],
        "ok": case["label"] == NORMAL,
        "db_label": case["task_config"]["db_config"].get("db_label", ""),
        "inserted": m.get("inserted_count"),
        "insert_s": m["insert_duration"],
        "optimize_s": m["optimize_duration"],
        "load_s": m["load_duration"],
        # A case on data already loaded by the previous one: VectorDBBench repeats that case's load duration.
        "load_reused": m["insert_duration"] == 0 and m["optimize_duration"] == 0 and m["load_duration"] > 0,
        "max_qps": m["qps"],
        "max_qps_concurrency": best["concurrency"] if best else None,
        "concurrency": conc,
        "recall": m["recall"],
        "ndcg": m["ndcg"],
        "serial_p99_s": m["serial_latency_p99"],
        "serial_p95_s": m["serial_latency_p95"],
        "db_case_config": case["task_config"]["db_case_config"],
        "result_file": case["file"],
    }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if a and b else None


def _ratios(ours: dict, theirs: dict) -> dict:
    return {
        "max_qps": _ratio(ours["max_qps"], theirs["max_qps"]),
        "load_s": _ratio(ours["load_s"], theirs["load_s"]),
        "serial_p99_s": _ratio(ours["serial_p99_s"], theirs["serial_p99_s"]),
        "recall": _ratio(ours["recall"], theirs["recall"]),
        "ndcg": _ratio(ours["ndcg"], theirs["ndcg"]),
        "qps_by_concurrency": {
            row["concurrency"]: _ratio(row["qps"], other["qps"])
            for row in ours["concurrency"] for other in theirs["concurrency"]
            if row["concurrency"] == other["concurrency"]},
    }


def build(results: list[dict], log_scan: dict, meta: dict) -> dict:
    cases: dict[str, dict] = {}
    order = {SWITCHYARD: 0, PGVECTOR: 1}
    for case in sorted(results, key=lambda c: (_case_key(c), order.get(c["task_config"]["db"], 2))):
        entry = cases.setdefault(_case_key(case)[1], {"systems": {}})
        entry["systems"][case["task_config"]["db"]] = _system(case)
    for entry in cases.values():
        ours, theirs = entry["systems"].get(SWITCHYARD), entry["systems"].get(PGVECTOR)
        if ours and theirs and ours["ok"] and theirs["ok"]:
            entry["ratios_switchyard_over_pgvector"] = _ratios(ours, theirs)
    expected = 2 * (1 + len(meta["plan"]["dataset"]["label_percentages"]))
    all_ok = len(results) == expected and all(s["ok"] for e in cases.values() for s in e["systems"].values())
    return {
        **meta,
        "cases": cases,
        "logs": log_scan,
        "clean": meta["vectordbbench_exit_code"] == 0 and all_ok and not log_scan["errors"],
        "note": ("Timings are from a shared 2-core machine (client processes, Switchyard, and both PostgreSQL "
                 "servers on the same cores, other work possibly running): compare the two systems within this "
                 "run, not with other machines."),
    }


def machine() -> dict:
    versions = {}
    for name in ("vectordb-bench", "switchyard", "faiss-cpu", "psycopg", "pgvector"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()], "versions": versions}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def markdown(report: dict) -> str:
    plan = report["plan"]
    data = plan["dataset"]
    hnsw = plan["hnsw"]
    lines = [
        "# VectorDBBench: Switchyard and pgvector",
        "",
        (f"VectorDBBench {report['machine']['versions'].get('vectordb-bench', '?')}, custom-dataset performance "
         f"case, {data['size']:,} x {data['dim']} ({data['metric']}), {data['queries']:,} queries, k={plan['k']}, "
         f"HNSW m={hnsw['m']}, ef_construction={hnsw['ef_construction']}, ef_search={hnsw['ef_search']}, "
         f"{plan['duration']} s per concurrency {plan['concurrencies']}, started {report['started']}."),
        "",
        f"Command: `{report['command']}`",
        "",
    ]
    switchyard = plan.get("switchyard", {})
    if switchyard.get("ef_search", hnsw["ef_search"]) != hnsw["ef_search"] or switchyard.get("env"):
        lines += [f"Switchyard searched with ef={switchyard.get('ef_search', hnsw['ef_search'])}"
                  + (f", service settings {', '.join(switchyard['env'])}" if switchyard.get("env") else "") + ".", ""]
    transport = "its unix socket" if str(switchyard.get("url", "")).startswith("unix:") else "TCP"
    client = ("a plain JSON client (requests, keep-alive, JSON float lists)" if switchyard.get("client") == "plain-json"
              else "switchyard_client (libcurl when pycurl is installed, raw float32 searches)")
    lines += [f"Switchyard's client, {client}, reached it through {transport}; VectorDBBench's pgvector client reached "
              "PostgreSQL through " + ("its unix socket" if "host=/" in str(plan.get("pgvector", {}).get("dsn", ""))
                                       else "TCP") + ".", ""]
    for name, entry in report["cases"].items():
        concs = plan["concurrencies"]
        lines += [f"## {name}", "",
                  "| system | load s (insert + optimize) | max QPS (at concurrency) | "
                  + " | ".join(f"QPS c={c}" for c in concs) + " | recall | nDCG | serial p99 ms | result |",
                  "|---|---|---|" + "---|" * len(concs) + "---|---|---|---|"]
        for system, s in entry["systems"].items():
            by_conc = {row["concurrency"]: row["qps"] for row in s["concurrency"]}
            load = (f"{s['load_s']:.1f} (reused)" if s["load_reused"]
                    else f"{s['load_s']:.1f} ({s['insert_s']:.1f} + {s['optimize_s']:.1f})")
            lines.append(
                f"| {system} ({s['db_label']}) | {load} | "
                f"{s['max_qps']:.1f} ({s['max_qps_concurrency']}) | "
                + " | ".join(f"{by_conc[c]:.1f}" if c in by_conc else "-" for c in concs)
                + f" | {s['recall']:.4f} | {s['ndcg']:.4f} | {_ms(s['serial_p99_s'])} | {s['label']} |")
        ratios = entry.get("ratios_switchyard_over_pgvector")
        if ratios:
            lines += ["", (f"Switchyard / pgvector: max QPS x{ratios['max_qps']}, load time x{ratios['load_s']}, "
                           f"serial p99 x{ratios['serial_p99_s']}, recall x{ratios['recall']}, "
                           f"nDCG x{ratios['ndcg']}.")]
        if any(s["load_reused"] for s in entry["systems"].values()):
            lines += ["", ("(reused): the data loaded for the case above served this one too; VectorDBBench "
                           "repeats that load time.")]
        lines.append("")
    logs = report["logs"]
    lines += ["## VectorDBBench's logs", "",
              (f"{sum(e['count'] for e in logs['errors'])} ERROR / Traceback lines, "
               f"{sum(e['count'] for e in logs['warnings'])} WARNING lines "
               f"(VectorDBBench exit code {report['vectordbbench_exit_code']})."), ""]
    for kind in ("errors", "warnings"):
        for e in logs[kind]:
            lines.append(f"- {kind[:-1]} x{e['count']}: `{e['line'][:300]}`")
    sy = plan["switchyard"]
    lines += ["", f"Clean run: {'yes' if report['clean'] else 'NO'}.", "",
              f"Switchyard: engine `{sy['engine']}`, searched one vector per request over HTTP (micro-batched by the "
              "service under concurrency); its load time is JSON upserts, then its build job (the resident HNSW "
              + ("index and the pgvector HNSW index it keeps for fallback)." if sy["pgvector_index"] == "hnsw"
                 else "index only: no fallback pgvector index).")
              + " pgvector: VectorDBBench's own client (psycopg, COPY, then CREATE INDEX ... USING hnsw).", "",
              report["note"], ""]
    return "\n".join(lines)
