"""Where benchmarks write by default (loadtests/processes.py: results_dir): never into an installed package, and
in a checkout only under a git-ignored folder."""

from __future__ import annotations

from pathlib import Path

from loadtests import processes

ROOT = Path(__file__).resolve().parents[1]


def test_the_variable_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("SWITCHYARD_RESULTS_DIR", str(tmp_path))
    assert processes.results_dir("olap") == tmp_path / "olap"


def test_a_checkout_writes_under_loadtests_results(monkeypatch):
    monkeypatch.delenv("SWITCHYARD_RESULTS_DIR", raising=False)
    monkeypatch.setattr(processes, "_CHECKOUT", ROOT)
    assert processes.results_dir("soak") == ROOT / "loadtests" / "results" / "soak"


def test_an_installed_package_writes_under_the_current_directory(monkeypatch, tmp_path):
    site = tmp_path / "site-packages"  # no pyproject.toml beside loadtests/
    (site / "loadtests").mkdir(parents=True)
    monkeypatch.delenv("SWITCHYARD_RESULTS_DIR", raising=False)
    monkeypatch.setattr(processes, "_CHECKOUT", site)
    monkeypatch.chdir(tmp_path)
    out = processes.results_dir("loadtest")
    assert out == tmp_path / "results" / "loadtest"
    assert site not in out.parents


def test_both_defaults_are_git_ignored():
    ignored = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()}
    assert {"loadtests/results/", "results/", "logs/"} <= ignored
