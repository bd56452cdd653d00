"""Switchyard as a VectorDBBench `VectorDB`, through switchyard_client (the client users install): a collection
filled with upserts (base64 float32), built by a build job, searched one raw float32 vector per request."""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from vectordb_bench.backend.clients.api import VectorDB
from vectordb_bench.backend.filter import Filter, FilterOp

from switchyard_client import Client, NotFound

from . import registry  # noqa: F401 - a process that unpickles this client has DB.Switchyard too
from .config import SwitchyardHNSWConfig

log = logging.getLogger(__name__)

# The payload key of VectorDBBench's scalar labels: the label field of its LabelFilter, which is also the field it
# reads labels from when it inserts without a label filter.
LABEL_KEY = "labels"


class Switchyard(VectorDB):
    # Payload equality is Switchyard's only filter: label filters run; integer range filters (NumGE) are refused
    # by VectorDBBench before a case starts.
    supported_filter_types: list[FilterOp] = [FilterOp.NonFilter, FilterOp.StrEqual]
    thread_safe: bool = True  # switchyard_client.Client: one connection per thread

    def __init__(
        self,
        dim: int,
        db_config: dict,
        db_case_config: SwitchyardHNSWConfig,
        collection_name: str = "vdbbench",
        drop_old: bool = False,
        with_scalar_labels: bool = False,
        **kwargs: Any,
    ) -> None:
        self.name = "Switchyard"
        self.dim = dim
        self.db_config = db_config
        self.case_config = db_case_config
        self.collection = collection_name
        self.with_scalar_labels = with_scalar_labels
        self.filter: dict[str, str] | None = None
        self.api: Client | None = None
        self._fallback_seen = False
        if drop_old:
            with self.init():
                self._recreate()

    def _recreate(self) -> None:
        try:
            self.api.delete_collection(self.collection)
        except NotFound:
            pass
        index = self.case_config.index_param()
        self.api.create_collection(self.collection, self.dim, **index)
        log.info(f"Switchyard created collection {self.collection}: dim={self.dim}, {index}")

    @contextmanager
    def init(self) -> Generator[None, None, None]:
        """`db_config`: url (http://host:port or unix:/path), api_key, timeout_s, transport (auto, http, pycurl)."""
        self.api = Client(self.db_config["url"], api_key=self.db_config.get("api_key"),
                          timeout=self.db_config.get("timeout_s", 3600), transport=self.db_config.get("transport",
                                                                                                      "auto"))
        options = self.case_config.search_param()
        self._search = dict(engine=options["engine"], params=options["params"],
                            consistency=options.get("consistency"))
        self.plain = PlainJson(self.db_config, self.collection, self._search) \
            if self.db_config.get("client") == "plain-json" else None
        try:
            yield
        finally:
            self.api.close()
            self.api = None
            if self.plain is not None:
                self.plain.close()

    def insert_embeddings(
        self,
        embeddings: list[list[float]],
        metadata: list[int],
        labels_data: list[str] | None = None,
        **kwargs: Any,
    ) -> tuple[int, Exception | None]:
        try:
            payloads = None if labels_data is None else [{LABEL_KEY: label} for label in labels_data]
            if self.plain is not None:
                self.plain.upsert(metadata, embeddings, payloads)
            else:  # by id: a retried batch stays one copy
                self.api.upsert(self.collection, metadata, embeddings, payloads)
        except Exception as exc:  # noqa: BLE001 - VectorDBBench retries the batch on a returned error
            log.warning(f"Switchyard insert of {len(metadata)} points failed: {exc}")
            return 0, exc
        return len(metadata), None

    def optimize(self, data_size: int | None = None) -> None:
        """The build job: compacts and rebuilds the resident index, which serves every search, then returns; the
        pgvector index Switchyard keeps as its fallback is built after it in the background, by one PostgreSQL
        backend the service gives a lower CPU priority (embedded PostgreSQL), so it takes only what searches
        leave. (pgvector=wait would build both first: a load then took their sum.)"""
        result = self.api.build(self.collection, pgvector="background")
        state = self.api.get_collection(self.collection)
        log.info(f"Switchyard build done: {result}; count={state['count']}, "
                 f"engines={state['engines']}, index_state={state['index_state']}")

    def prepare_filter(self, filters: Filter) -> None:
        if filters.type == FilterOp.NonFilter:
            self.filter = None
        elif filters.type == FilterOp.StrEqual:
            self.filter = {filters.label_field: filters.label_value}
        else:
            raise ValueError(f"Switchyard filters by payload equality only, not {filters.type}")

    def search_embedding(self, query: list[float], k: int = 100, **kwargs: Any) -> list[int]:
        # One vector per request, the form Switchyard answers from its HTTP protocol (or merges with concurrent
        # searches into one engine call), sent by the client as raw float32 with the options in the query string.
        if self.plain is not None:
            return self.plain.search(query, k, self.filter)
        answer = self.api.search(self.collection, query, k, filter=self.filter, **self._search)
        if answer.fallback and not self._fallback_seen:
            self._fallback_seen = True  # once per process: the result then measures pgvector, say so
            log.warning(f"Switchyard answered from {answer.engine}: {answer.fallback}")
        return answer.ids.tolist()


PLAIN_JSON_FLOATS_PER_REQUEST = 1_000_000  # about 20 MB of JSON floats


class PlainJson:
    """Switchyard as the obvious client calls it, for comparison: requests with keep-alive, JSON float lists."""

    def __init__(self, db_config: dict, collection: str, options: dict[str, Any]) -> None:
        import requests

        self.session = requests.Session()
        if db_config.get("api_key"):
            self.session.headers["Authorization"] = f"Bearer {db_config['api_key']}"
        self.url = f"{db_config['url'].rstrip('/')}/v1/collections/{collection}"
        self.options = {name: value for name, value in options.items() if value is not None}

    def upsert(self, ids: list[int], vectors: list[list[float]], payloads: list[dict] | None) -> None:
        # Rows per request as such a client would pick them after its first 413: 5,000 x 768 JSON floats are
        # about 80 MB, past the service's 64 MB body limit (SWITCHYARD_MAX_BODY_BYTES).
        dim = len(vectors[0]) if len(vectors) else 1
        rows = max(1, PLAIN_JSON_FLOATS_PER_REQUEST // dim)
        for start in range(0, len(ids), rows):
            body: dict[str, Any] = {"ids": [int(i) for i in ids[start:start + rows]],
                                    "vectors": [list(map(float, v)) for v in vectors[start:start + rows]]}
            if payloads is not None:
                body["payloads"] = payloads[start:start + rows]
            self.session.put(f"{self.url}/points", json=body).raise_for_status()

    def search(self, query: list[float], k: int, payload_filter: dict | None) -> list[int]:
        body = {"vector": list(map(float, query)), "k": k, **self.options}
        if payload_filter is not None:
            body["filter"] = payload_filter
        answer = self.session.post(f"{self.url}/search", json=body)
        answer.raise_for_status()
        return answer.json()["ids"]

    def close(self) -> None:
        self.session.close()
