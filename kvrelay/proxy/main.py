"""`kvrelay proxy`: flags, logging, and the uvicorn server around `build_app`.

    kvrelay proxy --host 0.0.0.0 --port 8000 \\
        --prefiller-host PREFILL_HOST --prefiller-port 8100 8101 8102 \\
        --decoder-host DECODE_HOST --decoder-port 8200

`main(argv)` returns the exit status: 0 after SIGINT/SIGTERM, 2 for bad flags, 1 when
the server cannot start (a taken port: one line, before anything else starts).

`--api-key KEY` (or $KVRELAY_API_KEY / $VLLM_API_KEY): clients must send
`Authorization: Bearer KEY`; the backends then get $OPENAI_API_KEY if set (see app.py).

`--kv-events-port 5557 [--kv-events-replay-port 5558]`: cache_aware routing follows each
prefill server's KV events (its `--kv-events-config`) at tcp://PREFILL_HOST:PORT
(proxy/kv_events.py); ports pair with the prefill servers as --prefiller-port does with
hosts: one for all, or one per server.

`--backends-file PATH` instead of the --prefiller-*/--decoder-* flags: the servers a
supervisor lists in a JSON file, followed as it changes (proxy/backend_set.py; each
prefill's KV-event ports are in the file too).
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import NoReturn

import uvicorn

from kvrelay import envs
from kvrelay.cli_flags import HelpFormatter
from kvrelay.malloc import one_arena, return_large_buffers_to_the_os
from kvrelay.proxy import policy
from kvrelay.proxy.backend_set import BackendsFile, BackendsFileError
from kvrelay.proxy.kv_events_feed import EventSource, KVEventsRouting, tcp_endpoint
from kvrelay.proxy.policy import DisaggPolicy, RoutingSettings
from kvrelay.proxy.routing import EndpointError, expand_endpoints

logger = logging.getLogger("kvrelay.proxy")
PROG = "kvrelay proxy"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PREFILL_PORT = 8100
DEFAULT_DECODE_PORT = 8200
ENDPOINT_FLAGS = ("prefiller_host", "prefiller_port", "decoder_host", "decoder_port")
GRACEFUL_SHUTDOWN_S = 10
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class ProxySettings:
    host: str
    port: int
    prefill: list[tuple[str, int]]
    decode: list[tuple[str, int]]
    log_level: str = "info"
    api_key: str | None = None
    health_interval_s: float = 2.0
    busy_retry_s: float = 10.0
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    forwarded_allow_ips: str | None = None      # None: X-Forwarded-For / -Proto not trusted
    backends_file: BackendsFile | None = None   # then `prefill` and `decode` are empty


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors naming the flag (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_proxy_flags(p: argparse.ArgumentParser) -> None:
    """The proxy's flags (vLLM toy_proxy_server.py's names; the plural spellings too)."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    # Unset (None) means the default: a given flag conflicts with --backends-file.
    p.add_argument("--prefiller-host", "--prefiller-hosts", dest="prefiller_host", nargs="+",
                   default=None, metavar="HOST",
                   help=f"prefill server host(s) (default: {DEFAULT_HOST})")
    p.add_argument("--prefiller-port", "--prefiller-ports", dest="prefiller_port", nargs="+",
                   type=int, default=None, metavar="PORT",
                   help=f"prefill server port(s) (default: {DEFAULT_PREFILL_PORT})")
    p.add_argument("--decoder-host", "--decoder-hosts", dest="decoder_host", nargs="+",
                   default=None, metavar="HOST",
                   help=f"decode server host(s) (default: {DEFAULT_HOST})")
    p.add_argument("--decoder-port", "--decoder-ports", dest="decoder_port", nargs="+", type=int,
                   default=None, metavar="PORT",
                   help=f"decode server port(s) (default: {DEFAULT_DECODE_PORT})")
    p.add_argument("--backends-file", default=None, metavar="PATH",
                   help='instead of the --prefiller-*/--decoder-* flags: a JSON file {"prefill": '
                        '[{"id": ..., "url": "http://HOST:PORT", "kv_events_port": ...}], '
                        '"decode": [...]}, re-read when it changes (replace it atomically); '
                        "added servers are used once their /health answers 200, removed ones "
                        "finish their requests (docs/proxy.md#backends-that-change)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="debug logs one line per request leg")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"clients must send 'Authorization: Bearer KEY' (default: "
                        f"${envs.PROXY_API_KEY.name} or ${envs.PROXY_API_KEY.alias}; none: no "
                        f"check). $OPENAI_API_KEY, the key for the backends, is only sent for "
                        f"clients authenticated this way")
    p.add_argument("--health-interval", type=float, default=2.0, metavar="S",
                   help="seconds between /health probes of every backend (0: no background probe); "
                        "servers that fail them are tried last")
    p.add_argument("--prefill-busy-retry", type=float, default=10.0, metavar="S",
                   help="a prefill server that answers 503 with Retry-After (busy: its KV hold "
                        "for the decode was refused) is retried on the next server, then in "
                        "rounds with backoff, for at most S seconds per request (0: not retried)")
    p.add_argument("--forwarded-allow-ips", default=None, metavar="IPS",
                   help="comma-separated addresses (or '*') of proxies in front whose "
                        "X-Forwarded-For/-Proto are trusted (default: none, not even 127.0.0.1)")
    r = p.add_argument_group("routing (docs/proxy.md#choosing-servers)")
    r.add_argument("--routing", choices=policy.ROUTING_POLICIES, default="cache_aware",
                   help="cache_aware: the server holding the longest prefix of the prompt, unless "
                        "busier than the least-loaded by more than --routing-load-margin; "
                        "least_loaded; round_robin (prefill; decode stays least-loaded)")
    r.add_argument("--routing-load-margin", type=float, default=policy.DEFAULT_LOAD_MARGIN,
                   metavar="N", help="requests by which a cache hit's server may exceed the "
                                     "least-loaded one before the least-loaded wins")
    r.add_argument("--routing-block-size", type=int, default=policy.DEFAULT_BLOCK_SIZE,
                   metavar="TOKENS", help="prefix-table block: the servers' --block-size")
    r.add_argument("--routing-chars-per-token", type=float,
                   default=policy.DEFAULT_CHARS_PER_TOKEN, metavar="C",
                   help="text prompts are hashed in chunks of block-size x C characters, and "
                        "their length in tokens estimated as characters / C")
    r.add_argument("--routing-table-blocks", type=int, default=policy.DEFAULT_SERVER_BLOCKS,
                   metavar="N", help="prefix-table blocks remembered per server until its "
                                     "/metrics report its KV capacity")
    add_kv_events_flags(r)
    r.add_argument("--disagg-policy", choices=policy.DISAGG_POLICIES, default="always",
                   help="always: prefill then decode; never: decode servers prefill everything; "
                        "auto: straight to decode for short or decode-cached prompts")
    r.add_argument("--direct-max-tokens", type=int, default=policy.DEFAULT_DIRECT_MAX_TOKENS,
                   metavar="N", help="auto: at most N tokens not cached on the decode server: "
                                     "straight to decode")
    r.add_argument("--direct-cached-fraction", type=float,
                   default=policy.DEFAULT_DIRECT_CACHED_FRACTION, metavar="F",
                   help="auto: the decode server holds at least this share of the prompt: "
                        "straight to decode")


def add_kv_events_flags(r: argparse._ArgumentGroup) -> None:
    r.add_argument("--kv-events-port", nargs="+", type=int, default=None, metavar="PORT",
                   help="cache_aware: follow each prefill server's KV events (its "
                        "--kv-events-config endpoint) at tcp://PREFILL_HOST:PORT and route by "
                        "the prefix blocks they say it holds (token-id prompts); one port for "
                        "every server, or one per server in --prefiller order")
    r.add_argument("--kv-events-replay-port", nargs="+", type=int, default=None, metavar="PORT",
                   help="the servers' replay_endpoint ports (same pairing): joins and gaps are "
                        "filled by replay, and a silent server is noticed (without it a server "
                        "with no events lately counts as silent: the proxy's guess is used)")
    r.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="subscribe to messages whose topic starts with TOPIC")
    r.add_argument("--kv-events-auth", choices=("none", "kv_secret"), default="none",
                   help='kv_secret: the servers publish with "auth": "kv_secret" (CURVE keyed '
                        f"from the KV secret: ${envs.KV_SECRET.name} or --kv-events-secret-file)")
    r.add_argument("--kv-events-secret-file", default=None, metavar="PATH",
                   help=f"the KV secret for --kv-events-auth kv_secret when "
                        f"${envs.KV_SECRET.name} is unset")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG,
                     description="Disaggregated prefill/decode proxy (vLLM's wire format).",
                     formatter_class=HelpFormatter)
    add_proxy_flags(parser)
    return parser


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    """Raises EndpointError (a one-line message naming the flags) for unpairable hosts/ports."""
    if not 0 <= args.port <= 65535:
        raise EndpointError(f"--port: {args.port} is not a TCP port")
    if args.health_interval < 0:
        raise EndpointError(f"--health-interval: {args.health_interval:g} is negative")
    if not 0 <= args.prefill_busy_retry < float("inf"):
        raise EndpointError(f"--prefill-busy-retry: {args.prefill_busy_retry:g} is not a "
                            f"number of seconds >= 0")
    backends_file = _backends_file(args)
    prefill, decode = [], []
    if backends_file is None:
        prefill = expand_endpoints(args.prefiller_host or [DEFAULT_HOST],
                                   args.prefiller_port or [DEFAULT_PREFILL_PORT], "prefiller")
        decode = expand_endpoints(args.decoder_host or [DEFAULT_HOST],
                                  args.decoder_port or [DEFAULT_DECODE_PORT], "decoder")
    routing = _routing_settings(args, prefill)
    return ProxySettings(host=args.host, port=args.port, routing=routing, prefill=prefill,
                         decode=decode,
                         log_level=args.log_level, api_key=args.api_key or envs.PROXY_API_KEY.raw(),
                         health_interval_s=args.health_interval,
                         busy_retry_s=args.prefill_busy_retry,
                         forwarded_allow_ips=args.forwarded_allow_ips or None,
                         backends_file=backends_file)


