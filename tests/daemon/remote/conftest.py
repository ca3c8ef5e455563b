from tests.daemon.remote.fleet import fleet, remote  # noqa: F401  (the fixtures)
