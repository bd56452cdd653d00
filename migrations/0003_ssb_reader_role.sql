-- Ad-hoc SSB queries on the PostgreSQL engine run as this role: it can only read the ssb schema's tables,
-- and, not being a superuser, cannot read server files (pg_read_file, COPY ... FROM a file, lo_import).
-- Creating a role needs CREATEROLE; without it the engine still runs ad-hoc SQL read-only behind the guard.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'switchyard_reader') THEN
        CREATE ROLE switchyard_reader NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT;
    END IF;
EXCEPTION
    WHEN duplicate_object THEN NULL;  -- another database of the same server made it first
    WHEN insufficient_privilege THEN RAISE NOTICE 'no CREATEROLE: ad-hoc SQL will not switch role';
END
$$;

CREATE SCHEMA IF NOT EXISTS ssb;

CREATE TABLE IF NOT EXISTS ssb_datasets (
    dataset    text PRIMARY KEY,
    rows       jsonb NOT NULL,
    loaded_at  timestamptz NOT NULL DEFAULT now()
);
