"""``sglang/srt/plugins/__init__.py``: general plugins from the entry-point group ``sglang.srt.plugins``.

``load_plugins()`` runs once per process (the front end's ``Engine.__init__`` and ``_launch_subprocesses``,
each scheduler's ``run_scheduler_process``): it calls every plugin's function (``SGLANG_PLUGINS``, comma
separated, restricts them by name), then applies the hooks they registered.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import entry_points

from sglang.srt.plugins.hook_registry import HookRegistry

GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"
_loaded = False
log = logging.getLogger(__name__)


def load_plugins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    allowed = {n.strip() for n in os.environ.get("SGLANG_PLUGINS", "").split(",") if n.strip()}
    for ep in entry_points(group=GENERAL_PLUGINS_GROUP):
        if allowed and ep.name not in allowed:
            continue
        try:
            ep.load()()
        except Exception:
            log.exception("Failed to execute general plugin: %s", ep.name)
    HookRegistry.apply_hooks()
