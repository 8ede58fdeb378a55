"""Jobs over several machines through a Ray cluster (RP_RAY_ADDRESS; docs/SCALING.md).

Nothing here imports ray at import time: a daemon without RP_RAY_ADDRESS never loads it.

- `nodes`: the daemon's view of the cluster (its nodes, which job holds them) and the
  submission check of `engine.nodes`;
- `driver`: `python -m rp_service.cluster.driver JOB_DIR`, what the orchestrator starts in
  place of the worker for a multi-node job: a placement group, one rank agent per node,
  rank 0's events on its stdout;
- `agent`: the Ray actor on each node that runs that node's rank as a process;
- `rank`: `python -m rp_service.cluster.rank JOB_DIR`, the rank's entry point (also run
  by torchrun in bench/multinode.sh): the process group, then the worker's loop.
"""
