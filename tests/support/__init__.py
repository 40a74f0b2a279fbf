"""Helpers shared by the test tiers (tests/unit, tests/integration, tests/slow): tiny models
built from configs, float64 references, snapshots of a store, a local S3 server.

`tests/` is on the path (pyproject's `pythonpath`), so tests import `support.<module>`.
"""
