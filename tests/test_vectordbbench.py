"""The VectorDBBench client package (loadtests/vectordbbench).

The data set, ground truth, summary and offline-guard tests need no VectorDBBench. The rest need it, in this
interpreter or in the package's own environment (.venv-vdbb, see loadtests/vectordbbench/README.md); they run in a
subprocess of that interpreter, so VectorDBBench's import-time logging set-up never touches this process, and are
skipped with the reason when neither has it (CI installs only the test extra).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from loadtests.vectordbbench import __main__ as command
from loadtests.vectordbbench import dataset as ds
from loadtests.vectordbbench import summary

REPO = Path(__file__).resolve().parents[1]
TESTDATA = REPO / "loadtests" / "vectordbbench" / "testdata"
FIXTURE_LABEL = "switchyard-20261123-131058"  # the task label of the real run in testdata/


def _vdbb_python() -> str | None:
    if find_spec("vectordb_bench") is not None:
        return sys.executable
    venv = REPO / ".venv-vdbb" / "bin" / "python"
    # find_spec, not import: importing VectorDBBench creates its log folder in the working directory.
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vectordb_bench') is None)"
    if venv.exists() and subprocess.run([str(venv), "-c", probe], capture_output=True, check=False).returncode == 0:
        return str(venv)
    return None


VDBB_PYTHON = _vdbb_python()
needs_vdbb = pytest.mark.skipif(VDBB_PYTHON is None, reason=(
    "vectordb_bench is not importable here nor in .venv-vdbb (it is the optional 'vectordbbench' extra, installed "
    "in its own environment: see loadtests/vectordbbench/README.md)"))


def run_vdbb(code: str, tmp_path: Path, timeout: float = 120) -> str:
    """Python code in a fresh VectorDBBench interpreter, its log and results kept in tmp_path."""
    env = {**os.environ, "LOG_FILE": str(tmp_path / "logs" / "vdbb.log"), "RESULTS_LOCAL_DIR": str(tmp_path / "res"),
           "PYTHONPATH": str(REPO)}
    done = subprocess.run([VDBB_PYTHON, "-c", textwrap.dedent(code)], check=False, cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


# -- data sets -----------------------------------------------------------------------------------------------
def test_label_values_are_vectordbbenchs():
    assert [ds.label_value(p) for p in (0.001, 0.002, 0.005, 0.01, 0.02, 0.5, 0.99)] == [
        "label_0.1p", "label_0.2p", "label_0.5p", "label_1p", "label_2p", "label_50p", "label_99p"]
    assert ds.label_gt_file(0.02) == "neighbors_labels_label_2p.parquet"


@pytest.mark.parametrize("metric", ds.METRICS)
def test_ground_truth_is_the_exact_neighbours(metric):
    rng = np.random.default_rng(1)
    train, test = rng.normal(size=(500, 8)).astype(np.float32), rng.normal(size=(20, 8)).astype(np.float32)
    rows = rng.choice(500, 120, replace=False)
    for subset in (None, rows):
        got = ds.ground_truth(train, test, 7, metric, subset, chunk=6)
        ids = np.arange(500) if subset is None else np.sort(subset)
        base, q = train[ids].astype(np.float64), test.astype(np.float64)
        if metric == "l2":
            dist = ((q[:, None, :] - base[None]) ** 2).sum(-1)
        elif metric == "cosine":
            dist = (-(q / np.linalg.norm(q, axis=1, keepdims=True))
                    @ (base / np.linalg.norm(base, axis=1, keepdims=True)).T)
        else:
            dist = -q @ base.T
        assert (got == ids[np.argsort(dist, axis=1, kind="stable")[:, :7]]).all()


def test_synthetic_is_seeded_and_shaped():
    a_train, a_test = ds.synthetic(2000, 16, 30, seed=3)
    b_train, b_test = ds.synthetic(2000, 16, 30, seed=3)
    assert a_train.shape == (2000, 16) and a_test.shape == (30, 16) and a_train.dtype == np.float32
    assert (a_train == b_train).all() and (a_test == b_test).all()
    assert not (ds.synthetic(2000, 16, 30, seed=4)[0] == a_train).all()


def test_npy_files_become_the_custom_dataset_layout(tmp_path):
    train, test = ds.synthetic(3000, 12, 25, seed=5)
    np.save(tmp_path / "train.npy", train)
    np.save(tmp_path / "test.npy", test)
    loaded_train, loaded_test, neighbors = ds.load_npy([tmp_path / "train.npy", tmp_path / "test.npy"])
    assert neighbors is None
    out = tmp_path / "layout"
    made = ds.write_custom_dataset(out, loaded_train, loaded_test, "l2", 10, None, [0.01, 0.2], seed=5)
    assert (made.size, made.dim, made.queries, made.label_percentages) == (3000, 12, 25, [0.01, 0.2])

    train_t = pq.read_table(out / "train.parquet")
    assert train_t.column("id").to_pylist() == list(range(3000))
    assert np.allclose(np.array(train_t.column("emb").to_pylist(), np.float32), train)
    test_t = pq.read_table(out / "test.parquet")
    assert test_t.column("id").to_pylist() == list(range(25))
    gt = pq.read_table(out / "neighbors.parquet")
    assert gt.column("id").to_pylist() == list(range(25))
    assert (np.array(gt.column("neighbors_id").to_pylist()) == ds.ground_truth(train, test, 10, "l2")).all()

    labels = np.array(pq.read_table(out / "scalar_labels.parquet").column("labels").to_pylist())
    assert (labels == "label_1p").sum() == 30 and (labels == "label_20p").sum() == 600
    for p in (0.01, 0.2):
        label_gt = np.array(pq.read_table(out / ds.label_gt_file(p)).column("neighbors_id").to_pylist())
        assert (labels[label_gt] == ds.label_value(p)).all()
        assert (label_gt == ds.ground_truth(train, test, 10, "l2", np.flatnonzero(labels == ds.label_value(p)))).all()

    again = ds.describe_parquet_dir(out, "l2", [0.2])
    assert (again.size, again.dim, again.queries, again.train_files) == (3000, 12, 25, ["train"])
    with pytest.raises(ValueError, match="neighbors_labels_label_5p"):
        ds.describe_parquet_dir(out, "l2", [0.05])


def test_given_neighbours_are_checked(tmp_path):
    train, test = ds.synthetic(100, 4, 5)
    np.save(tmp_path / "train.npy", train)
    np.save(tmp_path / "test.npy", test)
    np.save(tmp_path / "bad.npy", np.full((5, 10), 100))
    with pytest.raises(ValueError, match="train row numbers"):
        ds.load_npy([tmp_path / "train.npy", tmp_path / "test.npy", tmp_path / "bad.npy"])
    with pytest.raises(ValueError, match="k is 10"):
        ds.write_custom_dataset(tmp_path / "o", train, test, "l2", 10, np.zeros((5, 3), np.int64))
    with pytest.raises(ValueError, match="more than 1"):
        ds.make_labels(10, [0.6, 0.5])


def test_the_command_needs_a_switchyard():
    with pytest.raises(SystemExit):
        command.parse_args(["run", "--synthetic", "1000,8"])
    args = command.parse_args(["run", "--synthetic", "1000,8", "--start-service", "--concurrency", "1,2",
                               "--label-percentages", "0.01,0.5"])
    assert args.concurrency == [1, 2] and args.label_percentages == [0.01, 0.5] and args.pgvector_dsn is None
    assert command.redact("postgresql://u:secret@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert command.redact("postgresql://postgres:@/postgres?host=/s") == "postgresql://postgres:@/postgres?host=/s"


# -- the summary of a real run (testdata/: VectorDBBench's result files of a 10,000 x 128 run) ---------------
def _fixture_report(log_scan: dict | None = None) -> dict:
    results = summary.read_results(TESTDATA, FIXTURE_LABEL)
    plan = {"dataset": {"size": 10000, "dim": 128, "metric": "l2", "queries": 200, "label_percentages": [0.02, 0.5]},
            "k": 10, "concurrencies": [1, 2], "duration": 10,
            "hnsw": {"m": 16, "ef_construction": 64, "ef_search": 64},
            "switchyard": {"engine": "auto", "pgvector_index": "hnsw"}}
    return summary.build(results, log_scan or {"errors": [], "warnings": [], "files": []},
                         {"command": "python -m loadtests.vectordbbench run ...", "started": "2026-11-23T13:10:58",
                          "task_label": FIXTURE_LABEL, "plan": plan, "vectordbbench_exit_code": 0,
                          "machine": {"versions": {"vectordb-bench": "2.0.0"}}})


def test_summary_reports_what_vectordbbench_reported():
    report = _fixture_report()
    assert list(report["cases"]) == ["unfiltered", "label filter 2%", "label filter 50%"]
    sy = report["cases"]["unfiltered"]["systems"]["Switchyard"]
    pg = report["cases"]["unfiltered"]["systems"]["PgVector"]
    assert (sy["load_s"], sy["insert_s"], sy["optimize_s"]) == (3.3883, 1.3691, 2.0192)
    assert sy["max_qps"] == max(row["qps"] for row in sy["concurrency"]) and sy["max_qps_concurrency"] == 2
    assert (sy["recall"], sy["ndcg"], sy["serial_p99_s"]) == (0.9835, 0.9853, 0.0023)
    ratios = report["cases"]["unfiltered"]["ratios_switchyard_over_pgvector"]
    assert ratios["max_qps"] == round(sy["max_qps"] / pg["max_qps"], 3)
    assert ratios["qps_by_concurrency"].keys() == {1, 2}
    assert report["cases"]["label filter 50%"]["systems"]["Switchyard"]["load_reused"]
    assert report["clean"]

    text = summary.markdown(report)
    assert "| Switchyard (auto) | 3.4 (1.4 + 2.0) | 1402.4 (2) | 1180.9 | 1402.4 | 0.9835 | 0.9853 | 2.3 | :) |" in text
    assert "3.4 (reused)" in text and "Clean run: yes." in text


def test_an_error_in_the_logs_or_a_failed_case_is_not_clean(tmp_path):
    assert not _fixture_report({"errors": [{"line": "Traceback (most recent call last):", "count": 1}],
                                "warnings": [], "files": []})["clean"]
    results = summary.read_results(TESTDATA, FIXTURE_LABEL)
    results[0]["label"] = "x"
    bad = summary.build(results, {"errors": [], "warnings": [], "files": []},
                        {k: v for k, v in _fixture_report().items()
                         if k in ("command", "started", "task_label", "plan", "vectordbbench_exit_code", "machine")})
    assert not bad["clean"]


def test_log_scan_finds_errors_and_tracebacks_once(tmp_path):
    console = tmp_path / "console.log"
    console.write_text(
        "2026-11-23 13:10:36,957 | \x1b[92mINFO\x1b[0m: \x1b[92mall good\x1b[0m (models.py:677) (6631)\n"
        "2026-11-23 13:10:37,001 | \x1b[95mERROR\x1b[0m: \x1b[95mboom\x1b[0m (x.py:1) (6632)\n"
        "2026-11-23 13:10:38,001 | \x1b[95mERROR\x1b[0m: \x1b[95mboom\x1b[0m (x.py:1) (6633)\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "psycopg.ProgrammingError: vector type not found in the database\n"
        "2026-11-23 13:10:39,001 | \x1b[93mWARNING\x1b[0m: \x1b[93mslow\x1b[0m (y.py:2) (6634)\n")
    logfile = tmp_path / "vectordb_bench.log"
    logfile.write_text("2026-11-23 13:10:37,001 | ERROR |boom (x.py:1)\n"
                       "2026-11-23 13:10:38,001 | ERROR |boom (x.py:1)\n")
    scan = summary.scan_logs([logfile, console, tmp_path / "missing.log"])
    assert scan["errors"] == [{"line": "ERROR | boom (x.py:1)", "count": 2},
                              {"line": "Traceback (most recent call last):", "count": 1},
                              {"line": "psycopg.ProgrammingError: vector type not found in the database", "count": 1}]
    assert scan["warnings"] == [{"line": "WARNING | slow (y.py:2)", "count": 1}]


def test_offline_guard_refuses_other_hosts():
    code = textwrap.dedent("""
        import socket
        from loadtests.vectordbbench import offline
        offline.install()
        server = socket.create_server(("127.0.0.1", 0))
        socket.create_connection(server.getsockname(), timeout=5).close()  # loopback: allowed
        for target in (("192.0.2.1", 443), ("example.com", 443)):
            try:
                socket.create_connection(target, timeout=5)
            except ConnectionRefusedError as exc:
                assert "offline run" in str(exc), exc
            else:
                raise AssertionError(f"connected to {target}")
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "VDBB_ALLOWED_HOSTS": ""}
    done = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


