"""The supervisor core: sans-IO, deterministic; no I/O, clock or threads (tests/supervisor/test_contract.py)."""