def _backends_file(args: argparse.Namespace) -> BackendsFile | None:
    """--backends-file, read once here so that a bad one is a one-line error at start."""
    if args.backends_file is None:
        return None
    given = [f"--{flag.replace('_', '-')}" for flag in ENDPOINT_FLAGS
             if getattr(args, flag) is not None]
    if given:
        raise EndpointError(f"--backends-file and {given[0]}: give the servers in one or the "
                            f"other")
    if args.health_interval == 0:
        raise EndpointError("--backends-file needs the background probe (--health-interval > "
                            "0): a server the file adds is used once its /health answers 200")
    backends_file = BackendsFile(args.backends_file)
    try:
        backends_file.load()
    except BackendsFileError as e:
        raise EndpointError(f"--backends-file: {e}") from None
    return backends_file


def _routing_settings(args: argparse.Namespace,
                      prefill: list[tuple[str, int]]) -> RoutingSettings:
    if args.routing_load_margin < 0:
        raise EndpointError(f"--routing-load-margin: {args.routing_load_margin:g} is negative")
    if args.routing_block_size < 1:
        raise EndpointError(f"--routing-block-size: {args.routing_block_size} is not positive")
    if args.routing_chars_per_token <= 0:
        raise EndpointError(f"--routing-chars-per-token: {args.routing_chars_per_token:g} is "
                            f"not positive")
    if args.routing_table_blocks < 1:
        raise EndpointError(f"--routing-table-blocks: {args.routing_table_blocks} is not positive")
    if args.direct_max_tokens < 0:
        raise EndpointError(f"--direct-max-tokens: {args.direct_max_tokens} is negative")
    if not 0 < args.direct_cached_fraction <= 1:
        raise EndpointError(f"--direct-cached-fraction: {args.direct_cached_fraction:g} is not "
                            f"in (0, 1]")
    disagg = DisaggPolicy(args.disagg_policy, args.direct_max_tokens, args.direct_cached_fraction)
    return RoutingSettings(args.routing, args.routing_load_margin, disagg, args.routing_block_size,
                           args.routing_chars_per_token, args.routing_table_blocks,
                           _kv_events(args, prefill))


