"""--runtime podman: each container of a pod is a `podman run` of its
image, on the host's network (the pod's loopback address is still how its
processes bind: POD_IP from a fieldRef), with its volumes bind-mounted at
their mountPaths. What is shared with the process runtime (states,
back-off, probes, status, deletion) stays in pod.py; PodmanWorker
overrides the runtime's methods there.

A container is started attached (`podman run --log-driver=passthrough`,
its stdout and stderr the per-restart log file kubectl logs reads), so
the `podman run` process lives as long as the container and its exit
status is the container's. When it ends the kubelet reads the
container's state (`podman inspect`: did it start, its exit code, OOM)
and removes it. Signals go through `podman kill`, exec probes and preStop
hooks through `podman exec`. Every container carries the label
io.cohort.kubelet=<state dir>: the kubelet removes those left by an
earlier run when it starts, and its own when it stops.

No registry is reachable: images come from podman's store only (see
_prepare).
"""
import json
import os
import re
import signal
import subprocess
import time

from .common import log
from .pod import ConfigError, ImageError, PodWorker, expand_vars


PODMAN = "podman"
LABEL = "io.cohort.kubelet"
IMAGE_SH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "scripts",
                        "image.sh")

# Variables podman itself reads: a container's value for one of these goes
# on podman's command line. Every other value reaches the container through
# podman's environment (`-e NAME` alone), so Secrets in env stay off `ps`.
PODMAN_OWN_ENV = re.compile(r"^(PATH|HOME|TMPDIR|TZ|LANG|LC_\w*|XDG_\w*|CONTAINERS?_\w*|"
                            r"PODMAN_\w*|BUILDAH_\w*|STORAGE_\w*|REGISTRIES_\w*|DOCKER_\w*|"
                            r"GO\w*|LD_\w*|NOTIFY_SOCKET|DBUS_\w*|SSL_\w*|"
                            r"(?i:https?_proxy|no_proxy|all_proxy))$")

# The capabilities containerd gives a container beyond podman's defaults:
# Kubernetes pods get these unless they drop them.
CONTAINERD_EXTRA_CAPS = ("NET_RAW", "MKNOD", "AUDIT_WRITE")

# Seconds `podman exec` may take beyond a probe's or hook's timeout: starting
# the exec session is podman's cost, not the command's.
EXEC_SLACK = 5.0

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

# Volume kinds a kubelet always mounts read-only.
READ_ONLY_KINDS = ("secret", "configMap", "projected", "downwardAPI")

QUANTITY = re.compile(r"^([0-9.]+(?:[eE][-+]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")
SUFFIX = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
          "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50,
          "Ei": 2 ** 60}


def quantity(q):
    """A Kubernetes resource quantity ("500m", "64Mi", "1e3") as a float."""
    m = QUANTITY.match(str(q).strip())
    if not m:
        raise ConfigError("invalid quantity %r" % q)
    return float(m.group(1)) * SUFFIX[m.group(2)]


