"""src/gpu/'s driver paths, on a machine without a GPU: the unit suite
gpu_driver and tests/gpu/gpu_check run against a stand-in for the CUDA
driver (tests/gpu/fake_cuda.c, device memory played by memfds), put first
on the library path, so that cohort's dlopen("libcuda.so.1") finds it.

What it shows: the versioned entry points resolve, devices are found by
UUID, each refusal has its cause, a region is exported and imported in
NVIDIA's sample's order and handed to another process over SCM_RIGHTS, and
every failing driver call unwinds what was taken. What it cannot show:
anything about a real driver or a real GPU (docs/gpu.md).

The stand-in is built only with GPU support (it needs cuda.h); without
it these tests skip, saying so.
"""
import json
import os
import re
import subprocess

import pytest

from cohorttest import DEADLINE, ROOT, bin_path

FAKE_DIR = bin_path(os.path.join("tests", "gpu", "fake"))
GPU_CHECK = bin_path(os.path.join("tests", "gpu", "gpu_check"))
DEVICE = "GPU-1f3a5c7e-0b2d-4e6f-8091-a2b3c4d5e6f7"



def gpu_support():
    """Whether the binaries under test were built with GPU support, as
    gpu_check itself says (a stand-in left from an earlier build does not
    make it so)."""
    if not os.path.exists(os.path.join(FAKE_DIR, "libcuda.so.1")):
        return False
    out = subprocess.run([GPU_CHECK], capture_output=True, text=True, timeout=4 * DEADLINE)
    return "no GPU support in this build" not in out.stdout


pytestmark = pytest.mark.skipif(
    not gpu_support(),
    reason="no GPU support in this build (no cuda.h and nccl.h under CUDA_HOME), "
           "so no stand-in driver was built")


def fake_env(**extra):
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = FAKE_DIR + (":" + env["LD_LIBRARY_PATH"]
                                         if env.get("LD_LIBRARY_PATH") else "")
    env.update(extra)
    return env


def test_the_driver_suite_passes_against_the_stand_in():
    out = subprocess.run([bin_path(os.path.join("tests", "unit")), "--filter", "gpu_driver/*",
                          "--jobs=1"],
                         env=fake_env(COHORT_FAKE_CUDA="1"), capture_output=True, text=True,
                         timeout=4 * DEADLINE)
    text = out.stdout + out.stderr
    m = re.search(r"Tested: (\d+) \| Passing: (\d+) \| Failing: (\d+) \| Crashing: (\d+)", text)
    assert m, text
    tested, passing, failing, crashing = map(int, m.groups())
    assert (failing, crashing) == (0, 0), text
    assert tested == passing >= 4, "every test ran, none skipped:\n" + text
    assert out.returncode == 0, text


def test_a_region_reaches_another_process_over_the_socket():
    out = subprocess.run([GPU_CHECK, "--driver-only"],
                         env=fake_env(COHORT_FAKE_CUDA_DEVICES=DEVICE),
                         capture_output=True, text=True, timeout=4 * DEADLINE)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"handover .*: ok", out.stdout), out.stdout


def test_the_host_staged_reduction_reaches_both_devices_and_a_failed_copy_fails_it():
    out = subprocess.run([GPU_CHECK, "--driver-only"],
                         env=fake_env(COHORT_FAKE_CUDA_DEVICES=DEVICE),
                         capture_output=True, text=True, timeout=4 * DEADLINE)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"host-staged reduction .*: ok", out.stdout), out.stdout
    # A result that cannot reach a trainer's device ends its session: the
    # check fails at once with the sidecar's error, not at its deadline.
    out = subprocess.run([GPU_CHECK, "--driver-only"],
                         env=fake_env(COHORT_FAKE_CUDA_DEVICES=DEVICE,
                                      COHORT_FAKE_CUDA_FAIL="cuMemcpyHtoDAsync"),
                         capture_output=True, text=True, timeout=4 * DEADLINE)
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(r"host-staged reduction .*: FAIL \(Input/output error\)", out.stdout), \
        out.stdout


FAKE_NCCL_DIR = bin_path(os.path.join("tests", "gpu", "fake-nccl"))
DEVICE_2 = "GPU-2a4b6c8d-0e1f-4a3b-9c5d-7e9f1a3b5c7d"


