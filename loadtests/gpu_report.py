"""The markdown of a `make gpu-check` report (loadtests/gpu_check.py): its JSON, as tables a person reads."""

from __future__ import annotations

import json
from typing import Any


def _t(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds * 1000:,.2f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def _cell(text: Any) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def _measure(m: dict[str, Any] | None, what: str) -> str:
    if not m:
        return "not measured"
    if what == "cached" and m.get("status") == "none":
        return "none (no result cache)"
    if "median_s" not in m:
        return "not measured"
    text = f"{_t(m['median_s'])} (x{m['runs']})"
    if what == "resident":
        if m.get("valid") is False:
            text += " INVALID: a cache hit"
        elif m.get("joins_recomputed") is not None:
            text += f", {m['joins_recomputed']} of {m['runs']} calls computed a join"
        elif m.get("note"):
            text += f", {m['note'].split(':')[0]}"
    if what == "cached":
        text += ", cache hit: not compute" if m.get("cache_hit") else ", a repeat: not a speed-up"
    return text


def spatial_tables(b: dict[str, Any]) -> list[str]:
    lines = [f"Compile: {json.dumps(b.get('compile_s', {}))}. Distance joins paged at "
             f"{b.get('max_pairs_per_page', 0):,} pairs; distances compared with rtol {b['tolerance']['rtol']:g}, "
             f"atol {b['tolerance']['atol_m']:g} m." if "tolerance" in b else "", "",
             "| work | engine | first fresh call | fresh: new layers (median) | resident: join recomputed (median) "
             "| cached: result-cache repeat (median) |", "|---|---|---|---|---|---|"]
    for case in b.get("cases", []):
        for side in ("gpu", "cpu"):
            m = case.get(side)
            if not m:
                lines.append(f"| {case['label']} | {side} | cut | | | |")
                continue
            if m.get("error"):
                lines.append(f"| {case['label']} | {m['engine']} | error: {_cell(m['error'])[:300]} | | | |")
                continue
            fresh = m.get("fresh") or {}
            lines.append(f"| {case['label']} | {m['engine']} | {_t(fresh.get('first_s'))} | "
                         f"{_measure(fresh, 'fresh')} | {_measure(m.get('resident'), 'resident')} | "
                         f"{_measure(m.get('cached'), 'cached')} |")
    lines += ["", "| work | resident speed-up (GPU vs CPU) | fresh speed-up | answers |", "|---|---|---|---|"]
    for case in b.get("cases", []):
        a = case.get("answers")
        if a is None:
            answers = "not compared (cut)"
        elif case["work"] == "pip":
            answers = (f"counts {'equal' if a['counts_equal'] else 'DIFFER'} ({a['matched']:,} matched); "
                       f"page of {a['page_pairs']:,} pairs {'equal' if a['page_equal'] else 'DIFFER'}")
        else:
            answers = (f"{a['pairs']:,} pairs {'equal' if a['pairs_equal'] else 'DIFFER'}; distances "
                       f"{'within tolerance' if a.get('distances_equal') else 'DIFFER'}, max abs diff "
                       f"{a.get('max_abs_diff_m', float('nan')):.3g} m, "
                       f"{a.get('distances_not_bit_identical', 0):,} not bit-identical")
        speedups = [f"{case[k]}x" if k in case else "" for k in ("speedup_resident", "speedup_fresh")]
        lines.append(f"| {case['label']} | {speedups[0]} | {speedups[1]} | {answers} |")
    return lines


def profile_table(b: dict[str, Any]) -> list[str]:
    lines = [f"{b.get('points', 0):,} points x {b.get('polygons', 0):,} polygons, a fresh process: import and "
             f"construct {_t(b.get('import_and_construct_s'))}, warm_up() {_t(b.get('warm_up_s'))}, first "
             f"pip_counts under cProfile {_t(b.get('first_pip_counts_profiled_s'))}, a second fresh call (new layer "
             f"objects, no profiler) {_t(b.get('second_fresh_pip_counts_s'))}.", "",
             "| cumulative | own | calls | function |", "|---|---|---|---|"]
    for row in b.get("top_cumulative", []):
        lines.append(f"| {_t(row['cumtime_s'])} | {_t(row['tottime_s'])} | {row['ncalls']} | "
                     f"`{_cell(row['function'])}` |")
    return lines


def http_tables(b: dict[str, Any]) -> list[str]:
    client = b.get("client", {})
    lines = [f"Client: timed requests with {client.get('timed_requests')}, {client.get('transport')}; uploads with "
             f"{client.get('uploads')}. Service: `switchyard serve`, layout {json.dumps(b.get('layout'))}, ready in "
             f"{b.get('ready_s')} s. Layers: {b.get('points', 0):,} points, {b.get('polygons', 0):,} polygons, "
             f"{b.get('distance_points', 0):,} points for the distance self-join at {b.get('radius_m')} m.", "",
             "| upload | as | rows | bytes | seconds |", "|---|---|---|---|---|"]
    for name, u in b.get("uploads", {}).items():
        lines.append(f"| {name} | {u.get('as', '')} | {u.get('rows')} | {u.get('bytes') or ''} | {u.get('seconds')} |")
    lines += ["", "| request | engine asked | answered by | first: wall ms | first: took_ms | later: wall ms "
              "(median) | later: took_ms (median) | later calls |", "|---|---|---|---|---|---|---|---|"]
    for s in b.get("summary", []):
        lines.append(f"| {s['request']} | {s['engine']} | {s['answered_by']} | {s.get('first_wall_ms', '')} | "
                     f"{s.get('first_took_ms', '')} | {s.get('later_wall_ms_median', '')} | "
                     f"{s.get('later_took_ms_median', '')} | {s.get('later_calls', 0)} |")
    lines += ["", "Later calls of the same request may be served from an engine's cache of join results (through "
              "HTTP nothing drops it): they are repeats, not compute.", "",
              f"Answers: `{json.dumps(b.get('answers', {}))}`"]
    return lines


def markdown(report: dict[str, Any]) -> str:
    here = report["here"]
    lines = [f"# GPU check, {report['stamp']}", ""]
    if here["device"]:
        lines += [f"Device: {d['name']} ({d['memory_bytes'] / 2**30:.0f} GiB)" for d in here["device"]]
    else:
        lines.append(f"Device: none ({here['device_reason']})")
    lines += ["", f"Python {here.get('python')}, {here.get('cores')} cores, numpy {here.get('numpy')} "
              f"(numpy.row_stack: {here.get('numpy_row_stack')}). Budget: "
              f"{report.get('budget_s') or 'none'} s; the run took {report.get('seconds')} s."]
    lines += ["", "| library | installed | version |", "|---|---|---|"]
    lines += [f"| {m} | {'yes' if v['installed'] else 'no'} | {v['version'] or ''} |"
              for m, v in here["libraries"].items()]
    lines += ["", "## Tests", "", "| set | status | passed | failed | skipped | seconds | why skipped or failed |",
              "|---|---|---|---|---|---|---|"]
    for t in report["tests"]:
        reasons = sorted({c["reason"] for c in t.get("cases", []) if c["outcome"] != "passed" and c["reason"]})
        why = "; ".join(reasons)[:300] or (t.get("reason") or "")[:300]
        lines.append(f"| {t['set']} | {t['status']} | {t.get('passed', 0)} | {t.get('failed', 0)} | "
                     f"{t.get('skipped', 0)} | {t.get('seconds', '')} | {_cell(why)} |")
    layout = report.get("layout", {})
    lines += ["", "## Process layout (one engine process per device)", "",
              f"{layout.get('status', 'not run')}: " + (layout.get("reason") or json.dumps(
                  {k: v for k, v in layout.items() if k != "status"}))]
    lines += ["", "## Benchmarks (GPU engine against the CPU engine, same data, answers compared)", ""]
    for b in report["benches"]:
        lines += [f"### {b['bench']}: {b['status']}" + (f" ({_cell(b['reason'])[:600]})" if b.get("reason") else ""),
                  ""]
        if b["status"] == "skipped" or (b["status"] == "cut" and len(b) <= 3):
            continue
        lines.append(f"In {b.get('seconds')} s of the {b.get('allowed_s')} s it was allowed.")
        lines.append("")
        if b["bench"] == "spatial":
            lines += spatial_tables(b)
        elif b["bench"] == "spatial-first-request":
            lines += profile_table(b)
        elif b["bench"] == "spatial-http":
            lines += http_tables(b)
        else:
            detail = {k: v for k, v in b.items() if k not in ("bench", "status", "reason", "log_tail", "seconds",
                                                              "allowed_s")}
            lines.append(f"`{json.dumps(detail)}`")
        for what in ("cut", "failures"):
            if b.get(what):
                lines += ["", f"{what.capitalize()}:"] + [f"- {_cell(x)}" for x in b[what]]
        lines.append("")
    return "\n".join(lines) + "\n"
