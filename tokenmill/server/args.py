"""Server flags for `tokenmill serve` (engine flags come from tokenmill.engine_args).
vLLM's names wherever vLLM has the flag."""
from __future__ import annotations

import argparse
import os

from tokenmill.engine_args import parse_bytes

DEFAULT_MAX_BODY = 8 << 20     # 8 MiB: a max-length prompt as token ids fits many times over


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $TOKENMILL_API_KEY)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported in responses (default: the model)")
    g.add_argument("--max-queue-len", type=int, default=1024,
                   help="requests allowed to wait for their first token; beyond it -> 503 + Retry-After")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests before aborting them")
    g.add_argument("--max-request-body-bytes", type=parse_bytes, default=DEFAULT_MAX_BODY,
                   help="larger request bodies get 413 (accepts suffixes like 8M)")
    g.add_argument("--max-n", type=int, default=None,
                   help="largest `n` a request may ask for (default: --max-num-seqs)")
    g.add_argument("--chat-history-window", type=int, default=None, metavar="TOKENS",
                   help="drop the oldest chat turns (never system messages or the last user turn) until the "
                        "templated prompt is at most TOKENS; reported as usage.dropped_messages")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic engine stats log line")
    g.add_argument("--log-stats-interval", type=float, default=5.0, help="seconds between stats log lines")
