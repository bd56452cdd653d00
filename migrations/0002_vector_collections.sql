-- Vector collections: the catalog, one change sequence, deletion records, and long-running jobs.

-- Every write to any collection takes the next value; writes to one collection are serialised by an
-- advisory lock, so within a collection the order of seq is the order of commits.
CREATE SEQUENCE IF NOT EXISTS vector_change_seq;

CREATE TABLE IF NOT EXISTS vector_collections (
    id          bigserial PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    dim         integer NOT NULL CHECK (dim BETWEEN 1 AND 16000),
    metric      text NOT NULL CHECK (metric IN ('l2', 'cosine', 'inner_product')),
    index_type  text NOT NULL,
    index_params jsonb NOT NULL DEFAULT '{}'::jsonb,
    pgvector_index jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Deleted ids, so that a resident index restored from a snapshot can replay deletes made after it.
CREATE TABLE IF NOT EXISTS vector_tombstones (
    collection_id bigint NOT NULL REFERENCES vector_collections (id) ON DELETE CASCADE,
    id            bigint NOT NULL,
    seq           bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS vector_tombstones_by_seq ON vector_tombstones (collection_id, seq);

CREATE TABLE IF NOT EXISTS jobs (
    id          uuid PRIMARY KEY,
    kind        text NOT NULL,
    subject     text,
    state       text NOT NULL CHECK (state IN ('queued', 'running', 'succeeded', 'failed')),
    done        bigint NOT NULL DEFAULT 0,
    total       bigint,
    message     text,
    result      jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);
