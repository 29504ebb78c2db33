"""The `barrel` command."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

import msgspec

from barrel import __version__, config, heap
from barrel.errors import BarrelError, ConfigError, InvalidRequest
from barrel.stacks import dump_stacks_on
from barrel.store.local import check_gguf_file

EXIT_USAGE = 2


def _parse_model(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


class _Projector(argparse.Action):
    """--mmproj PATH belongs to the --model given last; NAME=PATH names its model."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        text = str(values)
        name, sep, path = text.partition("=")
        if not sep:
            models = getattr(namespace, "model", None) or []
            if not models:
                parser.error("--mmproj PATH must follow the --model it belongs to")
            name, path = models[-1][0], text
        projectors = dict(getattr(namespace, self.dest, None) or {})
        projectors[name] = path
        setattr(namespace, self.dest, projectors)


def _with_host(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--host", default=None, help="daemon address (else $BARREL_HOST)")
    return parser


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
    serve.add_argument(
        "--mmproj",
        action=_Projector,
        default={},
        metavar="[NAME=]PATH",
        help="a multimodal (image or audio) projector GGUF for the --model before it (or for NAME)",
    )
    serve.add_argument("--log-level", help="debug, info, warning or error")

    def command(name: str, text: str, *aliases: str) -> argparse.ArgumentParser:
        return _with_host(sub.add_parser(name, help=text, aliases=list(aliases)))

    pull = command("pull", "download a model from a registry, Hugging Face or a URL")
    pull.add_argument("model")
    pull.add_argument("--insecure", action="store_true", help="allow plain-http registries")
    command("list", "list the models", "ls")
    command("ps", "list the loaded models")
    show = command("show", "show a model's details")
    show.add_argument("model")
    for flag in ("modelfile", "parameters", "template", "system", "license"):
        show.add_argument(f"--{flag}", action="store_true", help=f"print only its {flag}")
    rm = command("rm", "remove models")
    rm.add_argument("models", nargs="+")
    cp = command("cp", "copy a model under a new name")
    cp.add_argument("source")
    cp.add_argument("destination")
    create = command("create", "create a model from a Modelfile")
    create.add_argument("model")
    create.add_argument("-f", "--file", default="Modelfile", help="the Modelfile")
    edit = command("edit", "set a model's parameters")
    edit.add_argument("model")
    edit.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="a parameter"
    )
    search = command("search", "search the local store and the registries")
    search.add_argument("query")
    run = command("run", "chat with a model (interactive without PROMPT)")
    run.add_argument("model")
    run.add_argument("prompt", nargs="*")
    run.add_argument("--verbose", action="store_true", help="timings and rates after answers")
    embed = command("embed", "print embeddings, one JSON array per input")
    embed.add_argument("model")
    embed.add_argument("inputs", nargs="+")
    stop = command("stop", "unload a model now", "unload")
    stop.add_argument("model")
    command("prune", "remove blobs no model uses and stale partial downloads")
    top = command("top", "live status of the daemon")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    command("version", "print the versions of this client and the daemon")
    return parser


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
    if getattr(args, "mmproj", None):
        models = msgspec.structs.replace(models, projectors={**models.projectors, **args.mmproj})
    cfg = msgspec.structs.replace(cfg, server=server, models=models)
    config.validate(cfg, "command line")  # flags go through the same checks as the file
    return cfg


def _serve(args: argparse.Namespace) -> int:
    dump_stacks_on(signal.SIGUSR1)  # before any import below starts a thread
    heap.tune()  # likewise (barrel.heap)
    from barrel import daemon  # the HTTP stack is only imported to serve
    from barrel.notify import setup_logging

    try:
        cfg = _apply_flags(config.load(args.config), args)
        local = {**cfg.models.local, **dict(args.model)}
        for name, path in local.items():
            check_gguf_file(name, path)
        for name, path in cfg.models.projectors.items():
            if name not in local:
                raise InvalidRequest(f"--mmproj {name}: no --model {name} to add it to")
            check_gguf_file(name, path)
    except BarrelError as exc:
        print(f"barrel: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(cfg.server.log_level)
    return daemon.serve(cfg, local)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    from barrel.cli.commands import dispatch  # the client side only

    return dispatch(args)


def run() -> None:
    sys.exit(main())


__all__ = ["ConfigError", "main"]
