"""`kvgate serve`, `kvgate preflight` and `kvgate demo`."""

from __future__ import annotations

import argparse
import sys

from gateway.config import ConfigError, load_config
from gateway.telemetry.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate", description="Tenant-safe gateway for SGLang PD clusters")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run the gateway")
    serve_parser.add_argument("--config", required=True, help="YAML configuration file")
    serve_parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve_parser.add_argument("--workers", type=int, default=1, help="gateway processes on one port (default 1); "
                              "with state.backend redis they act as one")
    preflight = commands.add_parser("preflight", help="check every engine's KV pool against the config, then exit")
    preflight.add_argument("--config", required=True)
    preflight.add_argument("--json", action="store_true", help="machine-readable output")
    canary = commands.add_parser("canary", help="probe tenant isolation through the gateway's own path, then exit")
    canary.add_argument("--config", required=True)
    demo = commands.add_parser("demo", help="start an emulated prefill/decode pair and the gateway in front of it")
    demo.add_argument("--config", default=None, help="gateway YAML (default: config/demo.yaml)")
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", "info")
    configure_logging(level)
    try:
        if args.command == "serve":
            from gateway.commands.supervisor import serve
            config = load_config(args.config)
            configure_logging(level, config.logging)
            if args.workers < 1:
                parser.error("--workers must be at least 1")
            return serve(config, log_level=args.log_level, config_path=args.config, workers=args.workers)
        if args.command == "canary":
            from gateway.commands.canary import run_canary
            return run_canary(load_config(args.config))
        if args.command == "preflight":
            from gateway.commands.preflight import run_preflight
            return run_preflight(load_config(args.config), as_json=args.json)
        from gateway.commands.demo import run_demo
        return run_demo(args.config)
    except ConfigError as exc:
        print(f"kvgate: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
