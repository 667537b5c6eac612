"""What a pod's processes see of the cluster besides its own volumes: the
cluster's names (a hosts file over /etc/hosts) and its ServiceAccount
token at /var/run/secrets/kubernetes.io/serviceaccount. The process
runtime gives each container process its own mount namespace with those
bind-mounted (unshare(2) and mount(2) before exec; root only); the functions
that make the files are apart from that, for other runtimes (a podman
runtime passes the same hosts file and token directory as bind mounts).
"""
import ctypes
import os
import subprocess

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# /var/run is /run on Debian: the pod's secrets directory is mounted over
# /run/secrets, which exists on the host only as an empty mount point.
SECRETS_MOUNT = "/run/secrets"

_available = None


def available():
    """True when container processes can get their own mount namespace
    (root, unshare(1) works): only then do pods get cluster DNS and their
    token at the standard path."""
    global _available
    if _available is None:
        try:
            _available = os.geteuid() == 0 and subprocess.run(
                ["unshare", "--mount", "--propagation", "private", "true"],
                capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            _available = False
    return _available


def hosts_text(services, ns, hostname, pod_ip):
    """/etc/hosts of a pod in namespace `ns`: itself, then every Service
    with a clusterIP as NAME.NS.svc.cluster.local, NAME.NS.svc, NAME.NS
    and, in its own namespace, NAME (what a pod's search path resolves).
    services: (namespace, name, clusterIP) triples."""
    lines = ["# Kubernetes-managed hosts file (cohort process kubelet).",
             "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             "%s\t%s" % (pod_ip, hostname)]
    for sns, name, ip in sorted(services):
        names = ["%s.%s.svc.cluster.local" % (name, sns), "%s.%s.svc" % (name, sns),
                 "%s.%s" % (name, sns)]
        if sns == ns:
            names.append(name)
        lines.append("%s\t%s" % (ip, " ".join(names)))
    return "\n".join(lines) + "\n"


def write_in_place(path, text):
    """Rewrites a file keeping its inode: a bind mount of it shows the new
    text (a rename would leave the mount on the old file)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    with os.fdopen(fd, "r+") as f:
        if f.read() == text:
            return
        f.seek(0)
        f.write(text)
        f.truncate()


def write_token_dir(secrets_dir, token, ca_pem, namespace):
    """<secrets_dir>/kubernetes.io/serviceaccount/{token,ca.crt,namespace},
    each replaced atomically (a reader never sees half a token); the
    directory is what is mounted, so replaced files show through."""
    d = os.path.join(secrets_dir, "kubernetes.io", "serviceaccount")
    os.makedirs(d, exist_ok=True)
    for name, data in (("token", token.encode()), ("ca.crt", ca_pem or b""),
                       ("namespace", namespace.encode())):
        tmp = os.path.join(d, ".%s.tmp" % name)
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(d, name))
    return d


CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
_libc = ctypes.CDLL(None, use_errno=True)
_unshare, _mount = _libc.unshare, _libc.mount


def preexec(hosts_file=None, secrets_dir=None):
    """A preexec_fn for subprocess.Popen that moves the child into a new
    mount namespace with the hosts file over /etc/hosts and the secrets
    directory over /run/secrets, or None when there is nothing to mount.
    It runs between fork and exec, so Popen returns only once the process
    runs the container's command in its namespace, as a runtime reports a
    container started only after setting it up (a signal sent at once
    reaches the command, not the set-up). Everything it calls is looked up
    here, before the fork; the child makes system calls only."""
    binds = []
    if hosts_file:
        binds.append((hosts_file.encode(), b"/etc/hosts"))
    if secrets_dir:
        os.makedirs(SECRETS_MOUNT, exist_ok=True)
        binds.append((secrets_dir.encode(), SECRETS_MOUNT.encode()))
    if not binds:
        return None

    def enter():
        if _unshare(CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed")
        if _mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
            raise OSError(ctypes.get_errno(), "making / private failed")
        for src, dst in binds:
            if _mount(src, dst, None, MS_BIND, None) != 0:
                raise OSError(ctypes.get_errno(), "bind mount failed")
    return enter