def _kv_events(args: argparse.Namespace, prefill: list[tuple[str, int]]) -> KVEventsRouting | None:
    """--kv-events-*: one event source per prefill server, named as its backend."""
    if args.backends_file is not None:
        return _kv_events_from_file(args)
    if args.kv_events_port is None:
        for flag in ("replay_port", "auth", "secret_file"):
            if getattr(args, f"kv_events_{flag}") not in (None, "none"):
                raise EndpointError(f"--kv-events-{flag.replace('_', '-')} needs --kv-events-port")
        return None
    if args.routing != "cache_aware":
        raise EndpointError(f"--kv-events-port needs --routing cache_aware (not {args.routing})")
    pub = _event_ports(args.kv_events_port, len(prefill), "--kv-events-port")
    replay = (_event_ports(args.kv_events_replay_port, len(prefill), "--kv-events-replay-port")
              if args.kv_events_replay_port else [None] * len(prefill))
    sources = tuple(EventSource(f"{host}:{port}", tcp_endpoint(host, p),
                                tcp_endpoint(host, r) if r else None)
                    for (host, port), p, r in zip(prefill, pub, replay, strict=True))
    return _with_auth(args, sources)


def _kv_events_from_file(args: argparse.Namespace) -> KVEventsRouting | None:
    """With --backends-file the ports are the file's (`kv_events_port`); the other flags say
    how to follow them. The sources come and go with the file (state.py)."""
    for flag in ("port", "replay_port"):
        if getattr(args, f"kv_events_{flag}") is not None:
            raise EndpointError(f"--kv-events-{flag.replace('_', '-')}: with --backends-file, "
                                f"give each prefill server's kv_events_{flag} in the file")
    if args.routing != "cache_aware":
        return None                      # the file's event ports are not used then
    return _with_auth(args, ())


