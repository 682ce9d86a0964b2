"""The gateway: OpenAI-compatible REST and gRPC tenant APIs in front of the workers."""
