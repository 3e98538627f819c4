"""Warm workers: the agent's parked groups (pool.py, in the agent) and the parked processes (parked.py)."""
