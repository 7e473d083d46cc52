"""Weight resharding from a training layout to a generation layout.

``layout`` (dp x tp x pp and tp x replicas), ``params`` (parameter specs, shards, vLLM's fused
names), ``plan`` (the pure planner), ``executor`` (bucketed broadcasts on process groups),
``spec`` (the typed weight-sync spec every side derives its plan and executor from),
``backend`` (NCCL or gloo, from the physical devices of a group's ranks) and
``check`` (``python -m system.reshard check``: a bit-exact check anyone can run).
"""
