"""`tokenmill bench`: load generator, offline throughput and latency, and the peer comparison.

Each sub-command lives in its own module and registers itself with ``add_<name>_parser``
(`tokenmill.cli.BENCH_SUITES` lists them); heavy imports (httpx, torch, matplotlib) happen
inside the commands, so building the parser stays cheap for every other `tokenmill` command.
"""
