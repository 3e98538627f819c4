"""Warm workers: rank processes parked with torch imported before the launch.

groups.py and lifecycle.py run in the agent (ParkedGroups: the owner of this node's parked groups,
and whether a launch goes warm); leader.py and rank.py are the parked processes; protocol.py is the
wire between them, imported by both sides.
"""
