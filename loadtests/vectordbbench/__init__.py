"""A VectorDBBench 2.0 client for Switchyard, and a command that runs VectorDBBench's custom-dataset performance
case against Switchyard and VectorDBBench's own pgvector client in one run (see README.md here).

VectorDBBench's DB enum has no plugin mechanism: importing `.registry` adds DB.Switchyard. This package does it
at import when VectorDBBench is already loaded; it does not load VectorDBBench itself, because that import sets
VectorDBBench's log and result folders for good (from the environment the command prepares first) and because
the data set and summary modules must work without it.
"""

import sys

if "vectordb_bench" in sys.modules:
    from . import registry  # noqa: F401
