"""The node agent daemon: one process per host, supervised by systemd (or Slurm, or a pod)."""
