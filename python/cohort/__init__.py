"""cohort: elastic data-parallel training for PyTorch, with moolib's API.

    import cohort
    acc = cohort.Accumulator("model", model.parameters(), model.buffers())
    acc.connect()      # $COHORT_SOCKET (a sidecar) or $COHORT_BROKER

`import cohort as moolib` runs moolib's Accumulator loop unchanged. The
parameters, their gradients and the buffers live in shared memory that
cohort's node all-reduces in place; see docs/python.md.
"""
from ._cohort import API_VERSION, Error
from .accumulator import Accumulator
from .group import Group, Rpc

__all__ = ["Accumulator", "Group", "Rpc", "Error", "API_VERSION"]
__version__ = "0.1.0"
