"""``python -m engine.tp.rank_main``: one local tensor-parallel rank r > 0 of the offline API
(engine/tp/local_ranks.py writes its pickled arguments to stdin). Exits 1 when it fails."""

from __future__ import annotations

import logging
import pickle
import sys


def main() -> int:
    from engine.tp.follower import RankZeroGone, TPFollower

    config, rank, size, port, device = pickle.loads(sys.stdin.buffer.read())
    try:
        TPFollower(config, rank, size, port, device).run()
    except RankZeroGone as e:  # (one line: rank 0's own exit, or its error, says why)
        logging.getLogger(__name__).warning("tensor-parallel rank %d stopped: %s", rank, e)
        return 1
    except BaseException:
        logging.getLogger(__name__).exception("tensor-parallel rank %d failed", rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
