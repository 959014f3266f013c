"""Redis URLs may carry a password (the Helm chart's Redis requires one): logs and error messages
show them through `redacted_url`, which hides the password and keeps the rest."""

from __future__ import annotations

import pytest

from cluster.state.connect import redacted_url


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@demo-pdserve-redis:6379/0", "redis://:***@demo-pdserve-redis:6379/0"),
    ("rediss://pdserve:p%40ss@redis.example.com:6380/2", "rediss://pdserve:***@redis.example.com:6380/2"),
    ("redis://:a@b@host:6379/0", "redis://:***@host:6379/0"),  # an unescaped @ in the password
    ("redis://:pw@[::1]:6379", "redis://:***@[::1]:6379"),
    ("unix://:pw@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
    ("redis://host:6379/0?password=s3cret&db=2", "redis://host:6379/0?password=***&db=2"),
    ("redis://host:6379/0", "redis://host:6379/0"),  # nothing to hide: unchanged
    ("redis://user@host/0", "redis://user@host/0"),
    ("", ""),
])
def test_redacted_url_hides_the_password_and_keeps_the_rest(url: str, shown: str) -> None:
    assert redacted_url(url) == shown
    assert "s3cret" not in redacted_url(url) and "p%40ss" not in redacted_url(url)


def test_a_url_that_does_not_parse_shows_nothing_of_itself() -> None:
    assert "s3cret" not in redacted_url("redis://:s3cret@[::1")
