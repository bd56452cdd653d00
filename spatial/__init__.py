"""Geometry layers and joins (numba-cuda kernels, a CPU path, PostGIS). Knows no HTTP."""
