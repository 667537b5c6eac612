"""A Kubernetes API server stand-in for cohort's tests and sandbox.

There is no Kubernetes on the project's machines, so the operator, the
process kubelet (tests/kube/kubelet/) and the real kubectl 1.32 talk to
this server instead. It aims at the semantics a controller depends on, not at
scale: one process, objects in memory, one lock.

What it implements, and how faithfully:

- Storage: one global resourceVersion counter (a growing integer, served as
  a string) like etcd's revision; per object uid, creationTimestamp,
  generation (bumped only when something outside metadata and status
  changes), deletionTimestamp and finalizers. Writes that change nothing are
  not written, so they neither bump resourceVersion nor make watch events.
- Reads: get, list with label and field selectors, limit/continue pages that
  are one consistent snapshot (rebuilt from the event history), and
  resourceVersion / resourceVersionMatch on lists.
- Watch: ?watch=true from a resourceVersion, newline-delimited JSON events
  over chunked HTTP, ADDED/MODIFIED/DELETED as a selector sees them
  (an object that stops matching is DELETED for that watcher), BOOKMARK
  events every --bookmark-interval when asked for, timeoutSeconds, the
  streaming-list form (sendInitialEvents), and an in-stream ERROR event with
  a 410 Status when the resourceVersion is older than the retained history
  (--history-size events, global like etcd's compaction).
- Writes: POST (with generateName), PUT with a resourceVersion precondition
  (409 Conflict when stale), PATCH as JSON merge patch (RFC 7386), JSON patch
  (RFC 6902) and, for built-in kinds, a strategic merge patch with the merge
  keys kubectl needs; DELETE with preconditions, propagationPolicy
  (Background, Foreground, Orphan), pod grace periods, and deletecollection.
- Subresources: status (the main endpoint ignores status, /status changes
  only status), scale (autoscaling/v1 Scale mapped through the CRD's paths),
  pods/binding (the kubelet stand-in schedules through it), pods/log (proxied
  to the kubelet stand-in, like the real server does).
- Garbage collection: background cascading deletion by ownerReference uid,
  foreground and orphan propagation, namespace termination, CRD cleanup.
- CustomResourceDefinitions: creating one serves its resources; schemas are
  enforced (pruning, defaults, types, required, bounds, enum, pattern,
  formats, list types) and x-kubernetes-validations run through a small CEL
  evaluator (cel.py says exactly which subset).
- kubectl support: legacy and aggregated (apidiscovery.k8s.io/v2) discovery,
  /version, OpenAPI v3 documents that advertise fieldValidation (so kubectl
  leaves validation to this server), Table output from the CRD's
  additionalPrinterColumns and for pods, and fieldValidation=Strict/Warn.
- TLS (tls.py): --tls makes a CA and a serving certificate (or
  --tls-cert-file and --tls-private-key-file), and --client-ca-file
  verifies client certificates.
- Authentication (authn.py): a client certificate (CN user, O groups), the
  admin token (--token, --token-file re-read on change; group
  system:masters), ServiceAccount tokens from the TokenRequest subresource
  (kubectl create token) that expire and end with their ServiceAccount; 401
  for anything else. With no token flag and no RBAC any token is the
  admin, as older tests expect.
- Authorization (rbac.py): --authorization-mode RBAC evaluates Roles,
  ClusterRoles and their bindings as the rbac authorizer does, answers the
  real 403 Status, creates the default discovery roles, and records which
  rule allowed each request (/debug/cohort/rbac);
  --enable-admission-plugins OwnerReferencesPermissionEnforcement.

Everything it leaves out is listed in docs/sandbox.md. Only the Python 3
standard library is used, so it runs on a bare Debian machine.

The parts, one module each:

    cli.py         flags, the kubeconfig and port file, serving
    server.py      HTTP(S): routing, bodies, watches, pods/log, /debug/cohort
    tls.py         serving and client certificates, CAs for tests
    authn.py       who a request is: certificates, admin token, ServiceAccount tokens
    rbac.py        RBAC: request attributes, rules and bindings, 403s, default roles
    store.py       objects, resourceVersions, list pages, watch history, writes, GC
    discovery.py   /version, discovery, OpenAPI v3
    tables.py      Table output (kubectl get columns)
    resources.py   what each served kind is, built-in and from CRDs
    strategies.py  built-in kinds' defaults and validation (pods, metadata, CRDs)
    schema.py      CRD structural schemas: pruning, defaults, validation, rules
    cel.py         the CEL evaluator for x-kubernetes-validations
    patch.py       merge patch, JSON patch, strategic merge patch
    selection.py   label and field selectors, JSONPath
    protobuf.py    the protobuf request bodies kubectl's generators send
    errors.py      ApiError (a metav1.Status) and FieldError
    common.py      time, JSON and name formats

tests/kube/apiserver.py is the command:

    apiserver.py [--port 0] [--port-file F] [--kubeconfig F] [--token T]
                 [--tls] [--client-ca-file F] [--authorization-mode RBAC]
                 [--service-ip-block B]
"""
from .cel import CelError, cel_compile, cel_eval
from .cli import main
from .server import Server
from .store import Store

__all__ = ["CelError", "Server", "Store", "cel_compile", "cel_eval", "main"]
