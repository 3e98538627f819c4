"""The preflight checks: each module holds independent, timed units that return CheckResults."""
