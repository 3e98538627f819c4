"""The controller daemon: etcd in, actions out, around the supervisor core."""
