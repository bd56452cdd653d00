"""Load tests and benchmarks: the Locust harness (switchyard loadtest), side-by-side benchmark drivers, reports."""
