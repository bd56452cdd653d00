"""The artifacts users install: the sdist and the wheel built as a release would, the wheel installed into a fresh
venv outside the checkout and served from a temporary directory, and the wheel the Docker image builds from exactly
the files its Dockerfile copies. Slow (a venv and its dependencies), so each is built once per module."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import duckdb
import numpy as np
import pytest
import shapely

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(900)


def _run(command: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: nothing pointing at the checkout, no Switchyard settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SWITCHYARD_", "PYTHON", "VIRTUAL_ENV", "PYTEST")) and k != "COV_CORE_SOURCE"}
    return {**env, **extra}


def _build(source: Path, out: Path, *options: str) -> list[Path]:
    _run([sys.executable, "-m", "build", *options, "--outdir", str(out), str(source)], cwd=out)
    return sorted(out.iterdir())


def _wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if ".dist-info/" not in name}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    built = _build(ROOT, out)  # the sdist, then the wheel from the sdist
    (sdist,) = [p for p in built if p.name.endswith(".tar.gz")]
    (wheel,) = [p for p in built if p.suffix == ".whl"]
    (client,) = [p for p in _build(ROOT / "client", out, "--wheel") if p.name.startswith("switchyard_client")]
    return {"sdist": sdist, "wheel": wheel, "client": client}


@pytest.fixture(scope="module")
def installed(artifacts, tmp_path_factory) -> Path:
    """A fresh venv holding the wheel (and the loadtest extra) with the client's wheel, not the checkout; its bin
    folder."""
    venv = tmp_path_factory.mktemp("user") / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=venv.parent, env=_clean_env())
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
          str(artifacts["client"]), f"{artifacts['wheel']}[loadtest]"], cwd=venv.parent, env=_clean_env())
    return venv / "bin"


def test_the_wheel_holds_every_package_and_its_data(artifacts):
    files = _wheel_files(artifacts["wheel"])
    on_disk = {str(p.relative_to(ROOT)) for top in ("service", "indexes", "spatial", "olap", "migrations", "loadtests")
               for p in (ROOT / top).rglob("*.py") if "results" not in p.parts}
    in_git = (ROOT / ".git").exists()
    tracked = set(_run(["git", "ls-files", "-z", "--", "*.py"], cwd=ROOT).stdout.split("\0")) if in_git else on_disk
    assert sorted(on_disk & tracked - files) == []
    assert {p.name for p in (ROOT / "migrations").glob("*.sql")} <= {Path(f).name for f in files if f.endswith(".sql")}
    assert "loadtests/schemathesis.toml" in files
    assert not [f for f in files if f.startswith("tests/")]


def test_installed_wheel_imports_from_site_packages_not_the_checkout(installed, tmp_path):
    probe = ("import json, service, service.cluster, service.cluster.ray_layer, loadtests.runner, migrations;"
             "print(json.dumps([service.__file__, migrations.__file__]))")
    done = _run([str(installed / "python"), "-I", "-c", probe], cwd=tmp_path, env=_clean_env())
    for path in json.loads(done.stdout):
        assert "site-packages" in path and not Path(path).is_relative_to(ROOT), path
    assert "usage: switchyard loadtest" in _run([str(installed / "switchyard"), "loadtest", "--help"], cwd=tmp_path,
                                                env=_clean_env()).stdout
    assert "serve" in _run([str(installed / "switchyard"), "--help"], cwd=tmp_path, env=_clean_env()).stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Http:
    """A plain JSON client over TCP (urllib), as a user's first script would be."""

    def __init__(self, base: str) -> None:
        self.base = base

    def __call__(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                raw = response.read()
                return response.status, json.loads(raw) if raw else {}
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def ok(self, method: str, path: str, body: dict | None = None) -> dict:
        status, answer = self(method, path, body)
        assert status < 300, (method, path, status, answer)
        return answer

    def job(self, location: str, timeout_s: float = 300) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.ok("GET", location)
            if job["state"] in ("succeeded", "failed"):
                return job
            time.sleep(0.2)
        raise AssertionError(f"job still running: {job}")


@pytest.fixture(scope="module")
def served(installed, tmp_path_factory):
    """`switchyard serve` from the fresh venv, in a temporary directory, on a fresh data dir."""
    home = tmp_path_factory.mktemp("served")
    port = _free_port()
    log = (home / "serve.log").open("w")
    process = subprocess.Popen([str(installed / "switchyard"), "serve", "--port", str(port), "--data-dir", "data"],
                               cwd=home, env=_clean_env(SWITCHYARD_FRONTS="0"), stdout=log, stderr=subprocess.STDOUT)
    http = Http(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 180
    try:
        while True:
            assert process.poll() is None, (home / "serve.log").read_text()[-3000:]
            try:
                if http("GET", "/readyz")[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, (home / "serve.log").read_text()[-3000:]
            time.sleep(0.25)
        http.home = home
        yield http
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
    # Uvicorn re-raises the SIGTERM it drained on (-15); the embedded database must have stopped cleanly.
    log_text = (home / "serve.log").read_text()
    assert process.returncode in (0, -signal.SIGTERM) and "embedded PostgreSQL stopped" in log_text, log_text[-3000:]


def test_served_wheel_creates_upserts_and_searches_exactly(served):
    rng = np.random.default_rng(7)
    vectors = rng.normal(size=(300, 16)).astype(np.float32)
    served.ok("POST", "/v1/collections", {"name": "docs", "dim": 16, "metric": "l2", "index": {"type": "brute_force"}})
    acked = served.ok("PUT", "/v1/collections/docs/points", {"ids": list(range(300)), "vectors": vectors.tolist()})
    assert acked["seq"] >= 1
    for query in rng.normal(size=(5, 16)).astype(np.float32):
        answer = served.ok("POST", "/v1/collections/docs/search",
                           {"vector": query.tolist(), "k": 5, "consistency": "strong"})
        exact = np.argsort(((vectors - query) ** 2).sum(axis=1), kind="stable")[:5]
        assert answer["ids"] == exact.tolist(), answer


def test_served_wheel_answers_an_ssb_query_as_duckdb_does(served):
    generated = served.ok("POST", "/v1/olap/ssb/generate", {"scale_factor": 0.01})
    job = served.job(generated["location"])
    assert job["state"] == "succeeded", job
    dataset = served.home / job["result"]["dataset"] if not Path(job["result"]["dataset"]).is_absolute() \
        else Path(job["result"]["dataset"])
    answer = served.ok("POST", "/v1/olap/ssb/queries/1.1", {"engine": "cpu"})
    # Q1.1 written out here, over the same Parquet files: the service's query text is not the oracle.
    want = duckdb.connect().execute(f"""
        SELECT sum(lo_extendedprice * lo_discount) FROM read_parquet('{dataset}/lineorder.parquet') lo
        JOIN read_parquet('{dataset}/ddate.parquet') d ON lo.lo_orderdate = d.d_datekey
        WHERE d.d_year = 1993 AND lo.lo_discount BETWEEN 1 AND 3 AND lo.lo_quantity < 25""").fetchone()[0]
    assert want and answer["rows"] == [[want]], answer


def test_served_wheel_joins_points_in_polygons_as_shapely_does(served):
    rng = np.random.default_rng(3)
    lon, lat = rng.uniform(-10, 10, 2000), rng.uniform(-10, 10, 2000)
    squares = [shapely.box(x, y, x + 4, y + 3) for x, y in ((-9, -9), (-2, 0), (3, 4))]
    served.ok("POST", "/v1/spatial/layers", {"name": "pts", "kind": "points", "lon": lon.tolist(), "lat": lat.tolist()})
    served.ok("POST", "/v1/spatial/layers", {"name": "boxes", "kind": "polygons",
                                             "wkt": [shapely.to_wkt(s) for s in squares]})
    answer = served.ok("POST", "/v1/spatial/joins/point-in-polygon", {"points": "pts", "polygons": "boxes"})
    points = shapely.points(lon, lat)
    want = [int(shapely.covers(square, points).sum()) for square in squares]
    assert answer["counts"] == want, answer


def _docker_build_context(dockerfile: Path, target: Path) -> list[str]:
    """Copy into `target` exactly what the Dockerfile's build stage COPYs from the build context."""
    copied = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if not words or words[0] != "COPY" or any(w.startswith("--from") for w in words):
            continue
        sources = [w for w in words[1:-1] if not w.startswith("--")]
        for source in sources:
            path = ROOT / source
            assert path.exists(), f"the Dockerfile copies {source}, which the repository lacks"
            if path.is_dir():
                shutil.copytree(path, target / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results"))
            else:
                shutil.copy2(path, target / source)
            copied.append(source)
    return copied


def test_the_image_builds_the_same_wheel_from_what_its_dockerfile_copies(artifacts, tmp_path):
    context = tmp_path / "context"
    context.mkdir()
    copied = _docker_build_context(ROOT / "Dockerfile", context)
    assert "pyproject.toml" in copied
    (wheel,) = [p for p in _build(context, tmp_path, "--wheel") if p.suffix == ".whl"]
    assert _wheel_files(wheel) == _wheel_files(artifacts["wheel"])
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^RUN pip install \./client "\.\$\{EXTRAS:\+\[\$EXTRAS\]\}"', text, re.M)  # GPU and CPU
