"""The decode worker: one engine, its NATS subscriptions, its gRPC control server."""
