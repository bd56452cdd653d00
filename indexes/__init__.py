"""Vector collections and their ANN engines (cuVS on GPU, FAISS on CPU, pgvector in Postgres). Knows no HTTP."""
