"""What makes an engine a worker: the host (a named async API over the engine thread), the parts
every worker is built from (host, heartbeat, runtime, gRPC control server), the checks of an
assignment, KV events on the bus, and the wire (protobuf <-> engine types)."""
