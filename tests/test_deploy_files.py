"""compose.yaml, its CPU override and the Dockerfile, checked by parsing (no Docker engine runs here)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


class ComposeLoader(yaml.SafeLoader):
    """SafeLoader that understands Compose's !reset and !override tags."""


ComposeLoader.add_constructor("!reset", lambda loader, node: {"__reset__": True})
ComposeLoader.add_constructor("!override", lambda loader, node: loader.construct_mapping(node))


def load(name: str) -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=ComposeLoader)


def test_compose_services_ports_and_dependency():
    compose = load("compose.yaml")
    services = compose["services"]
    assert set(services) == {"db", "switchyard"}
    assert "pgvector" in services["db"]["image"]
    assert services["db"]["ports"] == ["127.0.0.1:5432:5432"]
    app = services["switchyard"]
    assert app["ports"] == ["127.0.0.1:8000:8000"]
    assert app["depends_on"]["db"]["condition"] == "service_healthy"
    url = app["environment"]["SWITCHYARD_DATABASE_URL"]
    assert re.match(r"postgresql://switchyard:.*@db:5432/switchyard$", url)
    assert app["environment"]["SWITCHYARD_HOST"] == "0.0.0.0"
    assert set(compose["volumes"]) == {"pgdata", "switchyard-data"}


def test_compose_healthchecks():
    services = load("compose.yaml")["services"]
    assert "pg_isready" in " ".join(services["db"]["healthcheck"]["test"])
    app_check = " ".join(services["switchyard"]["healthcheck"]["test"])
    assert "/readyz" in app_check and ":8000" in app_check
    for service in services.values():
        assert service["healthcheck"]["start_period"]


def test_compose_reserves_a_gpu_and_the_override_drops_it():
    app = load("compose.yaml")["services"]["switchyard"]
    (device,) = app["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    override = load("compose.cpu.yaml")["services"]["switchyard"]
    assert override["deploy"] == {"__reset__": True}
    assert override["build"]["args"]["EXTRAS"] == ""


def test_dockerfile_is_cuda_based_healthy_unprivileged_and_serves():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", text, re.M)
    assert "HEALTHCHECK" in text and "/readyz" in text
    assert re.search(r"^USER (?!root)\w+", text, re.M)
    assert re.search(r'^CMD \["switchyard", "serve"\]', text, re.M)
    assert "EXPOSE 8000" in text
    # The pip install names each package directory the project ships.
    for package in ("service", "indexes", "spatial", "olap", "migrations", "loadtests"):
        assert f"COPY {package} ./{package}" in text


def test_compose_ray_runs_a_head_with_the_ingress_and_gpu_workers():
    from service.cluster.serve_proxy import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    compose = load("compose.ray.yaml")
    services = compose["services"]
    assert set(services) == {"db", "ray-head", "ray-worker"}
    head, worker = services["ray-head"], services["ray-worker"]
    assert "ray start --head" in head["command"][-1] and "switchyard serve --ray" in head["command"][-1]
    assert "--address=ray-head:6379" in worker["command"][-1] and "--block" in worker["command"][-1]
    assert head["build"]["args"]["EXTRAS"] == "gpu,ray" and worker["image"] == head["image"]
    for node in (head, worker):
        assert re.match(r"postgresql://switchyard:.*@db:5432/switchyard$",
                        node["environment"]["SWITCHYARD_DATABASE_URL"])
        assert "switchyard-data:/var/lib/switchyard" in node["volumes"]
        # Serve's proxies (on any node) answer a request lost with its ingress replica 503, through our hook
        assert node["environment"][PROXY_CALLBACK_ENV] == PROXY_CALLBACK
    assert head["ports"] == ["127.0.0.1:8000:8000"] and "ports" not in worker
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["count"] == 1
    # Every actor of the default layout (8: 2 x 2 shard replicas, 2 SSB and 2 spatial partitions) fits the two
    # one-GPU workers of `--scale ray-worker=2`: a deployment that cannot place them all refuses to start.
    assert worker["environment"]["SWITCHYARD_SHARD_GPUS"].startswith("${SWITCHYARD_SHARD_GPUS:-0.25}")
    from service.cluster.placement import Footprint
    from service.settings import Settings

    assert Footprint.of(Settings(data_dir=ROOT / "data", shard_gpus=0.25)).total_gpus == 2


def test_the_serve_config_file_names_a_builder_that_makes_the_ingress(monkeypatch):
    ray = __import__("pytest").importorskip("ray", reason="the 'ray' extra is not installed")
    config = yaml.safe_load((ROOT / "serve.ray.yaml").read_text())
    (app,) = config["applications"]
    module, _, name = app["import_path"].partition(":")
    for key, value in app["runtime_env"]["env_vars"].items():
        monkeypatch.setenv(key, value)
    builder = getattr(__import__(module, fromlist=[name]), name)
    application = builder(app["args"])
    assert isinstance(application, ray.serve.Application)
    assert app["runtime_env"]["env_vars"]["SWITCHYARD_RAY_ADDRESS"] == "auto" and app["route_prefix"] == "/"
