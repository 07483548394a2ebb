"""The HTTP app of an encoder worker (`deepinfer serve --disaggregation-mode encode`): /encode and
/encoder_info for prefill workers (kv/encode_protocol.py), /health, /liveness, /server_info and
/metrics for operators; every other route answers 404 naming what this worker is."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from deepinfer import __version__
from deepinfer.kv.encode_worker import EncodeRefused, EncodeWorker


def build_encode_app(worker: EncodeWorker, metrics, model_dir: str, name: str, guard) -> object:
    """`guard(app)`: the server's middleware (request ids, API key, body size limit)."""
    app = FastAPI(title="deepinfer encoder")

    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse({"error": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/liveness")
    async def liveness():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return {"model_path": model_dir, "served_model_name": name, "version": __version__, "engine": "deepinfer",
                "disaggregation_mode": "encode", "disaggregation": worker.stats()}

    @app.get("/encoder_info")
    async def route():
        return worker.route()

    @app.post("/encode")
    async def encode(request: Request):
        if not worker.alive:  # draining: the prefill tries another encoder
            return JSONResponse({"error": "this encoder is draining"}, status_code=503)
        body = await request.body()
        try:  # the encoder pass and the write run on a thread: the loop keeps answering
            return await asyncio.to_thread(worker.run, body)
        except EncodeRefused as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def elsewhere(path: str):
        return JSONResponse({"error": {
            "message": f"/{path}: this is an encoder worker (--disaggregation-mode encode); it serves /encode to "
                       "prefill workers started with --encoder-urls. Send generation requests to the router or a "
                       "prefill worker.", "type": "invalid_request_error", "param": None, "code": "not_found"}},
            status_code=404)

    return guard(app)
