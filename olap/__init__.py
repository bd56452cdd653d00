"""Star Schema Benchmark data, tables and queries (cuDF, DuckDB, PostgreSQL). Knows no HTTP."""
