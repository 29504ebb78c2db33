"""The `barrel` command."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

import msgspec

from barrel import __version__, config
from barrel.errors import BarrelError, ConfigError
from barrel.store.local import check_gguf_file

EXIT_USAGE = 2


def _parse_model(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="barrel", description="Barrel LLM inference daemon")
    parser.add_argument("--version", action="version", version=f"barrel {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon")
    serve.add_argument("--config", help="path to vm_config.toml (else $BARREL_CONFIG)")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 8080)")
    serve.add_argument("--cache-root", help="model cache directory")
    serve.add_argument(
        "--model",
        action="append",
        default=[],
        type=_parse_model,
        metavar="NAME=PATH",
        help="register a local GGUF file under NAME (repeatable)",
    )
    serve.add_argument("--log-level", help="debug, info, warning or error")

    prune = sub.add_parser("prune", help="remove blobs no model uses and stale partial downloads")
    prune.add_argument("--host", default=None, help="daemon URL (else $BARREL_HOST)")

    sub.add_parser("version", help="print the version")
    return parser


def _daemon_url(host: str | None) -> str:
    url = host or os.environ.get("BARREL_HOST") or "http://127.0.0.1:8080"
    return url if "://" in url else f"http://{url}"


def _prune(args: argparse.Namespace) -> int:
    url = _daemon_url(args.host)
    req = urllib.request.Request(f"{url}/api/prune", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            result = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        print(
            f"barrel: prune failed: HTTP {exc.code} {exc.read().decode(errors='replace')}",
            file=sys.stderr,
        )
        return 1
    except OSError as exc:
        print(
            f"barrel: cannot reach the daemon at {url} ({exc}); start it with `barrel serve`",
            file=sys.stderr,
        )
        return 1
    blobs, partials = len(result.get("removed_blobs", [])), result.get("removed_partials", 0)
    print(f"removed {blobs} unused blobs and {partials} partial downloads")
    return 0


def _apply_flags(cfg: config.Config, args: argparse.Namespace) -> config.Config:
    server = cfg.server
    if args.host is not None:
        server = msgspec.structs.replace(server, host=args.host)
    if args.port is not None:
        server = msgspec.structs.replace(server, port=args.port)
    if args.log_level is not None:
        server = msgspec.structs.replace(server, log_level=args.log_level)
    models = cfg.models
    if args.cache_root is not None:
        models = msgspec.structs.replace(models, cache_root=args.cache_root)
    cfg = msgspec.structs.replace(cfg, server=server, models=models)
    config.validate(cfg, "command line")  # flags go through the same checks as the file
    return cfg


def _serve(args: argparse.Namespace) -> int:
    from barrel import daemon  # the HTTP stack is only imported to serve

    try:
        cfg = _apply_flags(config.load(args.config), args)
        local = {**cfg.models.local, **dict(args.model)}
        for name, path in local.items():
            check_gguf_file(name, path)
    except BarrelError as exc:
        print(f"barrel: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    daemon.setup_logging(cfg.server.log_level)
    return daemon.serve(cfg, local)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "version":
        print(__version__)
        return 0
    if args.command == "serve":
        return _serve(args)
    if args.command == "prune":
        return _prune(args)
    return EXIT_USAGE


def run() -> None:
    sys.exit(main())


__all__ = ["ConfigError", "main"]
