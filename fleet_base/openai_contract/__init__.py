"""The OpenAI API contract Fleet serves, written once for the engine server and the gateway.

Request models (with their limits), the response_format / tools / embeddings / Responses
request shapes, and the error shape. Torch-free and FastAPI-free: the gateway imports it to
refuse a bad request with exactly the answer a replica would give, so the two cannot drift.
"""
