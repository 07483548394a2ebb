"""The OpenAI-compatible server (`deepinfer serve`): api_server.py (app, limits, uvicorn),
async_llm.py (the engine thread), streams.py (per-request deltas on the event loop),
serving*.py (the routes), protocol.py (request/response models), chat/ (chat formats),
metrics.py (Prometheus)."""
