"""One executor for the tests that build a store, a buffer store or a prefill without a daemon (as
``build_daemon`` builds one per daemon): its lanes start threads on first use and end with the test run."""

from __future__ import annotations

from gpusnap.daemon.executor import Executor

LANES = Executor()
