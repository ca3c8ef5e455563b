"""``python -m gpusnap.daemon.cli``: the ``gpusnap`` command."""

from gpusnap.daemon.cli.app import run

run()
