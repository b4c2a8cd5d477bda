"""CLI: `python -m radixserve serve|generate|bench ...`."""

from __future__ import annotations

import argparse
import math
import sys

from radixserve.args import ServerArgs


def _generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="radixserve generate", description="Chat with the model once and print its reply."
    )
    parser.add_argument("prompt", help="The user message.")
    parser.add_argument("--system", default=None, help="Optional system message.")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--raw", action="store_true", help="Do not apply the chat template.")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    from radixserve.entrypoints.engine import Engine
    from radixserve.managers.request_checks import RequestError
    from radixserve.utils import configure_logging

    if ns.max_new_tokens < 0:
        parser.error(f"--max-new-tokens must be >= 0, got {ns.max_new_tokens}")
    if not (math.isfinite(ns.temperature) and ns.temperature >= 0):
        parser.error(f"--temperature must be a finite number >= 0, got {ns.temperature}")
    if ns.raw and ns.system is not None:
        parser.error("--system needs the chat template; drop --raw")
    server_args = _server_args(parser, ns)
    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature}
    template = None
    if server_args.chat_template is not None:
        from radixserve.entrypoints.chat_templates import chat_template_source

        template = chat_template_source(server_args.chat_template)
    configure_logging(server_args.log_level)
    try:
        engine = Engine(server_args)
    except RuntimeError as e:  # (the child logged what failed: one line here, no traceback)
        print(f"radixserve generate: error: {e}", file=sys.stderr)
        return 1
    with engine:
        try:
            if ns.raw:
                out = engine.generate(ns.prompt, params)
            else:
                messages = [{"role": "user", "content": ns.prompt}]
                if ns.system:
                    messages.insert(0, {"role": "system", "content": ns.system})
                kwargs = {} if template is None else {"chat_template": template}
                ids = engine.tokenizer_manager.apply_chat_template(messages, **kwargs)
                out = engine.generate(input_ids=ids, sampling_params=params)
        except RequestError as e:  # a prompt past the context, a model without a template
            print(f"radixserve generate: error: {e}", file=sys.stderr)
            return 2
        print(out["text"].strip())
    return 0


def _serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="radixserve serve", description="Start the HTTP server.")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    from radixserve.entrypoints.http_server import launch_server

    return launch_server(_server_args(parser, ns))


def _server_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> ServerArgs:
    """The flags as ServerArgs; a bad value (or a model path that holds no model) ends the
    command as argparse does, with its usage, one line and exit status 2."""
    from radixserve.model_loader.loader import check_model_files

    try:
        server_args = ServerArgs.from_cli_args(ns)
        check_model_files(server_args)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    return server_args


BENCH_KINDS = (
    "serving",
    "one-batch",
    "offline",
    "hf-baseline",
    "soak",
    "overhead",
    "perplexity",
    "multiturn",
)


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCH_KINDS:
        kinds = ",".join(BENCH_KINDS)
        print(f"usage: python -m radixserve bench {{{kinds}}} ...", file=sys.stderr)
        return 2
    kind, rest = argv[0], argv[1:]
    if kind == "serving":
        from radixserve.bench.serving import main
    elif kind == "one-batch":
        from radixserve.bench.one_batch import main
    elif kind == "offline":
        from radixserve.bench.offline import main
    elif kind == "soak":
        from radixserve.bench.soak import main
    elif kind == "overhead":
        from radixserve.bench.overhead import main
    elif kind == "perplexity":
        from radixserve.bench.perplexity import main
    elif kind == "multiturn":  # the hierarchical cache's benchmark
        from radixserve.bench.multiturn import main
    else:
        from radixserve.bench.hf_baseline import main
    import httpx

    try:
        main(rest)
    except (ValueError, FileNotFoundError) as e:  # a bad value, a path that holds no model
        print(f"radixserve bench {kind}: error: {e}", file=sys.stderr)
        return 2
    except (httpx.HTTPError, ConnectionError) as e:  # a server that is not there
        print(f"radixserve bench {kind}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a dataset or text file that is a directory, or cannot be read
        print(f"radixserve bench {kind}: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from radixserve.utils import open_missing_std_fds

    open_missing_std_fds()
    commands = {"serve": _serve, "generate": _generate, "bench": _bench}
    if not argv or argv[0] not in commands:
        print("usage: python -m radixserve {serve,generate,bench} [options]", file=sys.stderr)
        return 2
    try:
        return commands[argv[0]](argv[1:]) or 0
    except KeyboardInterrupt:  # Ctrl-C: the children are already stopped (Engine, launch_server)
        return 130


if __name__ == "__main__":
    sys.exit(main())
