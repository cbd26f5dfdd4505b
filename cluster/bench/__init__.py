"""`duet bench`: the benchmark driver (workloads, arrivals, streaming client, metrics, goodput, report).

Entry points for the CLI: ``cluster.bench.cli.add_bench_arguments`` and ``cluster.bench.cli.run_bench``.
"""
