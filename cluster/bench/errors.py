"""The error a benchmark stops with: what went wrong, said for the person running it."""


class BenchError(RuntimeError):
    """The benchmark cannot go on (server unreachable, every request failing, no cluster to start).

    The driver saves the results gathered so far, prints this message and exits non-zero.
    ``unreachable``: nothing answered at the server's address (it may still be starting).
    """

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable
