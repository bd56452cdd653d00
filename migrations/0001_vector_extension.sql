-- pgvector: the vector type, its distance operators and its HNSW / IVFFlat index methods.
CREATE EXTENSION IF NOT EXISTS vector;
