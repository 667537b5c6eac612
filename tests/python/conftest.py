"""Shared setup for the Python package's tests.

The multi-process helpers come from tests/proc/cohortproc.py (real
processes, JSON logs, waits on conditions with generous deadlines). The
package is the one on PYTHONPATH (`make python-test` points it at
$(BUILD)/python), else build/python.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "proc"))
try:
    import cohort  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(ROOT, "build", "python"))
