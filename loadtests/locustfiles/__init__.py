"""Locust files, one per workload. Run by `switchyard loadtest` (or by hand with `locust -f`), never imported by the
service."""
