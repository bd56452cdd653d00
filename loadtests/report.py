"""Figures per point, and the report folder: summary.json, summary.md and PNG plots read at a glance."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from loadtests.sweep import percentiles

# A point with a larger share of its requests failed or refused is never a headline figure: its throughput is what
# was left once the engine had refused the rest, not what it serves.
MAX_HEADLINE_FAILURE_RATE = 0.01


def answers(figures: dict[str, Any]) -> tuple[int, float, float]:
    """(successful answers, answers per second, failed requests per second) of one request's Locust figures.
    Locust's requests/s counts every request, failed and refused ones included; the answers are the requests
    that did not fail, over the same window (its first request to its last)."""
    count, failures, rps = figures["count"], figures["failures"], figures["rps"]
    if not count:
        return 0, 0.0, 0.0
    return count - failures, rps * (count - failures) / count, rps * failures / count


def headline_eligible(row: dict[str, Any]) -> bool:
    """May this point be a headline figure (max QPS, the setting the users sweep runs at)? Only with requests and
    at most MAX_HEADLINE_FAILURE_RATE of them failed."""
    rate = row.get("failure_rate")
    return rate is not None and rate <= MAX_HEADLINE_FAILURE_RATE


def _main_row(requests: dict[str, dict], prefixes: tuple[str, ...] = ("POST search", "SQL search")) -> tuple[str, dict]:
    for key, figures in requests.items():
        if key.startswith(prefixes):
            return key, figures
    return "", {"count": 0, "failures": 0, "rps": 0.0, "avg": None, "median": None, "p99": None}


def point_figures(row: dict[str, Any], k: int, batch: int) -> dict[str, Any]:
    """One vectors point: QPS (queries answered per second: successful requests only, times the batch), failed
    requests per second beside it, exact p50/p99 (of the answers), recall as Locust reports it and as the tally
    counts it (the two must agree: same responses)."""
    key, search = _main_row(row["requests"])
    recall_row = row["requests"].get(f"RECALL recall@{k}")
    tally = row["tally"]
    exact = tally["recall_hits"] / (tally["recall_queries"] * k) if tally.get("recall_queries") else None
    answered, answers_per_s, failed_per_s = answers(search)
    return {**{m: row[m] for m in ("target", "param", "value", "setting", "stage", "users", "label", "folder")},
            "qps": round(answers_per_s * batch, 1), "failed_per_s": round(failed_per_s, 1),
            "requests": search["count"], "answers": answered, "failures": search["failures"],
            "refused": tally.get(f"refused:{key}", 0),
            "failure_rate": round(search["failures"] / search["count"], 4) if search["count"] else None,
            **percentiles(tally, key, (50, 99)), "locust_p99_ms": search["p99"],
            "recall": round(recall_row["avg"] / 100, 6) if recall_row else None,
            "recall_exact": round(exact, 6) if exact is not None else None,
            "answered_by": {n.split(":", 1)[1]: c for n, c in tally.items() if n.startswith("engine:")},
            "fallbacks": {n.split(":", 1)[1]: c for n, c in tally.items() if n.startswith("fallback:")}}


def write(out: Path, summary: dict[str, Any]) -> None:
    if summary["workload"] == "vectors":
        summary["headline"] = {t: {m: r[m] for m in ("label", "setting", "users", "qps", "recall", "failure_rate")}
                               for t, r in headline(summary).items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    table = {"vectors": vectors_table, "vectors-mixed": mixed_table}.get(summary["workload"], requests_table)
    (out / "summary.md").write_text(f"# switchyard loadtest {summary['workload']}\n\n"
                                    f"`{summary['environment']['command']}`\n\n{table(summary)}\n")
    plots = {"vectors": _vector_plots, "vectors-mixed": _mixed_plots}.get(summary["workload"], _request_plots)
    plots(out, summary)


# -- tables -----------------------------------------------------------------------------------------------------
FAILURES_NOTE = ("QPS and answers/s count successful answers only; failed/s the requests that failed or were "
                 "refused (503, 429: refused, not run). A point with more than "
                 f"{MAX_HEADLINE_FAILURE_RATE:.0%} of its requests failed is marked ⚠ and is never a headline.")


def _failures(r: dict[str, Any]) -> str:
    """'0', or '3,803 of 8,211 (46.3%, 3,803 refused) ⚠'."""
    if not r["failures"]:
        return "0"
    mark = "" if headline_eligible(r) else " ⚠"
    return f"{r['failures']:,} of {r['requests']:,} ({r['failure_rate']:.1%}, {r['refused']:,} refused){mark}"


def vectors_table(summary: dict[str, Any]) -> str:
    lines = ["| target | setting | users | QPS | failed/s | p50 ms | p99 ms | recall@%d | failures |" % summary["k"],
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["points"]:
        mark = " (chosen)" if r.get("chosen") else ""
        lines.append(f"| {r['target']} | {r['setting']}{mark} | {r['users']} | {r['qps']:,.0f} "
                     f"| {r['failed_per_s']:,.0f} | {_ms(r.get('p50_ms'))} | {_ms(r.get('p99_ms'))} "
                     f"| {_f3(r['recall'])} | {_failures(r)} |")
    lines += ["", FAILURES_NOTE]
    target_recall = summary.get("recall_target", 0.0)
    best = headline(summary)
    if best:
        lines += ["", f"Max QPS at recall@{summary['k']} >= {target_recall} with at most "
                  f"{MAX_HEADLINE_FAILURE_RATE:.0%} of requests failed (any setting, any users):", "",
                  "| target | max QPS | at | recall | vs pgvector-direct |", "|---|---|---|---|---|"]
        base = best.get("pgvector-direct")
        for target, r in best.items():
            ratio = f"{r['qps'] / base['qps']:.2f}x" if base and base["qps"] else ""
            lines.append(f"| {target} | {r['qps']:,.0f} | {r['setting']}, {r['users']} users | {_f3(r['recall'])} "
                         f"| {ratio} |")
    missing = sorted({r["target"] for r in summary["points"]} - set(best))
    if missing:
        lines += ["", f"No headline for {', '.join(missing)}: no point reached recall@{summary['k']} >= "
                  f"{target_recall} with at most {MAX_HEADLINE_FAILURE_RATE:.0%} of its requests failed."]
    return "\n".join(lines)


def headline(summary: dict[str, Any]) -> dict[str, dict]:
    """Per target, its max-QPS point among those at the recall target with at most 1% of requests failed."""
    target_recall = summary.get("recall_target", 0.0)
    return _best_by_target([r for r in summary["points"] if (r["recall"] or 0) >= target_recall])


def _best_by_target(points: list[dict]) -> dict[str, dict]:
    """The max-QPS point of each target, among the points that may be a headline (headline_eligible)."""
    best: dict[str, dict] = {}
    for r in points:
        if headline_eligible(r) and (r["target"] not in best or r["qps"] > best[r["target"]]["qps"]):
            best[r["target"]] = r
    return best


def requests_table(summary: dict[str, Any]) -> str:
    lines = ["| users | request | answers/s | failed/s | p50 ms | p99 ms | requests | failures |",
             "|---|---|---|---|---|---|---|---|"]
    for point in summary["points"]:
        for name, r in point["by_request"].items():
            lines.append(f"| {point['users']} | {name} | {r['answers_per_s']:,.1f} | {r['failed_per_s']:,.1f} "
                         f"| {_ms(r['p50_ms'])} | {_ms(r['p99_ms'])} | {r['count']} | {_failures(r)} |")
    return "\n".join([*lines, "", FAILURES_NOTE])


def mixed_table(summary: dict[str, Any]) -> str:
    lines = [requests_table(summary), "", "Read-your-writes, probed right after each acknowledged write, on a new "
             "connection (any worker process). A deleted id returned by a search sent after its delete was "
             "acknowledged is a failure only where the level promised it gone (strong, session, bounded past its "
             "bound); within a level's bound it is counted here, apart, and is no failure:", "",
             "| users | level | upserts found | deletes gone | deleted ids returned within the level's bound "
             "| broke the level's promise (failures) |", "|---|---|---|---|---|---|"]
    for point in summary["points"]:
        for level, r in point["read_your_writes"].items():
            lines.append(f"| {point['users']} | {level} | {_share(r['upsert_found'], r['upsert_probes'])} "
                         f"| {_share(r['delete_gone'], r['delete_probes'])} "
                         f"| {r['deleted_returned_within_bound']} | {r['deleted_returned_broken']} |")
    return "\n".join(lines)


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%} of {whole}" if whole else "n/a"


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _f3(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def request_figures(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per request name of a point (not the synthetic figures): successful answers and failed requests per second,
    exact percentiles (of the answers), counts, refusals."""
    out = {}
    for key, r in row["requests"].items():
        if key.split(" ", 1)[0] in ("RECALL", "RYW"):
            continue
        _, answers_per_s, failed_per_s = answers(r)
        out[key] = {"answers_per_s": round(answers_per_s, 2), "failed_per_s": round(failed_per_s, 2),
                    "count": r["count"], "failures": r["failures"], "refused": row["tally"].get(f"refused:{key}", 0),
                    "failure_rate": round(r["failures"] / r["count"], 4) if r["count"] else None,
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
            if r["recall"] is not None:  # none: the step had no answer to score
                ax.annotate(r["setting"], (r["recall"], r["qps"]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        _mark_failures(ax, [(r["recall"], r["qps"], r) for r in curve])
    _failures_legend(ax, summary["points"])
    users = summary.get("param_users") or (summary["points"][0]["users"] if summary["points"] else 0)
    ax.set(xlabel=f"recall@{summary['k']}", ylabel="queries answered per second", yscale="log",
           title=f"Recall vs QPS at {users} users ({summary['dataset']['rows']:,} x {summary['dataset']['dim']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "recall_vs_qps.png", dpi=120)
    plt.close(fig)
    users_rows = {t: sorted((r for r in rows if r["stage"] == "users" or r.get("chosen")), key=lambda r: r["users"])
                  for t, rows in by_target.items()}
    _users_plots(out, {f"{t} ({rows[0]['setting']})" if rows else t: rows for t, rows in users_rows.items()})


FAILED_STYLE = {"s": 150, "facecolors": "none", "edgecolors": "red", "linewidths": 1.5, "zorder": 5}


def _mark_failures(ax: Any, points: list[tuple[Any, Any, dict]]) -> None:
    """A red ring, and the share failed, on every point whose requests failed or were refused."""
    for x, y, r in points:
        if r.get("failures") and x is not None and y is not None:
            ax.scatter([x], [y], **FAILED_STYLE)
            ax.annotate(f"{r['failure_rate']:.1%} failed", (x, y), color="red", fontsize=7, xytext=(4, -10),
                        textcoords="offset points")


def _failures_legend(ax: Any, rows: list[dict]) -> None:
    if any(r.get("failures") for r in rows):
        ax.scatter([], [], label=f"failed / refused requests (over {MAX_HEADLINE_FAILURE_RATE:.0%}: no headline)",
                   **FAILED_STYLE)


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
        _mark_failures(ax, [(r["users"], r.get("p99_ms"), r) for r in rows])
    _failures_legend(ax, [r for rows in series.values() for r in rows])
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
        ax.plot([r["users"] for r in rows], [_throughput(r) for r in rows], marker="o", label=name,
                color=colors[i % len(colors)])
        _mark_failures(ax, [(r["users"], _throughput(r), r) for r in rows])
    _failures_legend(ax, [r for rows in series.values() for r in rows])
    ax.set(xlabel="users (closed loop)", ylabel="successful answers per second",
           title="Throughput vs users (failed and refused requests not counted)")
    _users_axis(ax, series)
    ax.grid(True, which="both", alpha=0.3)
    legend(ax)
    fig.tight_layout()
    fig.savefig(out / "qps_vs_users.png", dpi=120)
    plt.close(fig)


def _throughput(r: dict[str, Any]) -> float:
    """Successful answers per second: a vectors point's QPS (queries), a request's answers/s."""
    return r["qps"] if "qps" in r else r["answers_per_s"]


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
    by_request = summary["points"][-1]["by_request"] if levels else {}
    for x, level in zip(xs, levels):  # probes that failed or were refused are no probes: say so on the plot
        probe = by_request.get(f"POST probe {level}", {})
        if probe.get("failures"):
            ax.scatter([x], [1.0], marker="x", color="red", zorder=5)
            ax.annotate(f"{probe['failures']} probes failed", (x, 1.0), color="red", fontsize=7, ha="center",
                        xytext=(0, -12), textcoords="offset points")
    ax.set(ylim=(0, 1.05), ylabel="share of probes",
           title=f"Read-your-writes by consistency level ({summary['points'][-1]['users']} users)" if levels else "")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(out / "read_your_writes.png", dpi=120)
    plt.close(fig)


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