def containers_conf():
    """The containers.conf that scripts/image.sh --conf writes
    (build/podman/containers.conf: runc, cgroupfs, events in a file,
    ulimits below the hard limits), so that the image is built and run with
    one configuration; used when CONTAINERS_CONF names none."""
    try:
        r = subprocess.run([IMAGE_SH, "--conf"], capture_output=True, text=True, timeout=900,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemExit("kubelet: --runtime podman: %s --conf failed: %s" % (IMAGE_SH, e))
    if r.returncode != 0 or not r.stdout.strip():
        raise SystemExit("kubelet: --runtime podman: %s --conf failed: %s" %
                         (IMAGE_SH, (r.stderr or r.stdout).strip()[-1000:]))
    return r.stdout.strip().splitlines()[-1]


class PodmanRuntime:
    """The node's podman: its environment, its containers' label, and
    cleaning up."""

    name = "podman"
    os_image = "podman containers"

    def __init__(self, kubelet):
        self.k = kubelet
        self.env = dict(os.environ)
        if not self.env.get("CONTAINERS_CONF"):
            self.env["CONTAINERS_CONF"] = containers_conf()
        r = self.run("version", "--format", "{{.Client.Version}}")
        if r.returncode != 0:
            raise SystemExit("kubelet: --runtime podman: `podman version` failed: %s" %
                             (r.stderr.strip() or r.stdout.strip()))
        self.version = "podman://" + r.stdout.strip()
        self.label = kubelet.state_dir
        n = self.remove_all()
        if n:
            log("removed %d podman container(s) left by an earlier run" % n)

    def worker(self, kubelet, pod):
        return PodmanWorker(kubelet, pod, self)

    def run(self, *args, timeout=60, env=None):
        """One podman command, its output captured as text."""
        try:
            return subprocess.run([PODMAN, *args], env=env or self.env, capture_output=True,
                                  text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(e.cmd, 124, "", "timed out after %gs" % timeout)
        except OSError as e:
            return subprocess.CompletedProcess([PODMAN], 127, "", str(e))

    def ours(self):
        """The ids of every container that carries this kubelet's label."""
        r = self.run("ps", "-a", "-q", "--filter", "label=%s=%s" % (LABEL, self.label))
        return r.stdout.split() if r.returncode == 0 else []

    def remove_all(self, grace=0):
        """Stops (SIGTERM, then SIGKILL after grace) and removes every
        container of this kubelet's; how many there were."""
        ids = self.ours()
        if ids:
            if grace:
                self.run("stop", "-t", str(int(grace)), *ids, timeout=grace + 60)
            self.run("rm", "-f", "-t", "0", *ids, timeout=120)
        return len(ids)

    def shutdown(self, workers):
        """SIGTERM to every container, SIGKILL 5 s later, all removed: none
        may outlive the kubelet."""
        self.remove_all(grace=5)
        for w in workers:
            for c in w.containers:
                p = c.proc
                if p is not None:
                    try:
                        p.wait(10)
                    except subprocess.TimeoutExpired:
                        p.kill()
        self.remove_all()                  # any whose `podman run` was under way


class PodmanWorker(PodWorker):
    """A pod whose containers are podman containers."""

    def __init__(self, kubelet, pod, runtime):
        super().__init__(kubelet, pod)
        self.rt = runtime
        self.images = {}                   # container name -> its image's inspect

    def _cname(self, c):
        return "k8s_%s_%s_%s_%s_%d" % (c.name, self.name, self.ns, self.uid, c.instance)

    def _container_id(self, c):
        return "podman://" + self._cname(c)

    # -- image and security context ----------------------------------------

    def _prepare(self, c):
        """The image from podman's store, as imagePullPolicy allows: no
        registry is reachable, so a missing image cannot be pulled
        (ErrImagePull, then ImagePullBackOff; ErrImageNeverPull with
        Never); Always uses the stored image as IfNotPresent does. Then
        runAsNonRoot against the user the container will run as."""
        image = c.spec.get("image") or ""
        policy = c.spec.get("imagePullPolicy") or "IfNotPresent"
        if not image:
            raise ConfigError("container %s has no image" % c.name)
        r = self.rt.run("image", "inspect", "--format", "json", image)
        if r.returncode != 0:
            if policy == "Never":
                raise ImageError("ErrImageNeverPull", 'Container image "%s" is not present with '
                                 'pull policy of Never' % image)
            raise ImageError("ErrImagePull", 'Failed to pull image "%s": not in the node\'s '
                             'podman store, and this node reaches no registry (%s)' %
                             (image, r.stderr.strip().splitlines()[-1:] or "no such image"))
        try:
            info = json.loads(r.stdout)[0]
        except (ValueError, IndexError, KeyError):
            raise ImageError("ErrImagePull", 'image "%s": podman image inspect says %r' %
                             (image, r.stdout[:200]))
        self.images[c.name] = info
        c.image_id = "podman://" + info.get("Id", "")
        sc = self._security(c)
        if sc.get("runAsNonRoot"):
            self._check_non_root(c, sc, (info.get("Config") or {}).get("User") or "")

    def _security(self, c):
        """The container's securityContext over the pod's."""
        pod_sc = (self.pod.get("spec") or {}).get("securityContext") or {}
        sc = {k: pod_sc[k] for k in ("runAsUser", "runAsGroup", "runAsNonRoot",
                                     "seccompProfile") if k in pod_sc}
        sc.update(c.spec.get("securityContext") or {})
        return sc

    def _check_non_root(self, c, sc, image_user):
        """As the kubelet's verifyRunAsNonRoot."""
        if sc.get("runAsUser") is not None:
            if int(sc["runAsUser"]) == 0:
                raise ConfigError("container's runAsUser breaks non-root policy (pod: \"%s\", "
                                  "container: %s)" % (self.name, c.name))
            return
        user = image_user.split(":", 1)[0]
        if not user.isdigit() and user:
            raise ConfigError("container has runAsNonRoot and image has non-numeric user (%s), "
                              "cannot verify user is non-root (pod: \"%s\", container: %s)" %
                              (user, self.name, c.name))
        if not user or int(user) == 0:
            raise ConfigError("container has runAsNonRoot and image will run as root (pod: "
                              "\"%s\", container: %s)" % (self.name, c.name))

    def _security_args(self, c, sc):
        """securityContext and resource limits as podman flags."""
        args = []
        user, group = sc.get("runAsUser"), sc.get("runAsGroup")
        if user is not None or group is not None:
            if user is None:
                image_user = ((self.images.get(c.name) or {}).get("Config") or {}).get("User")
                user = (image_user or "0").split(":", 1)[0]
            args += ["--user", str(user) + ("" if group is None else ":%d" % int(group))]
        pod_sc = (self.pod.get("spec") or {}).get("securityContext") or {}
        for g in list(pod_sc.get("supplementalGroups") or []) + \
                ([pod_sc["fsGroup"]] if pod_sc.get("fsGroup") is not None else []):
            args += ["--group-add", str(int(g))]
        if sc.get("privileged"):
            args.append("--privileged")
        if sc.get("readOnlyRootFilesystem"):
            # Kubernetes mounts no tmpfs of its own on /tmp, /run, /var/tmp.
            args += ["--read-only", "--read-only-tmpfs=false"]
        if sc.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        seccomp = (sc.get("seccompProfile") or {}).get("type", "Unconfined")
        if seccomp == "Unconfined":        # a kubelet's default without SeccompDefault
            args += ["--security-opt", "seccomp=unconfined"]
        elif seccomp == "Localhost":
            raise ConfigError("seccompProfile Localhost is not supported by this kubelet")
        caps = sc.get("capabilities") or {}
        drop = [str(x).upper() for x in caps.get("drop") or []]
        add = [str(x).upper() for x in caps.get("add") or []]
        if "ALL" not in drop:
            add = [x for x in CONTAINERD_EXTRA_CAPS if x not in drop] + add
        for x in drop:
            args += ["--cap-drop", x]
        for x in add:
            args += ["--cap-add", x]
        limits = (c.spec.get("resources") or {}).get("limits") or {}
        if limits.get("memory") is not None:
            args += ["--memory", "%db" % int(quantity(limits["memory"]))]
        if limits.get("cpu") is not None:
            args += ["--cpus", "%.3f" % quantity(limits["cpu"])]
        return args

    # -- environment, volumes ---------------------------------------------------

    def _host_env(self, c):
        """A container gets only what --pass-env names from the kubelet's
        environment; its image gives PATH and HOME."""
        return {k: os.environ[k] for k in self.k.pass_env if k in os.environ}

    def _paths(self, c, text):
        return text                        # volumes are at their mountPaths

    def _volume_kind(self, name):
        for v in (self.pod.get("spec") or {}).get("volumes") or []:
            if v.get("name") == name:
                for kind in ("emptyDir", "hostPath") + READ_ONLY_KINDS:
                    if kind in v:
                        return kind
        return None

    def _setup_volumes(self):
        """As the process runtime, then as a kubelet does for a container's
        users: emptyDirs are mode 0777; with the pod's fsGroup, emptyDir,
        Secret and ConfigMap files belong to that group and gain 0440
        (0660 for emptyDirs), directories also 0110 and setgid, as the
        kubelet's SetVolumeOwnership does (whatever fsGroupChangePolicy)."""
        super()._setup_volumes()
        fs_group = ((self.pod.get("spec") or {}).get("securityContext") or {}).get("fsGroup")
        for name, d in self.volumes.items():
            kind = self._volume_kind(name)
            if kind == "emptyDir":
                os.chmod(d, 0o777)
            if fs_group is None or kind not in ("emptyDir", "secret", "configMap"):
                continue
            mask = 0o660 if kind == "emptyDir" else 0o440        # the kubelet's rw, ro masks
            for root, dirs, files in os.walk(d):
                os.chown(root, -1, int(fs_group))
                os.chmod(root, os.stat(root).st_mode & 0o7777 | mask | 0o110 | 0o2000)
                for f in files:
                    p = os.path.join(root, f)
                    os.chown(p, -1, int(fs_group))
                    os.chmod(p, os.stat(p).st_mode & 0o7777 | mask)

    def _mounts_cluster_files(self):
        return True                        # podman binds them, root or not

    def _mount_args(self, c):
        args = []
        for m in c.spec.get("volumeMounts") or []:
            name, dst = m.get("name"), m.get("mountPath")
            if name not in self.volumes or not dst:
                raise ConfigError('volume "%s" of mount %s not found' % (name, dst))
            src = self.volumes[name]
            sub = m.get("subPath")
            if sub:
                if os.path.isabs(sub) or ".." in sub.split("/"):
                    raise ConfigError("invalid subPath %s" % sub)
                src = os.path.join(src, sub)
                if not os.path.exists(src):
                    os.makedirs(src, exist_ok=True)
            if "," in src or "," in dst:
                raise ConfigError("mount %s: this kubelet cannot bind a path with a comma" % dst)
            ro = m.get("readOnly") or self._volume_kind(name) in READ_ONLY_KINDS
            args += ["--mount", "type=bind,source=%s,destination=%s%s" %
                     (src, dst, ",ro=true" if ro else "")]
        # Cluster DNS and the ServiceAccount token, where the kubelet makes
        # them (hosts_file, secrets_dir: the process runtime's, services.py).
        hosts = getattr(self, "hosts_file", None)
        if hosts and os.path.exists(hosts):
            args += ["--mount", "type=bind,source=%s,destination=/etc/hosts,ro=true" % hosts]
        secrets = getattr(self, "secrets_dir", None)
        sa = os.path.join(secrets or "", "kubernetes.io", "serviceaccount")
        if secrets and os.path.isdir(sa):
            args += ["--mount", "type=bind,source=%s,destination=%s,ro=true" % (sa, SA_DIR)]
        return args

    # -- containers -------------------------------------------------------------

    def _start(self, c):
        if self.k.stopping.is_set():       # nothing new once the kubelet stops
            return False
        return super()._start(c)

    def _plan(self, c, env):
        """The `podman run` flags and podman's environment for c. Command
        overrides the image's ENTRYPOINT (and drops its CMD), args override
        CMD, as in Kubernetes. Raises ConfigError."""
        sc = self._security(c)
        podman_env = dict(self.rt.env)
        args = ["--pull=never", "--network=host", "--log-driver=passthrough",
                "--hostname", (self.pod.get("spec") or {}).get("hostname") or self.name[:63],
                "--label", "%s=%s" % (LABEL, self.rt.label),
                "--label", "io.kubernetes.pod.name=" + self.name,
                "--label", "io.kubernetes.pod.namespace=" + self.ns,
                "--label", "io.kubernetes.pod.uid=" + self.uid,
                "--label", "io.kubernetes.container.name=" + c.name]
        for k, v in env.items():
            if PODMAN_OWN_ENV.match(k):
                args += ["--env", "%s=%s" % (k, v)]
            else:
                podman_env[k] = v
                args += ["--env", k]
        if c.spec.get("workingDir"):
            args += ["--workdir", c.spec["workingDir"]]
        args += self._security_args(c, sc)
        args += self._mount_args(c)
        command = [expand_vars(a, env) for a in c.spec.get("command") or []]
        cargs = [expand_vars(a, env) for a in c.spec.get("args") or []]
        if command:
            args += ["--entrypoint", json.dumps(command)]
        args += ["--", c.spec["image"]] + cargs
        return args, podman_env

    def _launch(self, c, env, logf, plan):
        """`podman run` of c, attached, its output into logf."""
        args, podman_env = plan
        return subprocess.Popen([PODMAN, "run", "--name", self._cname(c)] + args, env=podman_env,
                                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def _exit_info(self, c):
        """The container's end from podman's record of it: a container
        that never ran is a StartError (exit code 128) with podman's
        message, as a kubelet reports a failed create; then it is removed."""
        name = self._cname(c)
        r = self.rt.run("container", "inspect", "--format", "json", name)
        state = {}
        if r.returncode == 0:
            try:
                state = json.loads(r.stdout)[0].get("State") or {}
            except (ValueError, IndexError, AttributeError):
                state = {}
        self.rt.run("rm", "-f", "-t", "0", name)
        rc = c.proc.returncode
        if not state and rc not in (125, 126, 127):
            state = {"Status": "exited", "ExitCode": rc}      # removed before we looked
        if state.get("Status") == "exited":
            code = int(state.get("ExitCode", rc))
            term = {"exitCode": code, "reason": "OOMKilled" if state.get("OOMKilled") else
                    "Completed" if code == 0 else "Error"}
            for key, field in (("startedAt", "StartedAt"), ("finishedAt", "FinishedAt")):
                if state.get(field, "").startswith("20"):
                    term[key] = state[field][:19] + "Z"
            return term
        return {"exitCode": 128, "reason": "StartError",
                "message": self._podman_error(c) or "podman run exited with %d" % rc}

    def _podman_error(self, c):
        """podman's last "Error: " line in the log of c's run."""
        try:
            with open(c.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(c.log_path) - 4096))
                tail = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return None
        for line in reversed(tail):
            if line.startswith("Error: "):
                return line[len("Error: "):]
        return None

    def _signal(self, c, sig):
        """podman kill. SIGKILL is repeated until the `podman run` ends: a
        container still being created cannot be signalled yet."""
        if c.proc is None or c.proc.poll() is not None:
            return
        name = self._cname(c)
        if sig != signal.SIGKILL:
            self.rt.run("kill", "--signal", str(int(sig)), name)
            return
        deadline = time.monotonic() + 30
        while c.proc.poll() is None and time.monotonic() < deadline:
            if self.rt.run("kill", "--signal", "KILL", name).returncode != 0:
                self.rt.run("rm", "-f", "-t", "0", name)
            try:
                c.proc.wait(1)
            except subprocess.TimeoutExpired:
                pass
        if c.proc.poll() is None:
            log("%s/%s: podman run of %s does not end; killing it" % (self.ns, self.name, name))
            c.proc.kill()

    def _exec(self, c, command, timeout):
        """`podman exec` in the running container (its env, its user)."""
        if c.proc is None or c.proc.poll() is not None or not command:
            return None
        env = self._env(c)
        argv = [PODMAN, "exec", self._cname(c)] + [expand_vars(a, env) for a in command]
        try:
            proc = subprocess.Popen(argv, env=self.rt.env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        except OSError:
            return None
        try:
            # The command gets its timeout; podman's own start, EXEC_SLACK.
            return proc.wait(max(0.1, timeout) + EXEC_SLACK)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
