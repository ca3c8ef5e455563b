"""gpusnapd: the gpusnap node daemon (entry point)."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import click
import sdnotify
import structlog

from gpusnap.daemon import __version__, logsetup
from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.config import DaemonConfig
from gpusnap.daemon.operations.failpoints import Failpoints
from gpusnap.daemon.server import Overrides, build_daemon, check_config

EXIT_CONFIG = 2
EXIT_PRECONDITION = 3
EXIT_IN_USE = 4
"""Exit codes of gpusnapd (docs/errors.md): bad configuration, cannot start, store or socket taken by
another gpusnapd."""
IN_USE_REASONS = frozenset({"STORE_LOCKED", "SOCKET_IN_USE"})


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--socket", type=click.Path(path_type=Path), help="API Unix socket [/run/gpusnap/gpusnapd.sock]")
@click.option(
    "--agent-socket",
    type=click.Path(path_type=Path),
    help="where worker agents connect [agent.sock beside --socket]; workers find it via GPUSNAP_AGENT_SOCKET",
)
@click.option(
    "--agent-wait",
    type=float,
    help="seconds a capture waits for the engine processes an agent names to attach their own agents [15]",
)
@click.option("--store", type=click.Path(path_type=Path), help="snapshot store directory [/var/lib/gpusnap]")
@click.option("--buffer-dir", help="buffer store for workers' weights, e.g. on tmpfs [<store>/buffers]")
@click.option(
    "--config", "config_file", type=click.Path(path_type=Path, exists=True, dir_okay=False), help="TOML config file"
)
@click.option("--remote", help="remote store for push/pull: s3://BUCKET/PREFIX")
@click.option("--remote-endpoint", help="S3 service URL of the remote store (e.g. a Ceph RADOS Gateway) [AWS]")
@click.option("--listen", help="also serve on TCP host:port (TLS only; set tls_cert/tls_key)")
@click.option("--metrics-listen", help="serve Prometheus metrics on IP:PORT (a bare port: 127.0.0.1) [off]")
@click.option("--criu", "criu_binary", help="criu executable [criu on PATH]")
@click.option("--pycriu-path", help="directory that holds the pycriu package")
@click.option(
    "--gpu-prefill",
    type=click.Choice(["off", "auto"]),
    help="fill address-stable weights on the GPU while CRIU restores (a CUDA context in gpusnapd) [off]",
)
@click.option("--log-format", type=click.Choice(["auto", "json", "console"]))
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]))
@click.version_option(__version__, prog_name="gpusnapd")
@click.pass_context
def main(ctx: click.Context, /, config_file: Path | None, **flags: object) -> None:
    """Run the gpusnap daemon in the foreground until SIGTERM or SIGINT.

    Settings come from, in rising order of precedence: defaults, the TOML file (keys of
    gpusnap.daemon.config.DaemonConfig, optionally under [gpusnapd]), GPUSNAP_<KEY> environment
    variables, and these flags.
    """
    # A stop from the start on (systemctl stop during the start): the daemon starts, then stops cleanly.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # A launcher's Overrides (main(obj=...): tests/daemon/prefill_daemon.py), else the faults GPUSNAP_FAILPOINT names.
    overrides = ctx.obj if isinstance(ctx.obj, Overrides) else Overrides(failpoints=Failpoints.from_env())
    try:
        config = DaemonConfig.load(config_file, overrides=flags)
        check_config(config)
    except GpusnapError as err:
        click.echo(f"gpusnapd: {err}", err=True)
        sys.exit(EXIT_CONFIG)
    logsetup.configure(config.log_format, config.log_level)
    log = structlog.get_logger("gpusnapd")
    try:
        running = build_daemon(config, overrides)
    except GpusnapError as err:
        log.error("daemon.start_failed", reason=err.reason, error=str(err))
        click.echo(f"gpusnapd: {err}", err=True)
        sys.exit(EXIT_IN_USE if err.reason in IN_USE_REASONS else EXIT_PRECONDITION)
    notifier = sdnotify.SystemdNotifier()
    notifier.notify("READY=1")
    notifier.notify(f"STATUS=serving on {config.socket}")
    stop.wait()
    notifier.notify("STOPPING=1")
    log.info("daemon.stopping")
    running.stop()
    log.info("daemon.stopped")


if __name__ == "__main__":
    main()
