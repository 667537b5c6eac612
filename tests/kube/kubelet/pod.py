"""One pod on this node: its containers (environment, volumes, restarts
with back-off), its probes, its conditions and status, and its deletion
(preStop hooks, SIGTERM, the grace period, SIGKILL).

PodWorker runs containers as local processes (path substitution, process
groups). What a container runtime does is in a few methods that
podman.py's PodmanWorker overrides: _prepare (the image), _host_env,
_paths, _launch, _exit_info, _signal, _exec, _container_id and
_setup_volumes; everything else (states, back-off, probes, status,
deletion) is shared.
"""
import base64
import calendar
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

from . import isolation
from .api import ApiError
from .common import log, rfc3339


PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ", "ASAN_OPTIONS", "UBSAN_OPTIONS",
              "LSAN_OPTIONS")


class ConfigError(Exception):
    """A container cannot start yet (CreateContainerConfigError)."""


class ImageError(Exception):
    """A container's image cannot be had (ErrImagePull, ErrImageNeverPull)."""

    def __init__(self, reason, message):
        super().__init__(message)
        self.reason = reason


class Container:
    """One container of a pod and its current process."""

    def __init__(self, spec, kind, index):
        self.spec = spec
        self.name = spec["name"]
        self.kind = kind                  # "init", "sidecar" or "main"
        self.index = index
        self.proc = None
        self.restarts = 0
        self.pending_restart = False
        self.instance = 0                 # how many times a process was started
        self.state = {"waiting": {"reason": "PodInitializing" if kind == "main" else
                                  "ContainerCreating"}}
        self.last_state = {}
        self.started = False              # startup probe passed (or none)
        self.ready = False
        self.done = False                 # will not run again
        self.exit_code = None
        self.started_at = None
        self.backoff_until = 0.0
        self.backoff = 0.0
        self.probe_state = {}             # probe kind -> [successes, failures, next due, running]
        self.log_path = None
        self.image_id = ""
        self.pull_failures = 0            # image pulls failed in a row

    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def status(self, container_id):
        st = {"name": self.name, "state": self.state, "lastState": self.last_state,
              "ready": self.ready, "restartCount": self.restarts,
              "image": self.spec.get("image", ""), "imageID": self.image_id,
              "started": self.started if "running" in self.state else False}
        if self.proc is not None:
            st["containerID"] = container_id
        return st


def probe_defaults(p):
    return {"initialDelaySeconds": p.get("initialDelaySeconds", 0),
            "periodSeconds": p.get("periodSeconds", 10) or 10,
            "timeoutSeconds": p.get("timeoutSeconds", 1) or 1,
            "successThreshold": p.get("successThreshold", 1) or 1,
            "failureThreshold": p.get("failureThreshold", 3) or 3}


def substitute_paths(text, mounts):
    """Rewrites container paths under a mountPath to the real directory."""
    if not isinstance(text, str):
        return text
    for mount_path, real in mounts:
        mp = mount_path.rstrip("/") or "/"
        text = re.sub(r"(?<![\w.\-/])" + re.escape(mp) + r"(?=/|$|[^\w.\-])",
                      lambda _m, real=real: real, text)
    return text


def expand_vars(text, env):
    """Kubernetes $(VAR) expansion: defined names are replaced, $$ escapes."""
    if not isinstance(text, str):
        return text

    def rep(m):
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)", rep, text)


