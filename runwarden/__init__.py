"""runwarden's shared core: the API stubs, the etcd key schema and store, event types, config.

Everything here is importable without torch and without a GPU. Only `runwarden.store` imports the
etcd client; the rest of the code sees the store's own interface.
"""

__version__ = "0.1.0"
