"""The OpenAI-compatible server (`deepinfer serve`): api_server.py (app, limits, uvicorn),
async_llm.py (the engine thread), streams.py (per-request deltas on the event loop),
serving*.py (the routes; serving_worker.py and serving_generate.py: what routers drive a worker
with, docs/routers.md), protocol*.py (request/response models), chat/ (chat formats), metrics.py
(Prometheus), dp_client.py (--data-parallel-size N)."""
