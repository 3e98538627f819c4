"""The node agent and what runs beside it on a host; each folder is one process.

daemon/: the agent daemon (one per host: gRPC server, launcher, monitors, preflight bridge); never
loads torch. trainer/: imported by the training script in every rank (progress, stop requests,
checkpoints, flight recording). warm/: the warm path: its leader and rank programs are the parked
processes (`python -m nodeagent.warm.leader`, whose ranks it forks), the rest is the agent's owner of them and
the wire between the two. wire.py: the names and paths the agent and the ranks share.
tests/nodeagent/test_layout.py checks these boundaries.
"""
