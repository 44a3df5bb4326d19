"""What makes an engine a worker: the host (a named async API over the engine thread), the
heartbeat, the gRPC control server, KV events on the bus, and the wire (protobuf <-> engine types)."""
