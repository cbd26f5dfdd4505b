"""The error a benchmark stops with: what went wrong, said for the person running it."""


class BenchError(RuntimeError):
    """The benchmark cannot go on (server unreachable, every request failing, no cluster to start).

    The driver saves the results gathered so far, prints this message and exits non-zero.
    """