# -- with VectorDBBench ----------------------------------------------------------------------------------------
@needs_vdbb
def test_registration_dispatch_and_unpickling_in_a_fresh_process(tmp_path):
    out = run_vdbb("""
        import pickle, subprocess, sys
        import vectordb_bench.backend.clients  # VectorDBBench first: the package registers at its import then
        import loadtests.vectordbbench
        from loadtests.vectordbbench import registry
        from vectordb_bench.backend.clients import DB, IndexType
        from vectordb_bench.backend.filter import LabelFilter, NewIntFilter
        n = len(DB)
        registry.register()
        assert len(DB) == n and DB("Switchyard") is DB.Switchyard is DB["Switchyard"]
        cls = DB.Switchyard.init_cls
        assert cls.__name__ == "Switchyard" and DB.Switchyard.config_cls.__name__ == "SwitchyardConfig"
        assert DB.Switchyard.case_config_cls(IndexType.HNSW).__name__ == "SwitchyardHNSWConfig"
        assert DB.Switchyard.case_config_cls(IndexType.IVFFlat) is None
        assert DB.PgVector.init_cls.__name__ == "PgVector"  # the others still dispatch as before
        assert cls.filter_supported(LabelFilter(label_percentage=0.01))
        assert not cls.filter_supported(NewIntFilter(filter_rate=0.5, int_value=5))
        # A process that never imported this package unpickles DB.Switchyard (VectorDBBench's spawned workers).
        blob = pickle.dumps(DB.Switchyard)
        child = subprocess.run([sys.executable, "-c",
            "import pickle, sys; db = pickle.load(sys.stdin.buffer); print(db.name, db.init_cls.__name__)"],
            input=blob, capture_output=True, check=True)
        print(child.stdout.decode().strip())
    """, tmp_path)
    assert out.strip().endswith("Switchyard Switchyard")


