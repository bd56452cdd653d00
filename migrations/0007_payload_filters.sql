-- Payload filters (indexes/filters.py) compare ISO-8601 date strings as instants. This reads a jsonb value as
-- epoch seconds, or NULL when it is not such a date: the same strings, and the same instants, as the resident
-- payload index (filters.instant). No offset means UTC; an impossible date (2023-02-30) is NULL, not an error.
CREATE OR REPLACE FUNCTION switchyard_instant(v jsonb) RETURNS double precision
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    t text;
BEGIN
    IF v IS NULL OR jsonb_typeof(v) <> 'string' THEN
        RETURN NULL;
    END IF;
    t := v #>> '{}';
    IF t !~ '^[1-9][0-9]{3}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])([T ]([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9](\.[0-9]{1,6})?)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])?)?$' THEN
        RETURN NULL;
    END IF;
    IF t ~ '(Z|[+-][0-9]{2}:[0-9]{2})$' THEN
        RETURN extract(epoch FROM t::timestamptz)::float8;
    END IF;
    RETURN extract(epoch FROM (t::timestamp AT TIME ZONE 'UTC'))::float8;
EXCEPTION WHEN others THEN
    RETURN NULL;
END
$$;
