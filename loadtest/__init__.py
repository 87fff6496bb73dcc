"""Load generators and benchmarks for inferplane (never part of the unit test run).

Entry points: `python -m loadtest --help`, the typer app `loadtest.cli:app`, and the
functions in `loadtest.runner` (run, run_async, prepare_pool), `loadtest.compare`,
`loadtest.sweep` and `loadtest.perf_analyzer`.
"""
