"""switchyard-client as a user installs it (issue 36): `pip install ./client` into a fresh venv outside the checkout,
without the server's dependencies, then the README's client example run as a script against a running service."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.processes import local_service
from test_artifacts import _clean_env, _run

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(600)


def readme_example() -> str:
    """The Python block of the README's 'From Python' paragraph."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("**From Python.**"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_runs_from_a_fresh_venv_with_only_the_client(tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=_clean_env())
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(ROOT / "client")],
         cwd=tmp_path, env=_clean_env())
    installed = _run([str(python), "-m", "pip", "list", "--format=freeze"], cwd=tmp_path, env=_clean_env()).stdout
    assert "switchyard-client==" in installed
    for server_only in ("fastapi", "asyncpg", "faiss-cpu", "duckdb", "uvicorn"):
        assert f"{server_only}==" not in installed.lower()
    script = tmp_path / "example.py"
    with local_service(1, tmp_path / "data", tmp_path / "serve.log") as url:
        script.write_text(readme_example().replace("http://localhost:8000", url))
        done = subprocess.run([str(python), "-I", str(script)], cwd=tmp_path, env=_clean_env(), capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "seq=" in lines[0]
    assert lines[1].startswith("[1 3]") and lines[1].endswith("session")
