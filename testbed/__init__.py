"""Harnesses for tests, benchmarks and examples; nothing in the shipped daemons imports this package.

``etcd_server``: a private single-member etcd on loopback (``EtcdServer``).
"""
