"""Figures per point, and the report folder: summary.json, summary.md and PNG plots read at a glance."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from loadtests.sweep import percentiles


def _main_row(requests: dict[str, dict], prefixes: tuple[str, ...] = ("POST search", "SQL search")) -> tuple[str, dict]:
    for key, figures in requests.items():
        if key.startswith(prefixes):
            return key, figures
    return "", {"count": 0, "failures": 0, "rps": 0.0, "avg": None, "median": None, "p99": None}


def point_figures(row: dict[str, Any], k: int, batch: int) -> dict[str, Any]:
    """One vectors point: QPS (queries, not requests), exact p50/p99, recall as Locust reports it and as the
    tally counts it (the two must agree: same responses)."""
    key, search = _main_row(row["requests"])
    recall_row = row["requests"].get(f"RECALL recall@{k}")
    tally = row["tally"]
    exact = tally["recall_hits"] / (tally["recall_queries"] * k) if tally.get("recall_queries") else None
    return {**{m: row[m] for m in ("target", "param", "value", "setting", "stage", "users", "label", "folder")},
            "qps": round(search["rps"] * batch, 1), "requests": search["count"], "failures": search["failures"],
            "failure_rate": round(search["failures"] / search["count"], 4) if search["count"] else None,
            **percentiles(tally, key, (50, 99)), "locust_p99_ms": search["p99"],
            "recall": round(recall_row["avg"] / 100, 6) if recall_row else None,
            "recall_exact": round(exact, 6) if exact is not None else None,
            "answered_by": {n.split(":", 1)[1]: c for n, c in tally.items() if n.startswith("engine:")},
            "fallbacks": {n.split(":", 1)[1]: c for n, c in tally.items() if n.startswith("fallback:")}}


def write(out: Path, summary: dict[str, Any]) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    table = {"vectors": vectors_table, "vectors-mixed": mixed_table}.get(summary["workload"], requests_table)
    (out / "summary.md").write_text(f"# switchyard loadtest {summary['workload']}\n\n"
                                    f"`{summary['environment']['command']}`\n\n{table(summary)}\n")
    plots = {"vectors": _vector_plots, "vectors-mixed": _mixed_plots}.get(summary["workload"], _request_plots)
    plots(out, summary)


# -- tables -----------------------------------------------------------------------------------------------------
def vectors_table(summary: dict[str, Any]) -> str:
    lines = ["| target | setting | users | QPS | p50 ms | p99 ms | recall@%d | failures |" % summary["k"],
             "|---|---|---|---|---|---|---|---|"]
    for r in summary["points"]:
        mark = " (chosen)" if r.get("chosen") else ""
        lines.append(f"| {r['target']} | {r['setting']}{mark} | {r['users']} | {r['qps']:,.0f} "
                     f"| {_ms(r.get('p50_ms'))} | {_ms(r.get('p99_ms'))} | {_f3(r['recall'])} | {r['failures']} |")
    target_recall = summary.get("recall_target", 0.0)
    best = _best_by_target([r for r in summary["points"] if (r["recall"] or 0) >= target_recall])
    if best:
        lines += ["", f"Max QPS at recall@{summary['k']} >= {target_recall} (any setting, any users):", "",
                  "| target | max QPS | at | recall | vs pgvector-direct |", "|---|---|---|---|---|"]
        base = best.get("pgvector-direct")
        for target, r in best.items():
            ratio = f"{r['qps'] / base['qps']:.2f}x" if base and base["qps"] else ""
            lines.append(f"| {target} | {r['qps']:,.0f} | {r['setting']}, {r['users']} users | {_f3(r['recall'])} "
                         f"| {ratio} |")
    return "\n".join(lines)


def _best_by_target(points: list[dict]) -> dict[str, dict]:
    best: dict[str, dict] = {}
    for r in points:
        if r["target"] not in best or r["qps"] > best[r["target"]]["qps"]:
            best[r["target"]] = r
    return best


def requests_table(summary: dict[str, Any]) -> str:
    lines = ["| users | request | RPS | p50 ms | p99 ms | requests | failures |", "|---|---|---|---|---|---|---|"]
    for point in summary["points"]:
        for name, r in point["by_request"].items():
            lines.append(f"| {point['users']} | {name} | {r['rps']:,.1f} | {_ms(r['p50_ms'])} | {_ms(r['p99_ms'])} "
                         f"| {r['count']} | {r['failures']} |")
    return "\n".join(lines)


def mixed_table(summary: dict[str, Any]) -> str:
    lines = [requests_table(summary), "", "Read-your-writes, probed right after each acknowledged write, on a new "
             "connection (any worker process):", "",
             "| users | level | upserts found | deletes gone | deleted ids returned (broke the level's promise) |",
             "|---|---|---|---|---|"]
    for point in summary["points"]:
        for level, r in point["read_your_writes"].items():
            lines.append(f"| {point['users']} | {level} | {_share(r['upsert_found'], r['upsert_probes'])} "
                         f"| {_share(r['delete_gone'], r['delete_probes'])} "
                         f"| {r['deleted_returned']} ({r['deleted_returned_broken']}) |")
    return "\n".join(lines)


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%} of {whole}" if whole else "n/a"


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _f3(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def request_figures(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per request name of a point (not the synthetic figures): RPS, exact percentiles, counts."""
    out = {}
    for key, r in row["requests"].items():
        if key.split(" ", 1)[0] in ("RECALL", "RYW"):
            continue
        out[key] = {"rps": r["rps"], "count": r["count"], "failures": r["failures"],
                    **percentiles(row["tally"], key, (50, 99))}
    return out


