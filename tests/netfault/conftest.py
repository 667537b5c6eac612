"""The network fault tests run only where network namespaces work (root,
`ip` and `iptables`, a namespace can be made); elsewhere every test is
skipped with the reason, which `pytest -rs` prints."""
import pytest

import netns

_REASON = []


def pytest_collection_modifyitems(config, items):
    mine = [i for i in items if "tests/netfault/" in str(i.fspath)]
    if not mine:
        return
    if not _REASON:
        _REASON.append(netns.unavailable())
    if _REASON[0]:
        skip = pytest.mark.skip(reason="network namespaces unavailable: " + _REASON[0])
        for item in mine:
            item.add_marker(skip)
