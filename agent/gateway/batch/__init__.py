"""The gateway's batch and async inference: the Files and Batches API, the batch lifecycle
driver, the workers and the webhook loop (docs/batch.md), held by `service.BatchService`."""
