"""Builds the cohort package: a moolib-compatible Accumulator for PyTorch.

    pip install ./python          (offline: setuptools from the environment)
    make python                   (the same build into build/python)

The extension (cohort/_cohort.c) links libcohort, which this script
compiles itself with -fPIC from the repository's src/ (all but src/k8s/), with the protobuf-c
sources that protoc-c generates from proto/. It needs what `make` needs:
a C compiler, protoc-c, and the development packages of gRPC, protobuf-c,
cJSON, libcurl and libyaml (scripts/install-deps.sh installs them).

Where cuda.h and nccl.h are under $CUDA_HOME (default /usr/local/cuda),
src/gpu/ is compiled with GPU support, as make does ($COHORT_GPU=off
leaves it out); nothing links CUDA, which src/gpu/ loads at run time.

The repository is the directory above this one, or $COHORT_SOURCE_DIR when
the package directory was copied elsewhere.
"""
import concurrent.futures
import glob
import os
import shlex
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.environ.get("COHORT_SOURCE_DIR") or os.path.join(HERE, ".."))
PKGS = ["grpc", "libprotobuf-c"]
# The Makefile's LDLIBS. Only the objects the trainer API needs are pulled
# out of the static archive, and --as-needed drops the libraries they do
# not use (libcurl and libyaml serve the operator). --exclude-libs keeps
# libcohort's symbols private to the extension.
LIBS = ["grpc", "gpr", "protobuf-c", "cjson", "curl", "yaml", "crypto", "pthread", "m"]
LIB_CFLAGS = ["-std=c11", "-D_GNU_SOURCE", "-O2", "-fPIC", "-fvisibility=hidden", "-g", "-Wall", "-Wno-unused-parameter",
              "-Wno-sign-compare"]


