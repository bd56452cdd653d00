"""Switchyard as a VectorDBBench `VectorDB`: a collection over HTTP, filled with JSON upserts, built by a build job,
searched one vector per request."""

from __future__ import annotations

import base64
import logging
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlencode

import numpy as np
import orjson
from vectordb_bench.backend.clients.api import VectorDB
from vectordb_bench.backend.filter import Filter, FilterOp

from . import registry  # noqa: F401 - a process that unpickles this client has DB.Switchyard too
from .config import SwitchyardHNSWConfig
from .rest import HttpError, Rest

log = logging.getLogger(__name__)

# The payload key of VectorDBBench's scalar labels: the label field of its LabelFilter, which is also the field it
# reads labels from when it inserts without a label filter.
LABEL_KEY = "labels"


class Switchyard(VectorDB):
    # Payload equality is Switchyard's only filter: label filters run; integer range filters (NumGE) are refused
    # by VectorDBBench before a case starts.
    supported_filter_types: list[FilterOp] = [FilterOp.NonFilter, FilterOp.StrEqual]
    thread_safe: bool = True  # rest.Rest keeps one connection per thread

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
        self.path = f"/v1/collections/{collection_name}"
        self.with_scalar_labels = with_scalar_labels
        self.filter: dict[str, str] | None = None
        self.filter_json: str | None = None
        self._options: dict[tuple[int, str | None], str] = {}
        self.api: Rest | None = None
        self._fallback_seen = False
        if drop_old:
            with self.init():
                self._recreate()

    def _recreate(self) -> None:
        try:
            self.api.call("DELETE", self.path)
        except HttpError as exc:
            if exc.status != 404:
                raise
        index = self.case_config.index_param()
        self.api.call("POST", "/v1/collections", {"name": self.collection, "dim": self.dim, **index})
        log.info(f"Switchyard created collection {self.collection}: dim={self.dim}, {index}")

    @contextmanager
    def init(self) -> Generator[None, None, None]:
        self.api = Rest(self.db_config["url"], self.db_config.get("api_key"), self.db_config.get("timeout_s", 3600))
        self._raw_headers = self.api.raw_headers
        try:
            yield
        finally:
            self.api.close()
            self.api = None

    def _raw_options(self, k: int) -> str:
        """The query string of a raw search: every option, the filter as JSON text; the same for every search of
        a case, so made once."""
        cached = self._options.get((k, self.filter_json))
        if cached is None:
            options = self.case_config.search_param()
            query = {"k": k, "engine": options["engine"], **options["params"]}
            if "consistency" in options:
                query["consistency"] = options["consistency"]
            if self.filter_json is not None:
                query["filter"] = self.filter_json
            cached = self._options[(k, self.filter_json)] = urlencode(query)
        return cached

    def insert_embeddings(
        self,
        embeddings: list[list[float]],
        metadata: list[int],
        labels_data: list[str] | None = None,
        **kwargs: Any,
    ) -> tuple[int, Exception | None]:
        try:
            vectors = np.asarray(embeddings, dtype="<f4")
            body: dict[str, Any] = {"ids": [int(i) for i in metadata],
                                    "vectors_b64": base64.b64encode(vectors.tobytes()).decode("ascii")}
            if labels_data is not None:
                body["payloads"] = [{LABEL_KEY: label} for label in labels_data]
            self.api.call("PUT", f"{self.path}/points", body)  # an upsert: a retried batch stays one copy
        except Exception as exc:  # noqa: BLE001 - VectorDBBench retries the batch on a returned error
            log.warning(f"Switchyard insert of {len(metadata)} points failed: {exc}")
            return 0, exc
        return len(metadata), None

    def optimize(self, data_size: int | None = None) -> None:
        """The build job: compacts and rebuilds the resident index, creates the pgvector index if missing."""
        job = self.api.call("POST", f"{self.path}/build")
        done = self.api.wait_job(job["job"])
        state = self.api.call("GET", self.path)
        log.info(f"Switchyard build done: {done.get('result')}; count={state['count']}, "
                 f"engines={state['engines']}, index_state={state['index_state']}")

    def prepare_filter(self, filters: Filter) -> None:
        if filters.type == FilterOp.NonFilter:
            self.filter = None
        elif filters.type == FilterOp.StrEqual:
            self.filter = {filters.label_field: filters.label_value}
        else:
            raise ValueError(f"Switchyard filters by payload equality only, not {filters.type}")
        self.filter_json = None if self.filter is None else orjson.dumps(self.filter).decode()

    def search_embedding(self, query: list[float], k: int = 100, **kwargs: Any) -> list[int]:
        # The single-vector form: the one Switchyard answers from its HTTP protocol (or merges with concurrent
        # searches into one engine call). Sent as raw float32 with the options in the query string, a label filter
        # as JSON text among them (nothing to encode or parse: Switchyard's fastest client, as psycopg's binary
        # protocol is pgvector's).
        vector = np.asarray(query, dtype="<f4").tobytes()
        answer = self.api.send("POST", f"{self.path}/search?{self._raw_options(k)}", vector, self._raw_headers)
        if answer.get("fallback") and not self._fallback_seen:
            self._fallback_seen = True  # once per process: the result then measures pgvector, say so
            log.warning(f"Switchyard answered from {answer['engine']}: {answer['fallback']}")
        return answer["ids"]
