"""Helpers of the image's tests: podman commands and the containers a test
starts, removed at its end."""
import subprocess
import uuid


def podman(*args, timeout=120):
    """One podman command; returns the CompletedProcess (text)."""
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


class Containers:
    """Names for a test's containers, all removed at its end whatever
    happened (a `podman run` killed with SIGKILL leaves its container
    running)."""

    def __init__(self):
        self.prefix = "cohort-test-%s" % uuid.uuid4().hex[:8]
        self.names = []

    def name(self, what):
        n = "%s-%s" % (self.prefix, what)
        self.names.append(n)
        return n

    def run_argv(self, image, what, *argv, volumes=(), env=(), network="host"):
        """`podman run` of argv in a container of its own named for `what`:
        removed when it exits, with an init that forwards signals (SIGTERM
        to `podman run` reaches the program), on the host's loopback (or
        with no network: "none")."""
        cmd = ["podman", "run", "--rm", "--init", "--name", self.name(what),
               "--network=" + network]
        for host, guest in volumes:
            cmd += ["-v", "%s:%s" % (host, guest)]
        for kv in env:
            cmd += ["-e", kv]
        return cmd + [image, *argv]

    def remove(self):
        if self.names:
            podman("rm", "-f", "-i", "-t", "0", *self.names, timeout=120)