def pkg_config(*args):
    try:
        out = subprocess.run(["pkg-config", *args, *PKGS], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []       # the headers may still be in the default paths
    return shlex.split(out)


def gpu_cflags():
    """The Makefile's GPU support for src/gpu/ (docs/gpu.md): -DCOHORT_GPU
    and CUDA's include directory where cuda.h and nccl.h are under
    $CUDA_HOME (default /usr/local/cuda), unless $COHORT_GPU is "off"
    (make passes its GPU). Nothing links CUDA: src/gpu/ loads the driver
    and NCCL at run time."""
    if os.environ.get("COHORT_GPU", "on") == "off":
        return []
    inc = os.path.join(os.environ.get("CUDA_HOME") or "/usr/local/cuda", "include")
    if not all(os.path.exists(os.path.join(inc, h)) for h in ("cuda.h", "nccl.h")):
        return []
    return ["-DCOHORT_GPU", "-I" + inc]


def newer(target, sources):
    """True when target is missing or older than any of sources."""
    if not os.path.exists(target):
        return True
    t = os.path.getmtime(target)
    return any(os.path.getmtime(s) > t for s in sources)


class BuildExt(build_ext):
    """Generates the protobuf-c sources, compiles libcohort with -fPIC into
    a static archive in build_temp (in parallel, only what changed), then
    builds the extension against it."""

    def build_extension(self, ext):
        if not os.path.exists(os.path.join(ROOT, "include", "cohort.h")):
            sys.exit("setup.py: cohort's sources are not in %s; set COHORT_SOURCE_DIR to the "
                     "repository" % ROOT)
        tmp = os.path.abspath(self.build_temp)
        gen = os.path.join(tmp, "gen")
        gpu = gpu_cflags()
        # Objects built with and without GPU support live apart, so that
        # turning it on or off recompiles src/gpu/.
        objdir = os.path.join(tmp, "obj-gpu" if gpu else "obj")
        os.makedirs(gen, exist_ok=True)
        os.makedirs(objdir, exist_ok=True)
        for proto in sorted(glob.glob(os.path.join(ROOT, "proto", "*.proto"))):
            base = os.path.splitext(os.path.basename(proto))[0]
            if newer(os.path.join(gen, base + ".pb-c.c"), [proto]):
                self.spawn(["protoc-c", "--proto_path=" + os.path.join(ROOT, "proto"),
                            "--c_out=" + gen, proto])
        # Everything outside the operator's Kubernetes code; the linker
        # pulls from the archive only what the extension reaches.
        sources = sorted([s for s in glob.glob(os.path.join(ROOT, "src", "*", "*.c"))
                          if os.path.basename(os.path.dirname(s)) != "k8s"] +
                         glob.glob(os.path.join(gen, "*.c")))
        headers = (glob.glob(os.path.join(ROOT, "src", "*", "*.h")) +
                   glob.glob(os.path.join(ROOT, "include", "*.h")) +
                   glob.glob(os.path.join(gen, "*.h")))
        cflags = LIB_CFLAGS + ["-I" + os.path.join(ROOT, "include"), "-I" + os.path.join(ROOT, "src"),
                               "-I" + gen] + pkg_config("--cflags")
        cc = shlex.split(os.environ.get("CC", "cc"))

        def compile_one(src):
            rel = os.path.relpath(src, ROOT if src.startswith(ROOT + os.sep) else gen)
            obj = os.path.join(objdir, rel[:-2].replace(os.sep, "_") + ".o")
            if newer(obj, [src] + headers):
                extra = gpu if os.path.basename(os.path.dirname(src)) == "gpu" else []
                cmd = cc + cflags + extra + ["-c", src, "-o", obj]
                print(" ".join(cmd), flush=True)
                subprocess.run(cmd, check=True)
            return obj

        jobs = self.parallel if isinstance(self.parallel, int) and self.parallel > 1 else os.cpu_count()
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or 1) as pool:
            objs = list(pool.map(compile_one, sources))
        lib = os.path.join(objdir, "libcohort_pic.a")
        if newer(lib, objs):
            if os.path.exists(lib):
                os.unlink(lib)
            self.spawn(["ar", "rcs", lib] + objs)
        # src/ for engine/codec.h: the state's codecs (cohort.hivemind).
        ext.include_dirs = [os.path.join(ROOT, "include"), os.path.join(ROOT, "src")] + \
            ext.include_dirs
        ext.library_dirs = [objdir] + ext.library_dirs
        ext.libraries = ["cohort_pic"] + LIBS
        ext.extra_link_args = ["-Wl,--as-needed", "-Wl,--exclude-libs,ALL"] + pkg_config("--libs-only-L")
        ext.depends = objs + [lib, os.path.join(ROOT, "include", "cohort.h"),
                             os.path.join(ROOT, "src", "engine", "codec.h")]
        # A cohort.h whose engine reduces out of place into a results
        # region: .grad points there while a result is held.
        with open(os.path.join(ROOT, "include", "cohort.h")) as f:
            if "cohort_results(" in f.read():
                ext.define_macros = ext.define_macros + [("COHORT_BINDING_RESULTS", "1")]
        if os.environ.get("COHORT_WERROR") == "1":
            ext.extra_compile_args = ext.extra_compile_args + ["-Werror"]
        # Back to the other archive after turning GPU support off and on:
        # it may be older than the extension, which must be linked again.
        stamp = os.path.join(tmp, "linked-with")
        linked = None
        if os.path.exists(stamp):
            with open(stamp) as f:
                linked = f.read()
        if linked != lib:
            self.force = True
        super().build_extension(ext)
        with open(stamp, "w") as f:
            f.write(lib)


setup(
    name="cohort",
    version="0.1.0",
    description="Elastic data-parallel training: a moolib-compatible Accumulator for PyTorch",
    packages=["cohort"],
    ext_modules=[Extension(
        "cohort._cohort", sources=["cohort/_cohort.c"],
        extra_compile_args=["-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                            "-Wno-missing-field-initializers"])],
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.9",
)
