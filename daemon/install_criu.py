"""``gpusnap-install-criu [PREFIX]``: CRIU >= 4.2 and pycriu for gpusnapd, from an installed gpusnap (a wheel or
``pip install .``), where there is no Makefile for ``make criu``.

It runs the script ``make criu`` runs (``install-criu.sh``, bundled in the package: the distribution's ``criu``
and ``python3-pycriu`` where new enough, else Debian's, unpacked with their library closure into a private,
relocatable prefix), into PREFIX (default ``/opt/gpusnap/criu``, where ``make install-service`` puts it too),
then prints the gpusnapd flags and config keys that use it. Run it as root: it may ``apt-get install`` the
distribution's packages, and gpusnapd, which runs CRIU, runs as root.
"""

from __future__ import annotations

import importlib.resources
import os
import subprocess
import sys

import click

from gpusnap.daemon.defaults import DEFAULT_CRIU_PREFIX

DEFAULT_PREFIX = str(DEFAULT_CRIU_PREFIX)


def flags(prefix: str) -> str:
    """The gpusnapd flags that use the CRIU installed in ``prefix``."""
    return f"--criu {prefix}/bin/criu --pycriu-path {prefix}/python"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("prefix", default=DEFAULT_PREFIX, metavar="[PREFIX]")
def main(prefix: str) -> None:
    """Install CRIU >= 4.2 and pycriu into PREFIX [default: /opt/gpusnap/criu] for gpusnapd."""
    prefix = os.path.abspath(prefix)
    script = importlib.resources.files("gpusnap.daemon") / "install-criu.sh"
    with importlib.resources.as_file(script) as path:
        code = subprocess.run(["bash", str(path), prefix], check=False).returncode
    if code != 0:
        sys.exit(code)
    click.echo(
        f"CRIU is in {prefix}. Start gpusnapd with {flags(prefix)},\n"
        f'or set criu_binary = "{prefix}/bin/criu" and pycriu_path = "{prefix}/python" in its config file.'
    )
