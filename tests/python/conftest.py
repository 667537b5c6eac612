"""Shared setup for the Python package's tests.

The multi-process helpers come from tests/lib/cohorttest (on the path
through pytest.ini) and pyproc.py; the broker fixture most suites use is
here. The package is the one on PYTHONPATH (`make python-test` points it
at $(BUILD)/python), else build/python.
"""
import os
import sys

import pytest

from cohorttest import start_broker

try:
    import cohort  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "build", "python"))


@pytest.fixture
def broker():
    """A broker for any cohort, with a quick heartbeat (250 ms) and member
    timeout (2 s), stopped after the test."""
    b = start_broker("--allow-any-cohort", "--heartbeat-interval", "250ms",
                     "--member-timeout", "2s")
    yield b
    b.stop()
