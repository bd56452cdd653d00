-- The change log's commits: one row per write transaction of a collection, written in the transaction that
-- takes the seqs (under the collection's advisory lock), so a collection's commits are ordered by seq and
-- chained by prev_seq. Resident indexes in every process follow it (LISTEN switchyard_vectors, and a poll).
-- token: a snapshot names the commit it covers; a database restored to before that commit does not have it.
CREATE TABLE IF NOT EXISTS vector_commits (
    collection_id bigint NOT NULL REFERENCES vector_collections (id) ON DELETE CASCADE,
    seq           bigint NOT NULL,
    prev_seq      bigint NOT NULL,
    token         uuid NOT NULL DEFAULT gen_random_uuid(),
    committed_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    upserts       integer NOT NULL DEFAULT 0,
    deletes       integer NOT NULL DEFAULT 0,
    PRIMARY KEY (collection_id, seq)
);

-- Collections written before this migration: one commit at their latest seq starts their log.
DO $$
DECLARE
    c record;
    head bigint;
BEGIN
    FOR c IN SELECT id FROM vector_collections LOOP
        EXECUTE format('SELECT greatest((SELECT coalesce(max(seq), 0) FROM %I), '
                       '(SELECT coalesce(max(seq), 0) FROM vector_tombstones WHERE collection_id = $1))',
                       'vectors_' || c.id) INTO head USING c.id;
        IF head > 0 THEN
            INSERT INTO vector_commits (collection_id, seq, prev_seq) VALUES (c.id, head, 0) ON CONFLICT DO NOTHING;
        END IF;
    END LOOP;
END
$$;

-- What each Switchyard process says of its replica of a collection, when asked (GET /v1/collections/{c}):
-- scratch data, rewritten on every request, so not WAL-logged.
CREATE UNLOGGED TABLE IF NOT EXISTS vector_replica_reports (
    process       text NOT NULL,
    collection_id bigint NOT NULL,
    request       text NOT NULL,
    report        jsonb NOT NULL,
    reported_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (process, collection_id)
);
