"""Harnesses for tests, benchmarks and examples; nothing in the shipped daemons imports this package.

``etcd_server``: a private single-member etcd on loopback (``EtcdServer``).
``wait``: a test's wait for an event, with a deadline and a clear failure (``wait_until``).
"""
