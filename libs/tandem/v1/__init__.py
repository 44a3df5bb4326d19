"""Generated protobuf and gRPC code for protos/tandem/v1 (`make protos`); do not edit."""
