"""Tensor parallelism: how a model splits across ranks (partition.py), the ranks' process group
(comm.py), the step messages rank 0 sends the others (messages.py), the other ranks' step loop
(follower.py), and the ranks of an offline engine as local processes (local_ranks.py)."""
