"""What makes an engine a worker: the host (a named async API over the engine, which steps on a
thread or in a process of its own), what the engine is built from (engine_spec, importable by the
engine process without anything NATS-facing), the typed worker<->engine-process wire, the parts
every worker is built from (host, heartbeat, runtime, gRPC control server), the checks of an
assignment, KV events on the bus, and the wire (protobuf <-> engine types)."""
