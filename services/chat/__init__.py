"""The chat service: the public HTTP API and the conversation store."""
