"""`edgellm-serve MODEL`: the OpenAI-compatible daemon (FastAPI + uvicorn).

MODEL is a checkpoint folder, a Hub id (``org/name[@revision]``) or a bundle. Flags map one
to one onto :class:`edgebuild.serve.config.ServeConfig` fields. What runs is decided by
:mod:`edgebuild.deploy` (engines from the engine cache where TensorRT can build them, else the
torch runtime); references and flags are checked before the server listens, the engine build
and the model load run while it already answers (``/health`` says ``building``:
:mod:`edgebuild.serve.startup`).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from edgebuild.cli_options import quant_option
from edgebuild.errors import EdgebuildError, unreadable
from edgebuild.runtime.cpu import DTYPE_CHOICES
from edgebuild.runtime.prefill import DEFAULT_MAX_NUM_BATCHED_TOKENS
from edgebuild.serve.config import BACKENDS, ServeConfig
from edgebuild.speculative.registry import speculative_help

SPECULATIVE_HELP = speculative_help()  # the methods of the registry


@click.command(context_settings={"show_default": True})
@click.argument("model")
@click.option(
    "--speculative-config",
    default=None,
    help=SPECULATIVE_HELP,
)
@click.option("--revision", default=None, help="Hub revision of MODEL (branch, tag or commit).")
@click.option(
    "--cache-dir",
    default=None,
    type=click.Path(path_type=Path),
    help="Engine cache: engines built at start-up are kept and reused here "
    "(default: $EDGEBUILD_CACHE_DIR, else ~/.cache/edgebuild).",
)
@click.option("--host", default="127.0.0.1", help="Address to listen on.")
@click.option("--port", default=8000, type=int)
@click.option("--api-key", default=None, envvar="EDGELLM_API_KEY", help="Require this bearer key.")
@click.option("--served-model-name", default=None, help="Model name (default: directory name).")
@click.option("--max-batch-size", default=8, type=int, help="Requests decoded together.")
@click.option("--max-input-len", default=4096, type=int, help="Longest prompt (tokens).")
@click.option(
    "--max-kv-cache-capacity", default=16384, type=int, help="KV rows shared by all requests."
)
@click.option(
    "--max-draft-kv-cache-capacity",
    default=None,
    type=int,
    help="KV rows of the DSpark draft's own context cache, shared by all requests (a "
    "full-attention draft holds one row per token of each request, a sliding-window draft a "
    "fixed ring per request); admission and preemption count it beside the target's. "
    "Default: --max-kv-cache-capacity. torch backend only: on tensorrt / onnxruntime the "
    "bundle's buffer plan sizes the draft's pool.",
)
@click.option(
    "--max-model-len",
    default=None,
    type=int,
    help="vLLM's name: most tokens (prompt + output) of one request; also caps prompts at "
    "max-model-len - 1 (default: the KV limits decide).",
)
@click.option(
    "--max-queued-requests", default=64, type=int, help="Waiting requests beyond a full batch."
)
@click.option("--max-request-bytes", default=16 * 1024 * 1024, type=int, help="Body limit.")
@click.option(
    "--allowed-local-media-path",
    default=None,
    type=click.Path(path_type=Path),
    help="Directory file:// images may come from (vision models).",
)
@click.option("--backend", type=click.Choice(BACKENDS), default="auto")
@click.option(
    "--threads", default=None, type=int, help="torch CPU threads (default: cores - 1, >= 1)."
)
@click.option(
    "--dtype",
    default="auto",
    type=click.Choice(DTYPE_CHOICES),
    help="CPU compute dtype (auto: bfloat16 where the CPU has AMX-BF16 or Arm bf16, else "
    "float32; edgebuild doctor says which and why).",
)
@quant_option()
@click.option(
    "--graceful-shutdown-s",
    default=30.0,
    type=float,
    help="On SIGTERM, how long running requests may go on before they get a 503.",
)
@click.option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    default=True,
    help="Reuse the KV cache of prompt prefixes computed before (multi-turn chat, system prompts).",
)
@click.option(
    "--enable-chunked-prefill/--no-enable-chunked-prefill",
    default=True,
    help="Prefill prompts in chunks batched under --max-num-batched-tokens (off: one by one).",
)
@click.option(
    "--max-num-batched-tokens",
    default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
    type=int,
    help="Rows one step may run: prompt chunks plus the decode rows of running requests.",
)
@click.option(
    "--batch-wait-ms",
    default=10.0,
    type=float,
    help="With nothing running, wait until no new request arrived for this long (at most 5x) "
    "before the first step, so a burst of prompts shares one prefill pass (0 = off).",
)
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning"]))
def main(log_level: str, **flags) -> None:
    """Serve MODEL (checkpoint folder, Hub id org/name[@rev], or bundle) over an OpenAI API."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from edgebuild.deploy import serve_loader
    from edgebuild.serve.server import EdgeServer
    from edgebuild.serve.startup import Startup

    config = ServeConfig(**flags)
    try:
        config.validate()
        load = serve_loader(config)  # resolves and decides now: a bad id fails at once
    except EdgebuildError as exc:
        click.secho(f"error: {exc}", fg="red", err=True)
        sys.exit(2)
    except OSError as exc:  # an unreadable model folder or file: named, with the fix
        if exc.filename is None:
            raise
        click.secho(f"error: {unreadable(exc)}", fg="red", err=True)
        sys.exit(2)
    server = EdgeServer(None, log_level, startup=Startup(load), config=config)
    server.run()
    if server.startup_error is not None:
        exc = server.startup_error
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C during a kernel build: click's exit
            raise KeyboardInterrupt from exc
        if isinstance(exc, OSError) and exc.filename is not None:
            exc = unreadable(exc)
        if not isinstance(exc, EdgebuildError):
            logging.getLogger("edgebuild.serve").error("start-up failed", exc_info=exc)
        click.secho(f"error: {exc}", fg="red", err=True)
        sys.exit(2)