def nccl_env(**extra):
    """The stand-in NCCL (tests/gpu/fake_nccl.c, ranks as threads of one
    process) beside a stand-in driver that has cuStreamQuery."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = FAKE_NCCL_DIR + (":" + env["LD_LIBRARY_PATH"]
                                              if env.get("LD_LIBRARY_PATH") else "")
    env.update(extra)
    return env


def test_two_sidecars_reduce_with_nccl_on_two_devices_against_the_stand_ins():
    """gpu_check's NCCL path, as on a machine with two GPUs: each trainer's
    gradients on a device of its own, the sidecars' nodes vote for NCCL,
    agree on a communicator over the engine, reduce with ncclAllReduce
    (PreMulSum by 1/2) into a scratch on each device and copy it into the
    trainer's results; the memfd never holds a gradient or a result."""
    out = subprocess.run([GPU_CHECK], env=nccl_env(COHORT_FAKE_CUDA_DEVICES=DEVICE + "," + DEVICE_2),
                         capture_output=True, text=True, timeout=4 * DEADLINE)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"NCCL communicator of one rank .*: ok", out.stdout), out.stdout
    assert re.search(r"NCCL reduction of two trainers.*: ok", out.stdout), out.stdout
    assert re.search(r"This epoch reduces on the GPU with NCCL\. epoch=\d+ members=2", out.stderr), \
        out.stderr
    # The stand-in is NCCL 2.27: nccllib finds ncclCommShrink, and a
    # communicator of two shrinks to the one rank left.
    assert re.search(r"NCCL shrink of a communicator of two ranks on two GPUs to one .*: ok",
                     out.stdout), out.stdout
    # A result that cannot be copied from the scratch ends the session.
    out = subprocess.run([GPU_CHECK],
                         env=nccl_env(COHORT_FAKE_CUDA_DEVICES=DEVICE + "," + DEVICE_2,
                                      COHORT_FAKE_CUDA_FAIL="cuMemcpyDtoD"),
                         capture_output=True, text=True, timeout=4 * DEADLINE)
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(r"NCCL reduction of two trainers.*: FAIL", out.stdout), out.stdout
    assert re.search(r"host-staged reduction .*: ok", out.stdout), out.stdout


def test_with_one_device_the_nccl_path_is_a_skip_with_its_reason():
    out = subprocess.run([GPU_CHECK], env=nccl_env(COHORT_FAKE_CUDA_DEVICES=DEVICE),
                         capture_output=True, text=True, timeout=4 * DEADLINE)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "NCCL across two GPUs: skipped (1 device visible" in out.stdout, out.stdout


def test_a_failed_mapping_in_the_exporter_fails_the_check():
    out = subprocess.run([GPU_CHECK, "--driver-only"],
                         env=fake_env(COHORT_FAKE_CUDA_DEVICES=DEVICE,
                                      COHORT_FAKE_CUDA_FAIL="cuMemMap"),
                         capture_output=True, text=True, timeout=4 * DEADLINE)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL" in out.stdout and "test-gpu: FAILED." in out.stdout, out.stdout


def test_no_device_and_no_driver_are_skips_with_their_reason():
    out = subprocess.run([GPU_CHECK], env=fake_env(COHORT_FAKE_CUDA_INIT="nodev"),
                         capture_output=True, text=True, timeout=4 * DEADLINE)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test-gpu: skipped: no GPU on this machine." in out.stdout, out.stdout
    out = subprocess.run([GPU_CHECK], env=fake_env(COHORT_FAKE_CUDA_INIT="stub"),
                         capture_output=True, text=True, timeout=4 * DEADLINE)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test-gpu: skipped: no CUDA driver" in out.stdout, out.stdout


def test_bench_gpu_trainer_runs_under_cohortctl_run_against_the_stand_in(tmp_path):
    """bench/gpu.sh's cohort half, end to end through the public API
    (cohort_use_gpu) and two sidecars: it reduces and reports its rounds.
    The stand-in times nothing real; this checks the plumbing only."""
    exe = str(tmp_path / "gpu_trainer")
    build = subprocess.run(
        ["cc", "-fsanitize=address,undefined", "-Iinclude", "-o", exe, "bench/gpu_trainer.c",
         bin_path("libcohort.a"), "-lgrpc", "-lgpr", "-lprotobuf-c", "-lcjson", "-lcurl",
         "-lyaml", "-lcrypto", "-lpthread", "-lm"],
        cwd=ROOT, capture_output=True, text=True, timeout=4 * DEADLINE)
    assert build.returncode == 0, build.stderr
    # As bench/gpu.sh runs them: sidecars with --gpu-reduce host.
    sidecar = tmp_path / "sidecar"
    sidecar.write_text('#!/bin/sh\nexec "%s" --gpu-reduce host "$@"\n' % bin_path("cohort-sidecar"))
    sidecar.chmod(0o755)
    out = subprocess.run([bin_path("cohortctl"), "run", "-n", "2", "--no-view", "-o", "json",
                          "--sidecar", str(sidecar), "--run-dir", str(tmp_path / "run"), "--",
                          exe, "300000", "4", "1"],
                         env=fake_env(COHORT_FAKE_CUDA_DEVICES=DEVICE, COHORT_GPU_UUID=DEVICE),
                         capture_output=True, text=True, timeout=8 * DEADLINE)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    rows = [json.loads(p["last_line"]) for p in summary["peers"]]
    assert len(rows) == 2
    for r in rows:
        assert r["impl"] == "cohort-host-staged" and r["bytes"] == 1200000 and r["rounds"] == 4
        assert 0 < r["best_ms"] <= r["median_ms"]
    for p in summary["peers"]:
        with open(p["sidecar_log"], errors="replace") as f:
            assert "reduced host-staged (--gpu-reduce host)" in f.read(), p["sidecar_log"]
    # A UUID no device has: the trainer says why and fails.
    out = subprocess.run([bin_path("cohortctl"), "run", "-n", "1", "--no-view", "-o", "json",
                          "--", exe, "1000", "1", "0"],
                         env=fake_env(COHORT_FAKE_CUDA_DEVICES=DEVICE,
                                      COHORT_GPU_UUID="GPU-00000000-0000-0000-0000-00000000000c"),
                         capture_output=True, text=True, timeout=8 * DEADLINE)
    assert out.returncode != 0, out.stdout + out.stderr
