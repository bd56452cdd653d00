"""Settings grouped by concern: every SWITCHYARD_* name of the flat settings still works, from the environment and
as a keyword; docs/configuration.md documents every setting."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from service import settings_doc
from service.process.links import EngineSockets, ProcessLinks
from service.settings import FLAT, GROUPS, Settings

ROOT = Path(__file__).resolve().parent.parent

# The variables of the flat Settings this grouping replaced (engine_socket and engine_links were the parent's
# wiring of its children, now service/process/links.py): users' environments and compose files name them.
FLAT_NAMES_BEFORE = """
database_url data_dir api_key host port workers fronts engines uds log_level access_log access_log_sample
max_body_bytes max_bulk_bytes cpu_threads huge_pages batch_max inline_search_us inline_turn_us express_protocol
batch_window_ms consistency bounded_staleness_ms consistency_timeout_ms replication_poll_ms replication_trace_dir
rebuild_dead_fraction rebuild_delta_rows db_pool_min db_pool_max db_connect_timeout_s db_command_timeout_s
duckdb_memory_mb db_check_interval_s db_max_restarts readiness_timeout_s db_acquire_timeout_s sql_pool_max admission
max_inflight inflight_latency_tolerance min_inflight loop_lag_target_ms queue_wait_ms queue_depth request_timeout_s
quota_requests_per_s
quota_burst quota_engine_seconds_per_s quota_engine_seconds_burst breaker_failures breaker_cooldown_s max_jobs
max_queued_jobs disk_reserve_mb ssb_quota_gb ops_auth ssb_import_dir gpu gpu_memory_pool_mb gpu_build_process
ray_address ray_namespace shards shard_replicas olap_partitions olap_replicas spatial_partitions spatial_replicas
shard_cpus shard_gpus shard_call_timeout_s ray_ingress_replicas
max_payload_keys
read_timeout_s
max_payload_value_bytes max_payload_row_bytes
max_connections keep_alive_s
gil_switch_us
""".split()


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.upper().startswith("SWITCHYARD_"):
            monkeypatch.delenv(key)
    return monkeypatch


def test_every_flat_name_is_kept_and_no_new_one_is_unnamed():
    from service.cluster.ray_layer import SHARD_SETTINGS

    assert sorted(FLAT) == sorted(FLAT_NAMES_BEFORE)
    assert set(SHARD_SETTINGS) <= set(FLAT)  # what the ingress hands its shard actors, by flat name


def test_the_environment_reaches_each_group(clean_env):
    clean_env.setenv("SWITCHYARD_DB_POOL_MAX", "7")
    clean_env.setenv("switchyard_port", "9001")  # any case, as pydantic-settings reads variables
    clean_env.setenv("SWITCHYARD_GPU", "off")  # a flat name that is also a group's name
    clean_env.setenv("SWITCHYARD_ADMISSION", "false")
    clean_env.setenv("SWITCHYARD_REPLICATION_TRACE_DIR", "trace")
    clean_env.setenv("SWITCHYARD_SHARDS", "5")
    clean_env.setenv("SWITCHYARD_NOT_A_SETTING", "x")  # tools' variables (SWITCHYARD_URL, ...) are not refused
    s = Settings()
    assert (s.database.pool_max, s.server.port, s.gpu.mode, s.admission.enabled, s.cluster.shards) == (
        7, 9001, "off", False, 5)
    assert s.replication.trace_dir == (Path.cwd() / "trace").resolve()


def test_keywords_flat_or_grouped_win_over_the_environment(clean_env):
    clean_env.setenv("SWITCHYARD_DB_POOL_MAX", "7")
    clean_env.setenv("SWITCHYARD_DATABASE_URL", "postgresql://env/db")
    s = Settings(db_pool_max=3)
    assert (s.database.pool_max, s.database.url) == (3, "postgresql://env/db")
    s = Settings(database={"pool_max": 2})
    assert (s.database.pool_max, s.database.url) == (2, "postgresql://env/db")
    s = Settings(database={"db_pool_max": 4}, port=8001)
    assert (s.database.pool_max, s.server.port) == (4, 8001)


def test_flat_round_trip_and_unknown_names(clean_env):
    s = Settings(database_url="postgresql://h/db", data_dir="/tmp/sy", shards=3, cpu_threads=2, gpu="off")
    assert Settings(**s.flat()) == s
    assert s.flat()["cpu_threads"] == 2 and s.cpu.threads == 2
    with pytest.raises(ValidationError, match="unknown setting 'db_pool_maximum'"):
        Settings(db_pool_maximum=3)


@pytest.mark.parametrize(("values", "variable"), [
    ({"port": 0}, "SWITCHYARD_PORT"), ({"db_pool_max": "many"}, "SWITCHYARD_DB_POOL_MAX"),
    ({"database_url": "mysql://x"}, "SWITCHYARD_DATABASE_URL"), ({"gpu": "on"}, "SWITCHYARD_GPU"),
    ({"admission": "maybe"}, "SWITCHYARD_ADMISSION"),
])
def test_errors_name_the_variable(clean_env, values, variable):
    with pytest.raises(ValidationError) as caught:
        Settings(**values)
    assert [Settings.variable(e["loc"]) for e in caught.value.errors()] == [variable]


def test_derived_values_read_their_groups(clean_env):
    s = Settings(engines=2, fronts=2, cpu_threads=None, data_dir="/tmp/sy")
    assert s.replicas == 2 and s.front_processes == 2 and s.engine_processes == 2
    assert s.ssb_imports == Path("/tmp/sy/import") and s.embedded_pgdata == Path("/tmp/sy/postgres")
    assert Settings(duckdb_memory_mb=128).duckdb_memory == "128MB"


@pytest.mark.parametrize("cores, workers, inline_us", [(2, 1, 500), (2, 2, 5000), (4, 2, 500), (1, 1, 5000)])
def test_lone_searches_stay_on_the_event_loop_longer_where_no_core_is_spare(clean_env, monkeypatch, cores, workers,
                                                                            inline_us):
    monkeypatch.setattr("service.settings.usable_cores", lambda: cores)
    assert Settings(workers=workers).inline_search_s == pytest.approx(inline_us / 1e6)
    assert Settings(workers=workers, inline_search_us=0).inline_search_s == 0  # always a thread, as asked


def test_the_cores_counted_are_those_the_process_may_run_on(clean_env, monkeypatch):
    """`taskset -c 0,1 switchyard serve` on a 16-core machine: two cores, so no front processes, an in-flight
    floor of 2, one engine thread and lone searches kept on the event loop (no core to spare for a thread)."""
    from service import settings as settings_module

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert settings_module.usable_cores() == 2
    s = Settings(workers=2)
    assert s.front_processes == 0 and s.engine_threads == 1
    assert s.admission.min_inflight == 2 and s.admission.max_inflight == 128
    assert s.inline_search_s == pytest.approx(0.005)


def test_every_setting_is_described_and_the_page_is_current():
    for group, model in GROUPS.items():
        assert model.__doc__, group
        for name, info in model.model_fields.items():
            assert info.description and len(info.description) > 8, f"{group}.{name} has no description"
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == settings_doc.markdown(), "regenerate: python -m service.settings_doc > docs/configuration.md"
    for flat in FLAT:
        assert f"`SWITCHYARD_{flat.upper()}`" in page


def test_process_links_travel_in_the_childs_environment_only():
    links = ProcessLinks(tuple(EngineSockets(Path(f"/s/{i}.sock"), Path(f"/s/{i}-http.sock")) for i in range(2)))
    engine = ProcessLinks.handed_down(links.as_engine(1).environment())
    assert engine.engines == links.engines and engine.engine_socket == Path("/s/1.sock")
    front = ProcessLinks.handed_down(links.environment())
    assert front.engines == links.engines and front.engine_socket is None
    assert ProcessLinks.handed_down({}) == ProcessLinks()
    assert not any(name.startswith("process") or "link" in name for name in FLAT)
