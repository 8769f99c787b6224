"""Serving: service.py (the engine service over HTTP, one run at a time, probes kept per run) and
parallel.py (one process per GPU: tensor- and expert-parallel ranks). Import from the files."""
