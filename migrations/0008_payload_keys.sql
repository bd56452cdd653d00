-- The top-level payload keys each collection has stored: writes that would take a collection past
-- SWITCHYARD_MAX_PAYLOAD_KEYS are refused (indexes/store.py), since every key is a column of the resident payload
-- index. Keys are added under the collection's write lock and kept until the collection is dropped.
CREATE TABLE IF NOT EXISTS vector_payload_keys (
    collection_id bigint NOT NULL REFERENCES vector_collections (id) ON DELETE CASCADE,
    key           text NOT NULL,
    PRIMARY KEY (collection_id, key)
);

-- Collections written before this migration: the keys their stored payloads have.
DO $$
DECLARE
    c record;
BEGIN
    FOR c IN SELECT id FROM vector_collections LOOP
        IF to_regclass(format('vectors_%s', c.id)) IS NOT NULL THEN
            EXECUTE format('INSERT INTO vector_payload_keys (collection_id, key) '
                           'SELECT DISTINCT %s, jsonb_object_keys(payload) FROM %I '
                           'WHERE jsonb_typeof(payload) = ''object'' ON CONFLICT DO NOTHING',
                           c.id, format('vectors_%s', c.id));
        END IF;
    END LOOP;
END
$$;
