"""The Controller gRPC API: service, access roles, views."""
