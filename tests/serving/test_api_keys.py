"""API keys and their tenants (cluster.serving.api_keys): read from a file, checked strictly."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.serving.api_keys import DEFAULT_TENANT, ApiKeys, Tenant


def test_keys_from_a_file_and_the_single_key_name_their_tenants(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - {name: team-a, key: sk-a, rate_limit_rps: 5}\n"
                    "  - {name: team-b, key: sk-b, rate_limit_tpm: 1000.5}\n")
    keys = ApiKeys.of("sk-default", path)
    assert keys.enabled and len(keys.tenants) == 3
    assert keys.tenant_of("Bearer sk-a") == Tenant("team-a", 5.0, None)
    assert keys.tenant_of(b"bearer  sk-b ") == Tenant("team-b", None, 1000.5)
    assert keys.tenant_of("Bearer sk-default") == Tenant(DEFAULT_TENANT)
    for wrong in (None, "", "sk-a", "Basic sk-a", "Bearer sk-", "Bearer sk-a2", "Bearer"):
        assert keys.tenant_of(wrong) is None, wrong


def test_no_key_means_an_open_api() -> None:
    assert not ApiKeys.of(None).enabled and not ApiKeys().enabled
    assert ApiKeys().tenant_of("Bearer anything") is None


@pytest.mark.parametrize("entries, reason", [
    ([{"name": "a", "key": "k"}, {"name": "a", "key": "k2"}], "already used"),
    ([{"name": "a", "key": "k"}, {"name": "b", "key": "k"}], "already used"),
    ([{"name": "a"}], "needs a non-empty"),
    ([{"name": "", "key": "k"}], "needs a non-empty"),
    ([{"name": "a", "key": "k", "rate_limit_rps": -1}], "rate_limit_rps"),
    ([{"name": "a", "key": "k", "rate_limit_tpm": "many"}], "rate_limit_tpm"),
    ([{"name": "a", "key": "k", "rate_limit_rps": True}], "rate_limit_rps"),
    ([{"name": "a", "key": "k", "rps": 3}], "unknown fields"),
])
def test_bad_entries_are_refused_with_their_reason(entries: list[dict[str, object]], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        ApiKeys.from_entries(entries)


@pytest.mark.parametrize("text", ["[]", "keys: nope", "keys:\n  - just-a-string\n", "other: []"])
def test_a_file_that_is_not_a_keys_list_is_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="'keys' list"):
        ApiKeys.of(None, path)