def _with_auth(args: argparse.Namespace, sources: tuple[EventSource, ...]) -> KVEventsRouting:
    auth = args.kv_events_auth == "kv_secret"
    if auth:
        from kvrelay.kv_events.config import read_secret
        try:
            read_secret(args.kv_events_secret_file, "--kv-events-auth kv_secret",
                        "--kv-events-secret-file")
        except ValueError as e:
            raise EndpointError(str(e)) from None
    elif args.kv_events_secret_file:
        raise EndpointError("--kv-events-secret-file needs --kv-events-auth kv_secret")
    return KVEventsRouting(sources, args.kv_events_topic, auth, args.kv_events_secret_file)


def _event_ports(ports: list[int], servers: int, flag: str) -> list[int]:
    if len(ports) not in (1, servers):
        raise EndpointError(f"{flag}: {len(ports)} ports for {servers} prefill servers: give one "
                            f"for all or one per server")
    for port in ports:
        if not 1 <= port <= 65535:
            raise EndpointError(f"{flag}: {port} is not a TCP port (1-65535)")
    return ports * servers if len(ports) == 1 else list(ports)


class _ProxyServer(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, which would end the
    process "killed by signal"; for the proxy a signal is the normal way out (exit 0)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(level.upper())
    for noisy in ("httpx", "httpcore"):          # a line per backend call; the proxy logs its own
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the app is even imported (uvicorn's own bind error
    comes with a second line of ours, after its startup)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(settings: ProxySettings) -> int:
    try:
        sock = _listen(settings.host, settings.port)
    except OSError as e:
        print(f"{PROG}: error: cannot listen on {settings.host}:{settings.port}: "
              f"{(e.strerror or str(e)).lower()}", file=sys.stderr, flush=True)
        return 1
    from kvrelay.proxy.app import build_app
    from kvrelay.proxy.state import ProxyAuth
    auth = ProxyAuth(api_key=settings.api_key, backend_key=envs.OPENAI_API_KEY.raw())
    app = build_app(settings.prefill, settings.decode, auth, settings.health_interval_s,
                    settings.routing, settings.busy_retry_s, settings.backends_file)
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on",
                            # uvicorn would trust X-Forwarded-For from 127.0.0.1: only on opt-in
                            proxy_headers=settings.forwarded_allow_ips is not None,
                            forwarded_allow_ips=settings.forwarded_allow_ips)
    server = _ProxyServer(config)
    try:
        server.run(sockets=[sock])
    except SystemExit as e:          # uvicorn's way out when startup fails
        logger.error("the proxy could not start (exit status %s)", e.code)
        return 1
    finally:
        sock.close()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    """`kvrelay proxy [flags]`; `argv` excludes the program and the `proxy` word."""
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        settings = settings_from_args(args)
    except SystemExit as e:          # --help (0) or a flag error (2), already printed
        return e.code if isinstance(e.code, int) else 2
    except EndpointError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    _setup_logging(settings.log_level)
    return_large_buffers_to_the_os()       # a large body's buffers do not stay resident
    one_arena()                            # nor what worker threads freed
    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