# -- plots ------------------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _vector_plots(out: Path, summary: dict[str, Any]) -> None:
    plt = _pyplot()
    by_target: dict[str, list[dict]] = defaultdict(list)
    for r in summary["points"]:
        by_target[r["target"]].append(r)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for target, rows in by_target.items():
        curve = sorted((r for r in rows if r["stage"] == "params"), key=lambda r: r["recall"] or 0)
        ax.plot([r["recall"] for r in curve], [r["qps"] for r in curve], marker="o", label=target)
        for r in curve:
            ax.annotate(r["setting"], (r["recall"], r["qps"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    users = summary["points"][0]["users"] if summary["points"] else 0
    ax.set(xlabel=f"recall@{summary['k']}", ylabel="queries per second", yscale="log",
           title=f"Recall vs QPS at {users} users ({summary['dataset']['rows']:,} x {summary['dataset']['dim']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "recall_vs_qps.png", dpi=120)
    plt.close(fig)
    users_rows = {t: sorted((r for r in rows if r["stage"] == "users" or r.get("chosen")), key=lambda r: r["users"])
                  for t, rows in by_target.items()}
    _users_plots(out, {f"{t} ({rows[0]['setting']})" if rows else t: rows for t, rows in users_rows.items()})


def _users_axis(ax: Any, series: dict[str, list[dict]]) -> None:
    users = sorted({r["users"] for rows in series.values() for r in rows})
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(users, [str(u) for u in users])


def _users_plots(out: Path, series: dict[str, list[dict]]) -> None:
    """latency_vs_users.png (p50 solid, p99 dashed) and qps_vs_users.png, one line per series."""
    plt = _pyplot()
    many = len(series) > 6  # then the legend goes beside the plot and colours come from a 20-colour map
    size = (11, 5.5) if many else (7, 4.5)
    colors = plt.get_cmap("tab20").colors if many else [f"C{i}" for i in range(10)]

    def legend(ax: Any) -> None:
        if many:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
        else:
            ax.legend(fontsize=7)

    fig, ax = plt.subplots(figsize=size)
    for i, (name, rows) in enumerate(sorted(series.items())):
        color = colors[i % len(colors)]
        ax.plot([r["users"] for r in rows], [r.get("p50_ms") for r in rows], marker="o", color=color,
                label=f"{name} p50")
        ax.plot([r["users"] for r in rows], [r.get("p99_ms") for r in rows], marker="s", ls="--", color=color,
                label=f"{name} p99")
    ax.set(xlabel="users (closed loop)", ylabel="latency, ms", yscale="log",
           title="Latency vs users (p50 solid, p99 dashed)")
    _users_axis(ax, series)
    ax.grid(True, which="both", alpha=0.3)
    legend(ax)
    fig.tight_layout()
    fig.savefig(out / "latency_vs_users.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=size)
    for i, (name, rows) in enumerate(sorted(series.items())):
        ax.plot([r["users"] for r in rows], [r.get("qps", r.get("rps")) for r in rows], marker="o", label=name,
                color=colors[i % len(colors)])
    ax.set(xlabel="users (closed loop)", ylabel="per second", title="Throughput vs users")
    _users_axis(ax, series)
    ax.grid(True, which="both", alpha=0.3)
    legend(ax)
    fig.tight_layout()
    fig.savefig(out / "qps_vs_users.png", dpi=120)
    plt.close(fig)


def _request_series(summary: dict[str, Any]) -> dict[str, list[dict]]:
    series: dict[str, list[dict]] = defaultdict(list)
    for point in summary["points"]:
        for name, r in point["by_request"].items():
            series[name].append({"users": point["users"], **r})
    return series


def _request_plots(out: Path, summary: dict[str, Any]) -> None:
    _users_plots(out, _request_series(summary))


def _mixed_plots(out: Path, summary: dict[str, Any]) -> None:
    _request_plots(out, summary)
    plt = _pyplot()
    last = summary["points"][-1]["read_your_writes"] if summary["points"] else {}
    levels = list(last)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    found = [_ratio(last[lv]["upsert_found"], last[lv]["upsert_probes"]) for lv in levels]
    gone = [_ratio(last[lv]["delete_gone"], last[lv]["delete_probes"]) for lv in levels]
    xs = range(len(levels))
    ax.bar([x - 0.2 for x in xs], found, width=0.4, label="upsert found by the next search")
    ax.bar([x + 0.2 for x in xs], gone, width=0.4, label="delete gone from the next search")
    ax.set_xticks(list(xs), levels)
    ax.set(ylim=(0, 1.05), ylabel="share of probes",
           title=f"Read-your-writes by consistency level ({summary['points'][-1]['users']} users)" if levels else "")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(out / "read_your_writes.png", dpi=120)
    plt.close(fig)


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