@needs_vdbb
def test_the_plan_becomes_vectordbbench_tasks(tmp_path):
    out = run_vdbb("""
        from loadtests.vectordbbench.tasks import build_tasks
        from vectordb_bench.backend.assembler import Assembler
        from vectordb_bench.backend.data_source import DatasetSource
        plan = {"task_label": "t", "k": 10, "concurrencies": [1, 2], "duration": 5, "insert_batch_size": 1000,
                "dataset": {"dir": "/nowhere", "size": 1000, "dim": 8, "metric": "l2", "queries": 10,
                            "label_percentages": [0.5], "train_files": ["train"]},
                "hnsw": {"m": 8, "ef_construction": 32, "ef_search": 40},
                "switchyard": {"url": "http://127.0.0.1:1", "collection_name": "c", "engine": "cpu",
                               "pgvector_index": "none"},
                "pgvector": {"dsn": "postgresql://u:pw@/db?host=/sock", "maintenance_work_mem": "1GB"}}
        tasks = build_tasks(plan)
        assert [(t.db.name, t.case_config.custom_case.get("label_percentage")) for t in tasks] == [
            ("Switchyard", None), ("Switchyard", 0.5), ("PgVector", None), ("PgVector", 0.5)]
        sy, pg = tasks[0], tasks[2]
        sy.db_case_config.metric_type = "L2"
        assert sy.db_case_config.index_param() == {"metric": "l2", "index": {"type": "hnsw", "params": {
            "m": 8, "ef_construction": 32}}, "pgvector_index": {"type": "none"}}
        assert sy.db_case_config.search_param() == {"engine": "cpu", "params": {"ef": 40}}
        assert (pg.db_case_config.m, pg.db_case_config.ef_construction, pg.db_case_config.ef_search) == (8, 32, 40)
        assert pg.db_config.to_dict()["connect_config"] == {"host": "/sock", "port": 5432, "dbname": "db",
                                                            "user": "u", "password": "pw"}
        runner = Assembler.assemble_all("r", "t", tasks, DatasetSource.S3)  # filter support checked here
        print(len(runner.case_runners))
    """, tmp_path)
    assert out.strip() == "4"


@needs_vdbb
@pytest.mark.timeout(900)
def test_a_whole_run_against_switchyard_and_pgvector(tmp_path):
    """The command end to end on a tiny data set: a service and a PostgreSQL of its own, VectorDBBench's spawned
    processes, an unfiltered and a label-filter case for both systems, a clean summary."""
    done = subprocess.run(
        [VDBB_PYTHON, "-m", "loadtests.vectordbbench", "run", "--synthetic", "2000,16", "--queries", "50",
         "--start-service", "--concurrency", "1", "--duration", "2", "--label-percentages", "0.1",
         "--insert-batch-size", "500", "--out", str(tmp_path / "out")],
        check=False, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=850)
    report = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert done.returncode == 0 and report["clean"], done.stdout[-5000:] + done.stderr[-3000:]
    for case in ("unfiltered", "label filter 10%"):
        for system in report["cases"][case]["systems"].values():
            assert system["ok"] and system["recall"] > 0.9 and system["max_qps"] > 0
    assert (tmp_path / "out" / "summary.md").read_text().startswith("# VectorDBBench")
