"""Command line: `python -m deepinfer generate --prompt "def fib"` streams a completion;
`deepinfer serve` runs the OpenAI-compatible server (deepinfer/entrypoints)."""

from __future__ import annotations

import argparse
import inspect
import logging
import sys


def _generate(args: argparse.Namespace) -> int:
    from deepinfer import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=1)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seq_seed=args.seq_seed)
    if llm.tokenizer is None:
        print(f"error: {args.model} has no tokenizer.json", file=sys.stderr)
        return 2
    engine = llm.engine
    req = engine.add_request(llm.tokenizer.encode(args.prompt), params, args.prompt)
    if args.echo:
        sys.stdout.write(args.prompt)
    shown = 0
    while not req.is_finished:
        engine.step()
        sys.stdout.write(req.text[shown:])
        sys.stdout.flush()
        shown = len(req.text)
    engine.pop_finished()
    sys.stdout.write("\n")
    return 0


def _engine_flags(parser: argparse.ArgumentParser) -> list[str]:
    """One flag per keyword argument of LLM() (--max-num-seqs, --num-cache-pages, ...), read
    from its signature so the server takes exactly what the offline API takes."""
    from deepinfer.llm import LLM

    group = parser.add_argument_group("engine (the keyword arguments of deepinfer.LLM)")
    names = []
    for name, p in inspect.signature(LLM.__init__).parameters.items():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        kind = float if "float" in str(p.annotation) else int if "int" in str(p.annotation) else str
        group.add_argument(f"--{name.replace('_', '-')}", type=kind, default=p.default,
                           help=f"default: {p.default}")
        names.append(name)
    return names


def _serve(args: argparse.Namespace, engine_names: list[str]) -> int:
    from deepinfer.entrypoints.api_server import serve
    from deepinfer.kv.disagg import DisaggregationConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    disaggregation = DisaggregationConfig(
        args.disaggregation_mode, args.disaggregation_bootstrap_port, args.disaggregation_transfer_backend,
        args.disaggregation_transfer_protocol, args.disaggregation_ib_device, args.disaggregation_transfer_timeout,
        tuple(args.encoder_urls or ()), args.encoder_buffer_mb)
    serve(args.model, host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name,
          chat_format=args.chat_format, max_waiting_requests=args.max_waiting_requests,
          max_body_bytes=args.max_body_bytes, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
          access_log=args.access_log, disaggregation=disaggregation, **{name: getattr(args, name) for name in engine_names})
    return 0


def _disaggregation_flags(parser: argparse.ArgumentParser) -> None:
    """SGLang's encode/prefill/decode flags (docs/disaggregation.md)."""
    from deepinfer.kv.disagg import DEFAULT_BOOTSTRAP_PORT, MODES
    from deepinfer.kv.transfer import BACKENDS, PROTOCOLS

    group = parser.add_argument_group("encode/prefill/decode disaggregation (behind smg --pd-disaggregation)")
    group.add_argument("--disaggregation-mode", default="null", choices=MODES,
                       help="prefill: run prompts and first tokens, ship the decode state; decode: continue from it; "
                            "encode: the model's image encoder alone, for prefill workers' --encoder-urls; "
                            "null: prompts and decoding (default)")
    group.add_argument("--encoder-urls", nargs="+", default=None, metavar="URL",
                       help="encoder workers (--disaggregation-mode encode) that encode this worker's images; "
                            "embeddings come back through the transfer engine")
    group.add_argument("--encoder-buffer-mb", type=int, default=0,
                       help="with --encoder-urls: the registered memory encoders write embeddings into "
                            "(0: two full contexts of embeddings)")
    group.add_argument("--disaggregation-bootstrap-port", type=int, default=DEFAULT_BOOTSTRAP_PORT,
                       help="prefill: the bootstrap server's port (the router's --prefill URL PORT)")
    group.add_argument("--disaggregation-transfer-backend", default="mooncake", choices=BACKENDS)
    group.add_argument("--disaggregation-transfer-protocol", default="tcp", choices=PROTOCOLS,
                       help="the transfer engine's protocol (tcp here; rdma on a cluster)")
    group.add_argument("--disaggregation-ib-device", default="", help="RDMA device(s) for the transfer engine")
    group.add_argument("--disaggregation-transfer-timeout", type=float, default=30.0,
                       help="seconds a side waits for the other before the request fails (decode) or its pages "
                            "are freed (prefill)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion of one prompt to stdout")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--model", default=None, help="model directory (default: the shipped tiny DeepSeek-V4.1)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seq-seed", type=int, default=None)
    gen.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    srv.add_argument("--model", default=None, help="model directory (default: the shipped tiny DeepSeek-V4.1)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    srv.add_argument("--served-model-name", default=None, help="the `model` clients send (default: the directory name)")
    from deepinfer.entrypoints.chat import CHOICES

    srv.add_argument("--chat-format", default="auto", choices=CHOICES,
                     help="auto: the model's Jinja template, else its family's format, else plain")
    srv.add_argument("--max-waiting-requests", type=int, default=1024,
                     help="accepted requests not yet running, beyond which new ones get 503")
    srv.add_argument("--max-body-bytes", type=int, default=32 << 20, help="larger request bodies get 413")
    srv.add_argument("--shutdown-timeout", type=float, default=10.0,
                     help="on SIGTERM, seconds running requests may finish before they are aborted")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    srv.add_argument("--access-log", action="store_true", help="log every HTTP request")
    _disaggregation_flags(srv)
    engine_names = _engine_flags(srv)
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args, engine_names)
        return _generate(args)
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
