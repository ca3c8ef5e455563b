"""The remote URL picks its backend (gpusnap.daemon.remote.objects.BACKENDS); a URL no backend takes is refused
before anything is loaded or reached."""

from __future__ import annotations

import pytest

from gpusnap.daemon.api.errors import InvalidArgumentError
from gpusnap.daemon.remote import objects, s3


def test_an_s3_url_goes_to_the_s3_backend() -> None:
    objects.check_url("s3://bucket/some/prefix")
    assert objects.BACKENDS["s3"] == s3.__name__


@pytest.mark.parametrize("url", ["http://bucket/x", "gs://bucket/x", "bucket/x", "s3://A/x", "s3://ok-bucket/../x"])
def test_urls_no_backend_takes_are_refused_with_the_forms_that_work(url: str) -> None:
    with pytest.raises(InvalidArgumentError) as e:
        objects.check_url(url)
    assert e.value.reason == "BAD_CONFIG" and f"remote {url!r} is not {s3.URL_FORM}" in e.value.message
