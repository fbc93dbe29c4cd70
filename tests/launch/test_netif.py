"""Addresses and interfaces, read from the kernel; endpoints are numeric, never hostnames."""

from __future__ import annotations

import pytest

from dtrain.errors import ConfigError
from dtrain.launch.netif import format_endpoint, interface_of, parse_endpoint, route_source


def test_loopback_belongs_to_lo_and_a_foreign_address_to_nothing() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None
    assert route_source("127.0.0.1") == "127.0.0.1"


def test_endpoints_are_numeric_addresses_with_a_port() -> None:
    assert parse_endpoint("cluster", "10.0.0.1:29400") == ("10.0.0.1", 29400)
    assert parse_endpoint("cluster", "[::1]:5") == ("::1", 5)
    assert format_endpoint("::1", 5) == "[::1]:5"
    for bad in ("node1:29400", "10.0.0.1", "10.0.0.1:0", "10.0.0.1:70000", ":5"):
        with pytest.raises(ConfigError, match="numeric IP address"):
            parse_endpoint("cluster", bad)
