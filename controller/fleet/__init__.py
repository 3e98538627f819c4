"""What the runs sharing one fleet (one etcd root) agree on through the store: which run holds each node (claims)."""
