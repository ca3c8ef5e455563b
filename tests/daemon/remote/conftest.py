from tests.daemon.remote.fleet import fleet  # noqa: F401  (the fixture)
