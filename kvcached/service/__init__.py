"""The gRPC face of the store: translation only (protobuf <-> store calls, errors -> status codes)."""