class PodWorker(threading.Thread):
    """Drives one pod from first sight to removal."""

    TICK = 0.05

    def __init__(self, kubelet, pod):
        super().__init__(name="pod-" + pod["metadata"]["name"], daemon=True)
        k = kubelet
        self.k = k
        self.pod = pod
        self.uid = pod["metadata"]["uid"]
        self.ns = pod["metadata"]["namespace"]
        self.name = pod["metadata"]["name"]
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self.deleted = False               # gone from the API (DELETED event)
        self.ip = k.allocate_ip(self.uid)
        self.start_time = rfc3339()
        spec = pod.get("spec") or {}
        self.containers = []
        for i, c in enumerate(spec.get("initContainers") or []):
            self.containers.append(Container(c, "sidecar" if c.get("restartPolicy") == "Always"
                                             else "init", i))
        for i, c in enumerate(spec.get("containers") or []):
            self.containers.append(Container(c, "main", i))
        self.phase = "Pending"
        self.reason = None
        self.message = None
        self.initialized = False
        self.pod_dir = os.path.join(k.state_dir, "pods", self.uid)
        self.log_dir = os.path.join(k.logs_dir, "%s_%s_%s" % (self.ns, self.name, self.uid))
        self.volumes = {}                  # volume name -> real directory
        self.last_status = None
        self.terminating = False
        self.started_mono = time.monotonic()
        self.hosts_file = None             # cluster DNS: mounted over /etc/hosts
        self.secrets_dir = None            # the token's, mounted over /run/secrets
        self.token_refresh_at = None

    # -- inputs from the informer -----------------------------------------

    def update(self, pod):
        with self.lock:
            self.pod = pod
        self.changed.set()

    def gone(self):
        with self.lock:
            self.deleted = True
        self.changed.set()

    # -- environment --------------------------------------------------------

    def _field(self, path):
        pod = self.pod
        meta = pod.get("metadata") or {}
        m = re.match(r"^metadata\.(labels|annotations)\['([^']+)'\]$", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        table = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
                 "metadata.uid": meta.get("uid"), "spec.nodeName": self.k.node,
                 "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", ""),
                 "status.podIP": self.ip, "status.podIPs": self.ip, "status.hostIP": "127.0.0.1",
                 "status.hostIPs": "127.0.0.1"}
        if path not in table:
            raise ConfigError("unsupported fieldRef %s" % path)
        return table[path] or ""

    def _ref(self, kind, ref, key=None, raw=False):
        """A ConfigMap's or Secret's data (or one key of it), from the API:
        text for the environment, or bytes (raw) for a volume's files."""
        path = "/api/v1/namespaces/%s/%s/%s" % (self.ns, kind, ref.get("name"))
        try:
            obj = self.k.api.request("GET", path)
        except ApiError as e:
            if e.code == 404 and ref.get("optional"):
                return None
            raise ConfigError('%s "%s" not found' % (kind[:-1], ref.get("name")))
        data = dict(obj.get("data") or {})
        if kind == "secrets":
            data = {k: base64.b64decode(v) for k, v in data.items()}
        elif raw:
            data = {k: v.encode() for k, v in data.items()}
            data.update({k: base64.b64decode(v) for k, v in
                         (obj.get("binaryData") or {}).items()})
        if not raw:
            data = {k: v.decode("utf-8", "replace") if isinstance(v, bytes) else v
                    for k, v in data.items()}
        if key is None:
            return data
        if key not in data:
            if ref.get("optional"):
                return None
            raise ConfigError("couldn't find key %s in %s %s" % (key, kind[:-1], ref.get("name")))
        return data[key]

    def _mounts(self, c):
        return [(m["mountPath"], self._mount_source(m)) for m in c.spec.get("volumeMounts") or []
                if m.get("name") in self.volumes and m.get("mountPath")]

    def _mount_source(self, m):
        """The real directory behind a volumeMount: the volume's, or its
        subPath, made when missing as the kubelet makes it."""
        src = self.volumes[m["name"]]
        sub = m.get("subPath")
        if not sub:
            return src
        if os.path.isabs(sub) or ".." in sub.split("/"):
            raise ConfigError("invalid subPath %s" % sub)
        src = os.path.join(src, sub)
        os.makedirs(src, exist_ok=True)
        return src

    def _host_env(self, c):
        """What a process takes from the kubelet's environment and its
        volumes' real directories (a container takes neither)."""
        env = {k: os.environ[k] for k in PASSED_ENV + tuple(self.k.pass_env) if k in os.environ}
        for m in c.spec.get("volumeMounts") or []:
            if m.get("name") in self.volumes:
                env["COHORT_VOLUME_" + m["name"].upper().replace("-", "_")] = \
                    self._mount_source(m)
        return env

    def _paths(self, c, text):
        """A container path as the process sees it: under a mountPath, the
        volume's real directory."""
        return substitute_paths(text, self._mounts(c))

    def _env(self, c):
        env = self._host_env(c)
        env["HOSTNAME"] = self.name
        env["KUBERNETES_SERVICE_HOST"] = self.k.api.host
        env["KUBERNETES_SERVICE_PORT"] = str(self.k.api.port)
        for src in c.spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            for kind, field in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
                if field in src:
                    for k, v in (self._ref(kind, src[field]) or {}).items():
                        env[prefix + k] = v
        for e in c.spec.get("env") or []:
            name = e.get("name")
            if "value" in e:
                val = expand_vars(e.get("value") or "", env)
            elif "valueFrom" in e:
                vf = e["valueFrom"]
                if "fieldRef" in vf:
                    val = self._field(vf["fieldRef"].get("fieldPath", ""))
                elif "configMapKeyRef" in vf:
                    val = self._ref("configmaps", vf["configMapKeyRef"],
                                    vf["configMapKeyRef"]["key"])
                elif "secretKeyRef" in vf:
                    val = self._ref("secrets", vf["secretKeyRef"], vf["secretKeyRef"]["key"])
                elif "resourceFieldRef" in vf:
                    res = vf["resourceFieldRef"].get("resource", "")
                    val = str(((c.spec.get("resources") or {}).get(res.split(".")[0]) or {})
                              .get(res.split(".", 1)[-1], "0"))
                else:
                    val = ""
                if val is None:
                    continue
            else:
                val = ""
            env[name] = self._paths(c, val)
        return env

    def _argv(self, c, env):
        mounts = self._mounts(c)
        argv = list(c.spec.get("command") or []) + list(c.spec.get("args") or [])
        if not argv:
            raise FileNotFoundError("container %s has neither command nor args; a process "
                                    "kubelet has no image entrypoint to fall back to" % c.name)
        argv = [substitute_paths(expand_vars(a, env), mounts) for a in argv]
        exe = argv[0]
        if "/" not in exe:
            found = shutil.which(exe, path=env.get("PATH", os.defpath))
            if not found:
                raise FileNotFoundError('exec: "%s": executable file not found in $PATH' % exe)
            argv[0] = found
        return argv

    # -- volumes ------------------------------------------------------------

    def _setup_volumes(self):
        for v in (self.pod.get("spec") or {}).get("volumes") or []:
            name = v.get("name")
            if "hostPath" in v:
                self.volumes[name] = v["hostPath"].get("path", "/")
                continue
            if "persistentVolumeClaim" in v:
                self.volumes[name] = self._claim_dir(v["persistentVolumeClaim"])
                continue
            d = os.path.join(self.pod_dir, "volumes", name)
            os.makedirs(d, exist_ok=True)
            self.volumes[name] = d
            for kind, field, ref_name in (("configmaps", "configMap", "name"),
                                          ("secrets", "secret", "secretName")):
                if field in v:
                    self._fill_volume(d, kind, v[field], ref_name)

    def _claim_dir(self, src):
        """A persistentVolumeClaim as a directory of this node's that
        outlives the pods, one per namespace and claim name: no
        PersistentVolumeClaim object is read, nothing is bound or
        provisioned, capacity and access modes are not enforced, and the
        data is on this node alone (docs/operator.md)."""
        claim = src.get("claimName") or ""
        if not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", claim):
            raise ConfigError("invalid claimName %r" % claim)
        d = os.path.join(self.k.state_dir, "claims", self.ns, claim)
        os.makedirs(d, exist_ok=True)
        return d

    def _fill_volume(self, d, kind, src, ref_name):
        """Writes a ConfigMap's or Secret's keys as files, with the
        volume's defaultMode (0644 unless set) or an item's mode, as the
        kubelet's atomic writer does (here without its ..data symlink
        swap: the files are written once, when the pod starts)."""
        ref = {"name": src.get(ref_name), "optional": src.get("optional")}
        data = self._ref(kind, ref, raw=True) or {}
        mode = src.get("defaultMode", 0o644)
        files = {}
        for i in src.get("items") or [{"key": k, "path": k} for k in data]:
            if i["key"] not in data:
                if ref.get("optional"):
                    continue
                raise ConfigError("couldn't find key %s in %s %s" % (i["key"], kind[:-1],
                                                                   ref["name"]))
            rel = i.get("path") or i["key"]
            if os.path.isabs(rel) or ".." in rel.split("/"):
                raise ConfigError("invalid path %s in volume of %s %s" % (rel, kind[:-1],
                                                                        ref["name"]))
            files[rel] = (data[i["key"]], i.get("mode", mode))
        for rel, (content, fmode) in files.items():
            p = os.path.join(d, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            tmp = p + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(content)
            os.chmod(tmp, fmode & 0o777)
            os.replace(tmp, p)

    # -- the cluster, as the pod sees it ------------------------------------------

    def _mounts_cluster_files(self):
        """Whether this runtime can show the pod's processes its hosts file
        and token: processes need a mount namespace of their own (root)."""
        return isolation.available()

    def _setup_cluster_access(self):
        """Cluster DNS (a hosts file kept up to date by services.py) and the
        ServiceAccount token, when processes can get their own mount
        namespace (isolation.available()); runtimes mount them."""
        if not self._mounts_cluster_files() or not self.k.net:
            return
        if not self.hosts_file:
            self.hosts_file = os.path.join(self.pod_dir, "etc-hosts")
            os.makedirs(self.pod_dir, exist_ok=True)
            self.k.net.add_hosts(self.hosts_file, self.ns, self.name, self.ip)
        spec = self.pod.get("spec") or {}
        if spec.get("automountServiceAccountToken", True) is not False and not self.secrets_dir:
            if self._refresh_token():
                self.secrets_dir = os.path.join(self.pod_dir, "run-secrets")

    def _refresh_token(self):
        """A token of the pod's ServiceAccount bound to the pod, through the
        TokenRequest API as the kubelet gets it, refreshed at 80% of its
        life. Returns False when the ServiceAccount does not exist: the
        pod runs without a token (a real API server's ServiceAccount
        admission would have refused the pod; a stand-in without the
        controllers has no default ServiceAccounts). Any other refusal is
        a ConfigError: the pod waits, as one whose token volume cannot be
        made."""
        sa = (self.pod.get("spec") or {}).get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"audiences": [], "expirationSeconds": 3607,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                            "name": self.name, "uid": self.uid}}}
        try:
            tr = self.k.api.request("POST", "/api/v1/namespaces/%s/serviceaccounts/%s/token" %
                                    (self.ns, sa), body)
            token = tr["status"]["token"]
        except ApiError as e:
            if e.code == 404 and self.token_refresh_at is None:
                log('%s/%s: no serviceaccount "%s": no token mounted' % (self.ns, self.name, sa))
                return False
            raise ConfigError('cannot get a token for serviceaccount "%s": %s' % (sa, e))
        except (OSError, KeyError, TypeError) as e:
            raise ConfigError('cannot get a token for serviceaccount "%s": %s' % (sa, e))
        isolation.write_token_dir(os.path.join(self.pod_dir, "run-secrets"), token,
                                  self.k.api.ca_pem, self.ns)
        life = 3607.0
        try:
            exp = calendar.timegm(time.strptime(tr["status"]["expirationTimestamp"],
                                                "%Y-%m-%dT%H:%M:%SZ"))
            life = max(10.0, exp - time.time())
        except (KeyError, ValueError, TypeError):
            pass
        self.token_refresh_at = time.monotonic() + 0.8 * life
        return True

    def _tend_token(self, now):
        if self.token_refresh_at is not None and now >= self.token_refresh_at:
            try:
                self._refresh_token()
            except ConfigError as e:
                log("%s/%s: token refresh failed, retrying: %s" % (self.ns, self.name, e))
                self.token_refresh_at = now + 10

    # -- processes ------------------------------------------------------------

    def _prepare(self, c):
        """The image, before the container's configuration: a process
        kubelet has none to get. Raises ImageError or ConfigError."""

    def _plan(self, c, env):
        """What _launch needs beyond env, checked before anything starts:
        nothing for a process. Raises ConfigError."""

    def _launch(self, c, env, logf, plan):
        """Starts c with env, its output going to logf; returns an object
        with Popen's poll(), wait(), returncode and pid."""
        argv = self._argv(c, env)
        cwd = self._paths(c, c.spec.get("workingDir")) or None
        # The pod's hosts file and token directory, mounted in the process's
        # own mount namespace just before it runs its command.
        return subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=isolation.preexec(self.hosts_file, self.secrets_dir))

    def _container_id(self, c):
        return "cohort://%s-%s-%d" % (self.uid[:8], c.name, c.instance)

    def _start(self, c):
        """Starts c's process; on a start failure records it as exited."""
        try:
            self._prepare(c)
            env = self._env(c)
            plan = self._plan(c, env)
        except ImageError as e:
            # As the kubelet: ErrImagePull, then ImagePullBackOff while it
            # waits to try again, with the restart back-off's timings.
            c.pull_failures += 1
            reason = e.reason
            if reason == "ErrImagePull" and c.pull_failures > 1:
                reason = "ImagePullBackOff"
            delay = min(self.k.backoff_initial * 2 ** (c.pull_failures - 1), self.k.backoff_max)
            c.state = {"waiting": {"reason": reason, "message": str(e)}}
            c.backoff_until = time.monotonic() + (1.0 if e.reason != "ErrImagePull" else delay)
            return False
        except ConfigError as e:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            c.backoff_until = time.monotonic() + 1.0
            return False
        c.pull_failures = 0
        # restartCount counts container instances created after the first,
        # so it goes up when the restart happens, not when it is planned.
        if c.pending_restart:
            c.restarts += 1
            c.pending_restart = False
        c.instance += 1
        os.makedirs(os.path.join(self.log_dir, c.name), exist_ok=True)
        c.log_path = os.path.join(self.log_dir, c.name, "%d.log" % c.restarts)
        try:
            logf = open(c.log_path, "ab")
            try:
                c.proc = self._launch(c, env, logf, plan)
            finally:
                logf.close()
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            c.proc = None
            now = rfc3339()
            c.state = {"terminated": {"exitCode": 128, "reason": "StartError", "message": str(e),
                                      "startedAt": now, "finishedAt": now}}
            c.exit_code = 128
            log("%s/%s: container %s could not start: %s" % (self.ns, self.name, c.name, e))
            with open(c.log_path, "a") as f:
                f.write("cohort kubelet: cannot start: %s\n" % e)
            return False
        c.started_at = rfc3339()
        c.state = {"running": {"startedAt": c.started_at}}
        c.exit_code = None
        c.started = "startupProbe" not in c.spec
        c.ready = False
        c.probe_state = {}
        log("%s/%s: started container %s (pid %d, ip %s), log %s" %
            (self.ns, self.name, c.name, c.proc.pid, self.ip, c.log_path))
        return True

    def _exit_info(self, c):
        """The terminated state's exitCode, reason, and signal or message,
        of c's ended process."""
        rc = c.proc.returncode
        code = 128 - rc if rc < 0 else rc
        term = {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}
        if rc < 0:
            term["signal"] = -rc
        return term

    def _reap(self, c):
        """If c's process ended, records the exit; returns True then."""
        if c.proc is None or c.proc.poll() is None:
            return False
        term = self._exit_info(c)
        code = term["exitCode"]
        c.exit_code = code
        term.setdefault("startedAt", c.started_at)
        term.setdefault("finishedAt", rfc3339())
        term["containerID"] = self._container_id(c)
        c.state = {"terminated": term}
        c.ready = False
        c.proc = None
        log("%s/%s: container %s exited with %d" % (self.ns, self.name, c.name, code))
        return True

    def _signal(self, c, sig):
        if c.proc is not None and c.proc.poll() is None:
            try:
                os.killpg(c.proc.pid, sig)
            except ProcessLookupError:
                pass

    def _restartable(self, c):
        if c.kind == "sidecar":
            return True
        policy = (self.pod.get("spec") or {}).get("restartPolicy", "Always")
        if c.kind == "init":
            return policy != "Never" and c.exit_code != 0
        return policy == "Always" or (policy == "OnFailure" and c.exit_code != 0)

    def _schedule_restart(self, c):
        c.last_state = c.state
        c.pending_restart = True
        ran = time.monotonic() - (c.backoff_until or self.started_mono)
        if ran > 600:                      # ran fine for 10 minutes: back-off starts over
            c.backoff = 0
        c.backoff = self.k.backoff_initial if not c.backoff else min(c.backoff * 2,
                                                                     self.k.backoff_max)
        c.backoff_until = time.monotonic() + c.backoff
        c.state = {"waiting": {"reason": "CrashLoopBackOff",
                               "message": "back-off %gs restarting failed container=%s pod=%s_%s" %
                               (c.backoff, c.name, self.name, self.ns)}}

    # -- probes ---------------------------------------------------------------

    def _exec(self, c, command, timeout):
        """Runs command in c's environment (an exec probe, a preStop
        hook); its exit status, or None when it ran past timeout or could
        not start. Raises ConfigError when c's environment cannot be made."""
        env = self._env(c)
        argv = [self._paths(c, expand_vars(a, env)) for a in command]
        if argv and "/" not in argv[0]:
            argv[0] = shutil.which(argv[0], path=env.get("PATH")) or argv[0]
        try:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        except (OSError, ValueError):
            return None
        try:
            return proc.wait(max(0.1, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None

    def _probe_once(self, c, p):
        timeout = probe_defaults(p)["timeoutSeconds"]
        try:
            if "exec" in p:
                return self._exec(c, p["exec"].get("command") or [], timeout) == 0
            if "tcpSocket" in p:
                port = self._port(c, p["tcpSocket"].get("port"))
                host = p["tcpSocket"].get("host") or self.ip
                with socket.create_connection((host, port), timeout=timeout):
                    return True
            if "httpGet" in p:
                hg = p["httpGet"]
                port = self._port(c, hg.get("port"))
                conn = http.client.HTTPConnection(hg.get("host") or self.ip, port, timeout=timeout)
                try:
                    headers = {h["name"]: h["value"] for h in hg.get("httpHeaders") or []}
                    conn.request("GET", hg.get("path") or "/", headers=headers)
                    return 200 <= conn.getresponse().status < 400
                finally:
                    conn.close()
            if "grpc" in p:
                return False
        except (OSError, ConfigError, ValueError, http.client.HTTPException):
            return False
        return False

    def _port(self, c, port):
        if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
            return int(port)
        for cp in c.spec.get("ports") or []:
            if cp.get("name") == port:
                return int(cp["containerPort"])
        raise ValueError("no port named %r" % port)

    def _probes(self, c, now):
        """Runs due probes in threads; applies results. Returns True when a
        liveness probe says the container must be restarted."""
        restart = False
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            p = c.spec.get(kind)
            if not p:
                continue
            if kind != "startupProbe" and not c.started:
                continue
            if kind == "startupProbe" and c.started:
                continue
            d = probe_defaults(p)
            ps = c.probe_state.setdefault(kind, {"ok": 0, "fail": 0, "due": now +
                                                 d["initialDelaySeconds"], "result": None,
                                                 "busy": False})
            if ps["result"] is not None:
                ok, ps["result"] = ps["result"], None
                if ok:
                    ps["ok"], ps["fail"] = ps["ok"] + 1, 0
                else:
                    ps["ok"], ps["fail"] = 0, ps["fail"] + 1
                if kind == "startupProbe":
                    if ps["ok"] >= 1:
                        c.started = True
                    elif ps["fail"] >= d["failureThreshold"]:
                        restart = True
                elif kind == "livenessProbe" and ps["fail"] >= d["failureThreshold"]:
                    log("%s/%s: container %s failed its liveness probe" %
                        (self.ns, self.name, c.name))
                    restart = True
                elif kind == "readinessProbe":
                    if ps["ok"] >= d["successThreshold"]:
                        c.ready = True
                    elif ps["fail"] >= d["failureThreshold"]:
                        c.ready = False
            if not ps["busy"] and now >= ps["due"]:
                ps["busy"] = True
                ps["due"] = now + d["periodSeconds"]

                def run(ps=ps, p=p):
                    ps["result"] = self._probe_once(c, p)
                    ps["busy"] = False
                    self.changed.set()
                threading.Thread(target=run, daemon=True).start()
        if c.kind == "init":
            c.ready = False                 # ready once it has completed
        elif "readinessProbe" not in c.spec:
            c.ready = c.started and c.running()
        return restart

    # -- status ---------------------------------------------------------------

    def _conditions(self):
        now = rfc3339()
        mains = [c for c in self.containers if c.kind == "main"]
        sidecars = [c for c in self.containers if c.kind == "sidecar"]
        terminal = self.phase in ("Succeeded", "Failed")
        cready = not terminal and all(c.ready for c in mains + sidecars)
        ready = cready
        gates = [g.get("conditionType") for g in (self.pod.get("spec") or {}).get("readinessGates")
                 or []]
        foreign = [x for x in (self.pod.get("status") or {}).get("conditions") or []
                   if x.get("type") not in ("Ready", "ContainersReady", "Initialized",
                                            "PodScheduled", "PodReadyToStartContainers")]
        for g in gates:
            if not any(x.get("type") == g and x.get("status") == "True" for x in foreign):
                ready = False
        prev = {x.get("type"): x for x in (self.pod.get("status") or {}).get("conditions") or []}

        def cond(t, ok, reason=None):
            st = "True" if ok else "False"
            p = prev.get(t)
            c = {"type": t, "status": st, "lastProbeTime": None,
                 "lastTransitionTime": p["lastTransitionTime"] if p and p.get("status") == st and
                 p.get("lastTransitionTime") else now}
            if not ok and reason:
                c["reason"] = reason
            return c
        return [cond("PodReadyToStartContainers", not terminal),
                cond("Initialized", self.initialized, "ContainersNotInitialized"),
                cond("Ready", ready, "PodCompleted" if terminal else "ContainersNotReady"),
                cond("ContainersReady", cready, "PodCompleted" if terminal else
                     "ContainersNotReady"),
                cond("PodScheduled", True)] + foreign

    def _status(self):
        st = {"phase": self.phase, "conditions": self._conditions(),
              "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
              "podIP": self.ip, "podIPs": [{"ip": self.ip}], "startTime": self.start_time,
              "qosClass": (self.pod.get("status") or {}).get("qosClass", "BestEffort"),
              "containerStatuses": [c.status(self._container_id(c)) for c in self.containers
                                    if c.kind == "main"]}
        inits = [c.status(self._container_id(c)) for c in self.containers if c.kind != "main"]
        if inits:
            st["initContainerStatuses"] = inits
        if self.reason:
            st["reason"] = self.reason
        if self.message:
            st["message"] = self.message
        return st

    def _push(self, force=False):
        st = self._status()
        cmp = json.dumps(st, sort_keys=True)
        cmp = re.sub(r'"lastTransitionTime": "[^"]*"', "", cmp)
        if not force and cmp == self.last_status:
            return
        for _ in range(5):
            try:
                got = self.k.api.request(
                    "PATCH", "/api/v1/namespaces/%s/pods/%s/status" % (self.ns, self.name),
                    [{"op": "test", "path": "/metadata/uid", "value": self.uid},
                     {"op": "add", "path": "/status", "value": st}],
                    "application/json-patch+json")
                with self.lock:
                    # The informer may have delivered a newer pod meanwhile
                    # (say, with a deletionTimestamp): never go back to an older one.
                    if int(got["metadata"]["resourceVersion"]) > \
                            int(self.pod["metadata"].get("resourceVersion") or 0):
                        self.pod = got
                self.last_status = cmp
                return
            except ApiError as e:
                if e.code == 404 or (e.code == 422 and "test" in str(e)):
                    return                  # the pod is gone, or is another pod by that name
                log("%s/%s: status update failed: %s" % (self.ns, self.name, e))
                time.sleep(0.2)
            except OSError as e:
                log("%s/%s: status update failed: %s" % (self.ns, self.name, e))
                time.sleep(0.5)

    # -- the pod's life -------------------------------------------------------

    def run(self):
        try:
            self._run()
        except Exception as e:             # never leave processes behind a crashed worker
            import traceback
            traceback.print_exc()
            log("%s/%s: worker failed: %s" % (self.ns, self.name, e))
            for c in self.containers:
                self._signal(c, signal.SIGKILL)
        finally:
            if self.hosts_file and self.k.net:
                self.k.net.remove_hosts(self.hosts_file)
            self.k.worker_done(self)

    def _deadline_exceeded(self):
        ads = (self.pod.get("spec") or {}).get("activeDeadlineSeconds")
        return ads is not None and time.monotonic() - self.started_mono > ads

    def _run(self):
        os.makedirs(self.log_dir, exist_ok=True)
        while True:
            try:
                self._setup_volumes()
                self._setup_cluster_access()
                break
            except ConfigError as e:
                self.message = "MountVolume failed: %s" % e
                self._push()
                if self.changed.wait(1.0):
                    self.changed.clear()
                if self.deleted or self.pod["metadata"].get("deletionTimestamp"):
                    return self._terminate()
        self.message = None
        self._push()
        while True:
            with self.lock:
                deleting = self.deleted or bool(self.pod["metadata"].get("deletionTimestamp"))
            if deleting:
                return self._terminate()
            if self.phase in ("Succeeded", "Failed"):
                self._push()
                # A finished pod keeps its status until someone deletes it.
                self.changed.wait(1.0)
                self.changed.clear()
                continue
            if self._deadline_exceeded():
                self.reason, self.message = "DeadlineExceeded", "Pod was active on the node " \
                    "longer than the specified deadline"
                self._stop_all(min(self._grace(), 30))
                self.phase = "Failed"
                self._push()
                continue
            self._step()
            self._push()
            if self.changed.wait(self.TICK):
                self.changed.clear()

    def _step(self):
        now = time.monotonic()
        self._tend_token(now)
        if not self.initialized:
            # Init containers in order: a regular one must exit 0, a sidecar
            # must be started, before the next one starts.
            for c in self.containers:
                if c.kind == "main":
                    break
                if c.kind == "init" and c.done:
                    continue
                self._tend(c, now)
                if self.phase == "Failed":
                    return
                if (c.kind == "sidecar" and c.started and c.running()) or \
                        (c.kind == "init" and c.done):
                    continue
                return                      # this one is not through yet
            self.initialized = True
        # Once the pod is initialized, sidecars are restarted on their own
        # and never hold up the main containers.
        for c in self.containers:
            if c.kind == "sidecar":
                self._tend(c, now)
        mains = [c for c in self.containers if c.kind == "main"]
        for c in mains:
            self._tend(c, now)
        if any(c.running() for c in mains):
            self.phase = "Running"
        if all(c.done for c in mains):
            self._stop_sidecars(self._grace())
            self.phase = "Succeeded" if all(c.exit_code == 0 for c in mains) else "Failed"

    def _tend(self, c, now):
        """Starts, watches, probes and restarts one container."""
        if c.done:
            return
        if c.proc is None:
            if now < c.backoff_until:
                return
            if "terminated" in c.state and c.exit_code is not None and not self._restartable(c):
                c.done = True
                if c.kind == "init":
                    self._init_failed(c)
                return
            if "terminated" in c.state and c.exit_code is not None:
                self._schedule_restart(c)
                return
            if not self._start(c):
                if c.exit_code is not None and not self._restartable(c):
                    c.done = True
                    if c.kind == "init":
                        self._init_failed(c)
                elif c.exit_code is not None:
                    self._schedule_restart(c)
                return
        if self._reap(c):
            if c.kind == "init" and c.exit_code == 0:
                c.done = True
                c.ready = True
            return
        if self._probes(c, now):
            self._signal(c, signal.SIGTERM)
            self._wait([c], time.monotonic() + self._grace())
            self._signal(c, signal.SIGKILL)
            if c.proc is not None:
                c.proc.wait()
            self._reap(c)

    def _init_failed(self, c):
        self.phase = "Failed"
        self.reason = None
        self.message = "init container %s failed with exit code %s" % (c.name, c.exit_code)
        self._stop_sidecars(self._grace())

    def _grace(self):
        m = self.pod["metadata"]
        if m.get("deletionGracePeriodSeconds") is not None:
            return float(m["deletionGracePeriodSeconds"])
        return float((self.pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30))

    def _wait(self, conts, deadline):
        while time.monotonic() < deadline and any(c.running() for c in conts):
            time.sleep(0.02)
        for c in conts:
            self._reap(c)

    def _pre_stop(self, c, deadline):
        hook = ((c.spec.get("lifecycle") or {}).get("preStop") or {})
        if "exec" in hook and c.running():
            try:
                self._exec(c, hook["exec"].get("command") or [], deadline - time.monotonic())
            except ConfigError:
                pass
        elif "sleep" in hook and c.running():
            time.sleep(min(float(hook["sleep"].get("seconds", 0)),
                           max(0.0, deadline - time.monotonic())))

    def _stop(self, conts, deadline):
        """preStop, SIGTERM, wait until the deadline; the caller kills."""
        live = [c for c in conts if c.running()]
        for c in live:
            self._pre_stop(c, deadline)
            self._signal(c, signal.SIGTERM)
        self._wait(live, deadline)
        for c in conts:
            c.done = True

    def _stop_sidecars(self, grace):
        deadline = time.monotonic() + grace
        for c in reversed([c for c in self.containers if c.kind == "sidecar"]):
            self._stop([c], deadline)
        self._kill_all()

    def _stop_all(self, grace):
        deadline = time.monotonic() + grace
        self._stop([c for c in self.containers if c.kind in ("main", "init")], deadline)
        for c in reversed([c for c in self.containers if c.kind == "sidecar"]):
            self._stop([c], deadline)
        self._kill_all()

    def _kill_all(self):
        for c in self.containers:
            if c.running():
                log("%s/%s: grace period over; killing container %s" %
                    (self.ns, self.name, c.name))
                self._signal(c, signal.SIGKILL)
        for c in self.containers:
            if c.proc is not None:
                c.proc.wait()
                self._reap(c)

    def _terminate(self):
        grace = self._grace()
        log("%s/%s: stopping (grace period %gs)" % (self.ns, self.name, grace))
        self.terminating = True
        self._stop_all(grace)
        mains = [c for c in self.containers if c.kind == "main"]
        if self.phase not in ("Succeeded", "Failed"):
            self.phase = "Succeeded" if mains and all(c.exit_code == 0 for c in mains) else "Failed"
        if not self.deleted:
            self._push()
            try:
                self.k.api.request("DELETE", "/api/v1/namespaces/%s/pods/%s" % (self.ns, self.name),
                                   {"kind": "DeleteOptions", "apiVersion": "v1",
                                    "gracePeriodSeconds": 0,
                                    "preconditions": {"uid": self.uid}})
            except ApiError as e:
                if e.code not in (404, 409):
                    log("%s/%s: final delete failed: %s" % (self.ns, self.name, e))
        shutil.rmtree(self.pod_dir, ignore_errors=True)
        log("%s/%s: stopped" % (self.ns, self.name))


class ProcessRuntime:
    """Pods as local processes: the kubelet's default runtime."""

    name = "process"
    version = "cohort-processes://1"
    os_image = "local processes"
    worker = PodWorker

    def __init__(self, kubelet):
        self.k = kubelet

    def shutdown(self, workers):
        """Stops every pod's processes: they must not outlive the kubelet."""
        for w in workers:
            for c in w.containers:
                w._signal(c, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for w in workers:
            for c in w.containers:
                while c.running() and time.monotonic() < deadline:
                    time.sleep(0.02)
                w._signal(c, signal.SIGKILL)
