"""GPU support in the build (docs/gpu.md): off without CUDA's and NCCL's
headers, and then said once, whatever the target; on where they are, for
src/gpu/ alone; and never a link-time dependency of the binaries.

make runs with -n and a build directory of its own, so nothing is built
and the real build tree is left alone.
"""
import os
import subprocess

import pytest

from cohorttest import DEADLINE, ROOT, bin_path, make_tmp, remove_tmp

OFF = "GPU support is off"
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
HAVE_HEADERS = all(os.path.exists(os.path.join(CUDA_HOME, "include", h))
                   for h in ("cuda.h", "nccl.h"))


@pytest.fixture
def tmp():
    d = make_tmp("cohort-gpubuild-")
    yield d
    remove_tmp(d)


def dry_run(tmp, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    out = subprocess.run(["make", "-n", "BUILD=" + os.path.join(tmp, "build"), *args],
                         cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=4 * DEADLINE)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


@pytest.mark.parametrize("target", ["all", "test", "demo"])
def test_without_the_headers_gpu_support_is_off_and_said_once(tmp, target):
    text = dry_run(tmp, "CUDA_HOME=" + os.path.join(tmp, "no-cuda"), target)
    assert text.count(OFF) == 1, text[-2000:]
    assert "no cuda.h and nccl.h under CUDA_HOME=" in text
    assert "-DCOHORT_GPU" not in text


def test_gpu_off_is_said_as_the_reason(tmp):
    text = dry_run(tmp, "GPU=off", "all")
    assert text.count(OFF + ": GPU=off was given") == 1, text[-2000:]
    assert "-DCOHORT_GPU" not in text


@pytest.mark.skipif(not HAVE_HEADERS, reason="no cuda.h and nccl.h under " + CUDA_HOME)
def test_with_the_headers_only_src_gpu_gets_them(tmp):
    text = dry_run(tmp, "CUDA_HOME=" + CUDA_HOME, "all")
    assert OFF not in text
    compiles = [l for l in text.splitlines() if " -c " in l and ".c -o " in l]
    gpu = [l for l in compiles if " src/gpu/" in l]
    assert gpu and all("-DCOHORT_GPU" in l for l in gpu), gpu
    others = [l for l in compiles if " src/gpu/" not in l]
    assert others and not any("-DCOHORT_GPU" in l for l in others)


@pytest.mark.parametrize("binary", ["cohort-sidecar", "cohort-operator", "cohortctl"])
def test_no_binary_needs_cuda_or_nccl_to_start(binary):
    out = subprocess.run(["readelf", "-d", bin_path(binary)], capture_output=True, text=True,
                         check=True)
    needed = [l for l in out.stdout.splitlines() if "(NEEDED)" in l]
    assert needed, out.stdout
    assert not any("cuda" in l or "nccl" in l for l in needed), needed
