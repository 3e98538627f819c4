"""Generated protobuf and gRPC stubs for the runwarden.v1 API (see proto/runwarden/v1/).

Do not edit the *_pb2*.py files: run `python scripts/gen_proto.py`.
"""
