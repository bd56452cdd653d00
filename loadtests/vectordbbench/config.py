"""VectorDBBench config classes for Switchyard: where the service is (DBConfig) and how a case indexes and
searches (DBCaseConfig)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, SecretStr
from vectordb_bench.backend.clients.api import (
    DBCaseConfig,
    DBConfig,
    IndexType,
    MetricType,
)

# VectorDBBench's metric names -> Switchyard's.
METRICS = {MetricType.L2: "l2", MetricType.COSINE: "cosine", MetricType.IP: "inner_product"}


class SwitchyardConfig(DBConfig):
    url: str = "http://127.0.0.1:8000"
    collection_name: str = "vdbbench"
    api_key: SecretStr | None = None
    timeout_s: float = 3600.0  # a build job is waited for through this connection too
    # "plain-json": inserts and searches as the obvious client sends them (requests, JSON float lists), to compare
    client: Literal["switchyard_client", "plain-json"] = "switchyard_client"

    def to_dict(self) -> dict:
        return {
            "url": self.url,
            "collection_name": self.collection_name,
            "api_key": self.api_key.get_secret_value() if self.api_key else None,
            "timeout_s": self.timeout_s,
            "client": self.client,
        }


class SwitchyardHNSWConfig(BaseModel, DBCaseConfig):
    """A resident HNSW index (FAISS on the CPU) plus the pgvector HNSW index Switchyard keeps for fallback."""

    metric_type: MetricType | None = None  # set by VectorDBBench from the dataset
    m: int = 16
    ef_construction: int = 64
    ef_search: int = 64
    engine: Literal["auto", "cpu", "pgvector"] = "auto"
    pgvector_index: Literal["hnsw", "none"] = "hnsw"
    consistency: Literal["strong", "session", "bounded", "eventually"] | None = None  # None: the service's default

    def metric(self) -> str:
        if self.metric_type not in METRICS:
            raise ValueError(f"Switchyard has no metric {self.metric_type}; it has {sorted(METRICS.values())}")
        return METRICS[self.metric_type]

    def index_param(self) -> dict:
        pgvector = {"type": "none"} if self.pgvector_index == "none" else {
            "type": "hnsw", "m": self.m, "ef_construction": self.ef_construction}
        return {"metric": self.metric(),
                "index": {"type": "hnsw", "params": {"m": self.m, "ef_construction": self.ef_construction}},
                "pgvector_index": pgvector}

    def search_param(self) -> dict:
        # Every engine's search parameter is set explicitly (docs/api.md: FAISS's defaults differ from cuVS's).
        params = {"ef_search": self.ef_search} if self.engine == "pgvector" else {"ef": self.ef_search}
        out = {"engine": self.engine, "params": params}
        if self.consistency is not None:
            out["consistency"] = self.consistency
        return out


def case_config_cls(index_type: IndexType | None) -> type[DBCaseConfig] | None:
    """Only HNSW: None for any other index type, as VectorDBBench's own pgvector client answers."""
    return SwitchyardHNSWConfig if index_type in (None, IndexType.HNSW, IndexType.ES_HNSW) else None
