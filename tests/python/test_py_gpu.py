"""The Python Accumulator with a model on a CUDA device, on a machine
without one (docs/gpu.md): gpu_child.py runs the Accumulator's GPU path
against the stand-in driver (tests/gpu/fake_cuda.c), with torch's half of
it (CUDA tensors over cohort's device memory) played by CPU tensors over
the stand-in's memory. Two trainers on two sidecars, which import the
memory and reduce it host-staged:

- every parameter, .grad and buffer is a view of cohort's device memory,
  not of the host block, in each round, including one where autograd made
  a new .grad;
- each round's result is the exact mean of both members' gradients, in
  place on the device, and both members hold the same bytes;
- the members start from different parameters, and each moves its own
  on the device after registering them: both end with the leader's
  current values (cohort_set_state copies the leader's device values to
  the host copies that state transfer sends, cohort_update the joiner's
  onto its device);
- close() waits for the device and leaves the parameters, buffers and
  gradients in private memory, unchanged.

And the refusals, each with its cause: a UUID the driver does not have, no
driver at all, a driver without a device, and a broker address (only a
sidecar stages device memory). What this cannot show: anything of torch's
CUDA (torch.as_tensor over __cuda_array_interface__, streams) or of a real
driver. That is the third test's, the same pair with the model on a real
cuda:0: make test-gpu runs it, and it skips where torch has no CUDA.
"""
import ctypes
import errno
import json
import os
import subprocess

import pytest
import torch

from cohorttest import DEADLINE, bin_path
from pyproc import HERE, child_env, run_pair, sidecar_pair

# make python-test names it; by hand, the sanitizer build's beside $COHORT_BIN.
FAKE_DIR = os.environ.get("COHORT_FAKE_CUDA_DIR") or \
    bin_path(os.path.join("asan", "tests", "gpu", "fake"))
DEVICE = "GPU-1f3a5c7e-0b2d-4e6f-8091-a2b3c4d5e6f7"
CHILD = os.path.join(HERE, "gpu_child.py")

stand_in = pytest.mark.skipif(
    not os.path.exists(os.path.join(FAKE_DIR, "libcuda.so.1")),
    reason="no stand-in CUDA driver at %s: it is built only with GPU support (cuda.h and "
           "nccl.h under CUDA_HOME)" % FAKE_DIR)


def with_driver(env):
    env["LD_LIBRARY_PATH"] = FAKE_DIR + (":" + env["LD_LIBRARY_PATH"]
                                         if env.get("LD_LIBRARY_PATH") else "")
    env["COHORT_FAKE_CUDA_DEVICES"] = DEVICE
    return env


@stand_in
def test_a_cuda_model_reduces_on_the_device_through_sidecars(broker, tmp_path, monkeypatch):
    # The sidecars inherit this environment: the same stand-in driver.
    for k, v in with_driver({"LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", "")}).items():
        monkeypatch.setenv(k, v)
    with sidecar_pair(broker, tmp_path, "gpu", "--gpu-reduce", "host") as (address_of, _):
        rounds = run_pair("gpu_child.py", address_of)
    assert len(rounds[0]) == 2
    for member in rounds:
        for r in member:
            assert r["exact"] and r["on_device"], r
    # One leader, whose state the other received.
    leaders = [m[0]["leader"] for m in rounds]
    assert sorted(leaders) == [False, True], leaders
    joiner = rounds[leaders.index(False)]
    assert joiner[0]["states_received"] >= 1, joiner


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA in this torch or no GPU: make test-gpu runs this on a GPU")
def test_a_cuda_model_reduces_on_a_real_gpu(broker, tmp_path):
    """The same two trainers with the model on cuda:0 and nothing stood in
    for: torch's CUDA tensors over cohort's device memory, the real
    driver, both sidecars staging one GPU's memory."""
    with sidecar_pair(broker, tmp_path, "gpu", "--gpu-reduce", "host") as (address_of, _):
        rounds = run_pair("gpu_child.py", address_of, "cuda")
    for member in rounds:
        for r in member:
            assert r["exact"] and r["on_device"], r


def refusal(case, env):
    out = subprocess.run(["/usr/bin/python3", CHILD, "--refuse", case], env=env,
                         capture_output=True, text=True, timeout=4 * DEADLINE)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@stand_in
def test_a_cuda_model_is_refused_with_its_cause():
    env = with_driver(child_env())
    got = refusal("none", env)
    assert got["type"] is None, got          # the control: with the driver it registers
    got = refusal("uuid", env)
    assert got["errno"] == errno.ENXIO and "sees no device with that UUID" in got["message"], got
    got = refusal("broker", env)
    assert got["errno"] == errno.EOPNOTSUPP and "only a sidecar" in got["message"], got
    env_nodev = dict(env, COHORT_FAKE_CUDA_INIT="nodev")
    got = refusal("none", env_nodev)
    assert got["errno"] == errno.ENXIO and "cuInit failed" in got["message"], got
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        got = refusal("none", child_env())   # no driver at all
        assert got["errno"] == errno.ELIBACC and "no CUDA driver" in got["message"], got
