"""Shared setup for the Python package's tests.

The multi-process helpers come from tests/lib/cohorttest (on the path
through pytest.ini). The package is the one on PYTHONPATH (`make
python-test` points it at $(BUILD)/python), else build/python.
"""
import os
import sys

try:
    import cohort  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "build", "python"))
