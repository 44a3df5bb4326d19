"""Local processes for `tandem up` and the tests: embedded nats-server and redis-server, the
Cassandra launcher, the stack itself."""
