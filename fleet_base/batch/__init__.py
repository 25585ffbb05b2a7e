"""Batch and async inference: the OpenAI Files/Batches shapes, the async request record,
the work item the gateways' workers pull, and the store they all live in (NATS JetStream
by default, so the control plane is never on the execution path). docs/batch.md."""
