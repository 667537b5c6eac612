"""A process kubelet: runs the pods of the cohort API server stand-in as
local processes, for tests and the sandbox.

It talks to the API server only over HTTP, as a real kubelet does: it
registers a Node and renews its Lease in kube-node-lease, lists and watches
pods (re-listing after 410 Gone), and writes pod status through
pods/status. It also stands in for the scheduler: a pod with no nodeName
(and the default scheduler) is bound to this node through pods/binding.

For each pod on its node it:

- gives the pod its own loopback address, 127.0.0.2 upwards (reused after
  the pod is gone), and reports it as status.podIP/podIPs; hostIP is
  127.0.0.1. Processes are not confined to the address: they learn it from
  the environment (a fieldRef to status.podIP) and bind it themselves.
- runs init containers in order (each must exit 0 before the next starts),
  starts native sidecars (init containers with restartPolicy Always) and
  keeps them running, then starts the main containers;
- runs each container's command + args as a process in its own process
  group, resolved through PATH, with the container's env (value, fieldRef,
  configMapKeyRef, secretKeyRef, envFrom) and $(VAR) expansion, workingDir,
  and its stdout and stderr in a log file per container and restart;
- gives volumes a directory per pod: emptyDir under
  <state-dir>/pods/<uid>/volumes/<name>/, configMap and secret volumes
  filled from the API once, when the pod starts (a pod whose Secret or
  ConfigMap is missing waits, "MountVolume failed"), each key a file of
  its bytes with the volume's defaultMode or the item's mode, hostPath as
  is. As processes share one filesystem,
  a mountPath that appears in the command, args, env values or workingDir
  is replaced by the real directory, and every mounted volume is also
  exported as COHORT_VOLUME_<NAME> (upper-cased, '-' -> '_');
- restarts containers by the pod's restartPolicy (and sidecars always)
  with the kubelet's exponential back-off, reports restartCount, states,
  lastState and exit codes (128+signal for a signal, like a runtime);
- runs readiness, liveness and startup probes (exec, tcpSocket against the
  pod IP, httpGet), and reports the Ready, ContainersReady, Initialized,
  PodScheduled and PodReadyToStartContainers conditions and the phase;
- on deletion, runs preStop exec hooks, SIGTERMs the main containers, then
  the sidecars in reverse order, SIGKILLs whatever is left when the grace
  period ends, reports the exits, and removes the pod with a zero grace
  period delete, as the real kubelet does.

It serves container logs on an HTTP port named in its Node's
daemonEndpoints, so `kubectl logs` works through the API server.

It also does what kube-proxy and cluster DNS do for pods (services.py):
a TCP proxy on each Service's clusterIP:port to its ready endpoints, and,
as root, a hosts file per pod that names every Service, mounted over
/etc/hosts in each container process's own mount namespace, beside the
pod's ServiceAccount token at /var/run/secrets/kubernetes.io/
serviceaccount (from the TokenRequest API). isolation.py holds those
pieces apart from the process runtime, for other runtimes.

With --runtime podman each container is a `podman run` of its image
instead (podman.py): host network, volumes bind-mounted at their
mountPaths, the securityContext and limits mapped, images from the local
store only; everything else above is shared.

With --no-processes it runs nothing: every pod bound to it is reported
Running and Ready at once with an address from 10.244.0.0/16, and a pod
being deleted is removed at once. The operator benchmark uses this to
have hundreds of pods without hundreds of processes.

The parts, one module each:

    cli.py     flags, then running until SIGTERM and stopping every pod
    node.py    the Node and its Lease, the pod informer, binding, pod addresses
    pod.py     one pod: containers as processes, volumes, probes, status, deletion,
               its token
    podman.py  --runtime podman: the same pod, its containers podman containers
    services.py  the service proxy and cluster DNS (the hosts files)
    isolation.py the hosts file, the token directory, a process's mount namespace
    informer.py  list and watch with a cache (the controllers use it too)
    logs.py    /containerLogs, which the API server proxies pods/log to
    api.py     the API client (HTTP or HTTPS) and the kubeconfig reader
    common.py  the log line and the timestamp format

tests/kube/kubelet.py is the command:

    kubelet.py --kubeconfig build/sandbox/kubeconfig --logs-dir DIR
"""
from .cli import main

__all__ = ["main"]
