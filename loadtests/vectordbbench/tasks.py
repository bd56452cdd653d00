"""The run plan (written by the command, a JSON file) as VectorDBBench TaskConfigs: its custom-dataset performance
case, unfiltered and per label percentage, for Switchyard and for VectorDBBench's own pgvector client with the
same HNSW parameters, k, concurrencies and duration."""

from __future__ import annotations

from psycopg.conninfo import conninfo_to_dict
from vectordb_bench.backend.cases import CaseType
from vectordb_bench.backend.clients import DB
from vectordb_bench.backend.clients.pgvector.config import (
    PgVectorConfig,
    PgVectorHNSWConfig,
)
from vectordb_bench.models import (
    ALL_TASK_STAGES,
    CaseConfig,
    ConcurrencySearchConfig,
    TaskConfig,
)

from . import registry  # noqa: F401 - DB.Switchyard
from .config import SwitchyardConfig, SwitchyardHNSWConfig

TIMEOUT_S = 36_000  # VectorDBBench's own default for custom cases


def custom_case(dataset: dict, label_percentage: float | None) -> dict:
    train = dataset["train_files"]
    case = {
        "name": f"Custom {dataset['size']:,} x {dataset['dim']} ({dataset['metric']})",
        "description": f"VectorDBBench custom-dataset performance case on {dataset['dir']}",
        "load_timeout": TIMEOUT_S,
        "optimize_timeout": TIMEOUT_S,
        "dataset_config": {
            "name": "switchyard_custom", "dir": dataset["dir"], "size": dataset["size"], "dim": dataset["dim"],
            "metric_type": dataset["metric"], "file_count": len(train), "use_shuffled": False, "with_gt": True,
            "train_name": ",".join(train),
        },
    }
    if label_percentage is not None:
        case.update(use_filter=True, label_percentage=label_percentage)
    return case


def pgvector_config(dsn: str) -> PgVectorConfig:
    info = conninfo_to_dict(dsn)
    return PgVectorConfig(
        db_label="hnsw", user_name=info.get("user") or "postgres",
        # VectorDBBench refuses an empty password; a server with trust authentication never asks for it.
        password=info.get("password") or "unused",
        host=info.get("host") or "localhost", port=int(info.get("port") or 5432),
        db_name=info.get("dbname") or "postgres",
    )


def build_tasks(plan: dict) -> list[TaskConfig]:
    hnsw = plan["hnsw"]
    systems = {
        DB.Switchyard: (
            SwitchyardConfig(db_label=plan["switchyard"]["engine"], url=plan["switchyard"]["url"],
                             collection_name=plan["switchyard"]["collection_name"],
                             api_key=plan["switchyard"].get("api_key"),
                             client=plan["switchyard"].get("client", "switchyard_client")),
            lambda: SwitchyardHNSWConfig(m=hnsw["m"], ef_construction=hnsw["ef_construction"],
                                         ef_search=plan["switchyard"].get("ef_search", hnsw["ef_search"]),
                                         engine=plan["switchyard"]["engine"],
                                         pgvector_index=plan["switchyard"]["pgvector_index"]),
        ),
        DB.PgVector: (
            pgvector_config(plan["pgvector"]["dsn"]),
            lambda: PgVectorHNSWConfig(m=hnsw["m"], ef_construction=hnsw["ef_construction"],
                                       ef_search=hnsw["ef_search"],
                                       maintenance_work_mem=plan["pgvector"].get("maintenance_work_mem")),
        ),
    }
    concurrency = ConcurrencySearchConfig(num_concurrency=plan["concurrencies"], concurrency_duration=plan["duration"])
    tasks = []
    for db, (db_config, case_config) in systems.items():
        for label_percentage in [None, *plan["dataset"]["label_percentages"]]:
            tasks.append(TaskConfig(
                db=db, db_config=db_config, db_case_config=case_config(),
                case_config=CaseConfig(case_id=CaseType.PerformanceCustomDataset, k=plan["k"],
                                       custom_case=custom_case(plan["dataset"], label_percentage),
                                       concurrency_search_config=concurrency),
                stages=ALL_TASK_STAGES, load_concurrency=plan.get("load_concurrency", 0),
                insert_batch_size=plan["insert_batch_size"],
            ))
    return tasks
