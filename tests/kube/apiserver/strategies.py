"""Built-in strategies: the defaults and validation the real server applies
to pods, secrets, object metadata and CustomResourceDefinitions (whose
status it also writes).
"""
import base64
import binascii
import copy
import re

from .common import DNS_LABEL, DNS_SUBDOMAIN, LABEL_NAME, LABEL_VALUE, rfc3339
from .errors import FieldError, err_bad_request
from .schema import check_rules


def pod_qos(spec):
    conts = (spec.get("containers") or []) + (spec.get("initContainers") or [])
    any_set, guaranteed = False, True
    for c in conts:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        if req or lim:
            any_set = True
        for r in ("cpu", "memory"):
            if r not in lim or (r in req and str(req[r]) != str(lim[r])):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def pod_defaults(pod):
    spec = pod.setdefault("spec", {})
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    spec.setdefault("enableServiceLinks", True)
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        if isinstance(c, dict):
            img = c.get("image") or ""
            tagged = ":" in img.rsplit("/", 1)[-1] and not img.endswith(":latest")
            c.setdefault("imagePullPolicy", "IfNotPresent" if tagged or "@" in img else "Always")
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
            c.setdefault("resources", {})
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if isinstance(c.get(probe), dict):
                    pr = c[probe]
                    for k, v in (("timeoutSeconds", 1), ("periodSeconds", 10),
                                 ("successThreshold", 1), ("failureThreshold", 3)):
                        pr.setdefault(k, v)
                    if isinstance(pr.get("httpGet"), dict):
                        pr["httpGet"].setdefault("path", "/")
                        pr["httpGet"].setdefault("scheme", "HTTP")
            for port in c.get("ports") or []:
                if isinstance(port, dict):
                    port.setdefault("protocol", "TCP")
            for e in c.get("env") or []:
                ref = (e.get("valueFrom") or {}).get("fieldRef") if isinstance(e, dict) else None
                if isinstance(ref, dict):
                    ref.setdefault("apiVersion", "v1")


def secret_defaults(secret):
    """type defaults to Opaque; stringData is write-only, folded into data.
    data is []byte in the API, so a value that is not base64 fails to
    decode (400), before any validation."""
    secret.setdefault("type", "Opaque")
    data = secret.get("data")
    if data is not None and not isinstance(data, dict):
        raise err_bad_request("Secret in version \"v1\" cannot be handled as a Secret: data "
                              "must be an object")
    for k, v in (data or {}).items():
        try:
            if not isinstance(v, str):
                raise ValueError
            base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            raise err_bad_request("Secret in version \"v1\" cannot be handled as a Secret: "
                                  "illegal base64 data in data[%s]" % k)
    sd = secret.pop("stringData", None)
    if isinstance(sd, dict):
        data = secret.setdefault("data", {})
        for k, v in sd.items():
            data[k] = base64.b64encode(str(v).encode()).decode()


SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
SECRET_MAX = 1024 * 1024


def validate_secret(secret, old):
    """What the real server checks of a Secret: key names, 1 MiB of data,
    the keys a type requires, immutability."""
    errs = []
    data = secret.get("data") or {}
    for k in data:
        if len(k) > 253 or not SECRET_KEY.match(k) or k in (".", "..") or k.startswith(".."):
            errs.append(FieldError("Invalid", "data[%s]" % k, k, "a valid config key must "
                                   "consist of alphanumeric characters, '-', '_' or '.'"))
    if sum(len(base64.b64decode(v)) for v in data.values()) > SECRET_MAX:
        errs.append(FieldError("TooLong", "data", detail="Too long: may not be more than %d "
                               "bytes" % SECRET_MAX))
    typ = secret.get("type")
    required = {"kubernetes.io/tls": ("tls.crt", "tls.key"),
                "kubernetes.io/basic-auth": (), "kubernetes.io/ssh-auth": ("ssh-privatekey",),
                "kubernetes.io/dockerconfigjson": (".dockerconfigjson",)}.get(typ, ())
    for k in required:
        if k not in data:
            errs.append(FieldError("Required", "data[%s]" % k))
    if old is not None:
        if typ != old.get("type"):
            errs.append(FieldError("Invalid", "type", typ, "field is immutable"))
        if old.get("immutable") and (data != (old.get("data") or {}) or
                                     secret.get("immutable") is not True):
            errs.append(FieldError("Forbidden", "data", detail="field is immutable when "
                                   "`immutable` is set"))
    return errs


def validate_pod(pod, old):
    errs = []
    spec = pod.get("spec") or {}
    conts = spec.get("containers")
    if not conts:
        errs.append(FieldError("Required", "spec.containers"))
    names = set()
    vols = {v.get("name") for v in spec.get("volumes") or [] if isinstance(v, dict)}
    claims = set()
    for i, rc in enumerate(spec.get("resourceClaims") or []):
        p = "spec.resourceClaims[%d]" % i
        n = rc.get("name") if isinstance(rc, dict) else None
        if not n or not isinstance(n, str) or len(n) > 63 or not DNS_LABEL.match(n):
            errs.append(FieldError("Invalid", p + ".name", n, "a lowercase RFC 1123 label must "
                                   "consist of lower case alphanumeric characters or '-'"))
        elif n in claims:
            errs.append(FieldError("Duplicate", p + ".name", n))
        else:
            claims.add(n)
        if isinstance(rc, dict) and ("resourceClaimName" in rc) == \
                ("resourceClaimTemplateName" in rc):
            errs.append(FieldError("Invalid", p, shown='"object"', detail="must specify one of: "
                                   "`resourceClaimName`, `resourceClaimTemplateName`"))
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or []):
            p = "spec.%s[%d]" % (field, i)
            if not isinstance(c, dict):
                errs.append(FieldError("Invalid", p, c, "must be an object"))
                continue
            n = c.get("name")
            if not n:
                errs.append(FieldError("Required", p + ".name"))
            elif not DNS_LABEL.match(n) or len(n) > 63:
                errs.append(FieldError("Invalid", p + ".name", n, "a lowercase RFC 1123 label must "
                                       "consist of lower case alphanumeric characters or '-'"))
            elif n in names:
                errs.append(FieldError("Duplicate", p + ".name", n))
            names.add(n)
            if not c.get("image"):
                errs.append(FieldError("Required", p + ".image"))
            if field == "initContainers" and c.get("restartPolicy") not in (None, "Always"):
                errs.append(FieldError("NotSupported", p + ".restartPolicy", c["restartPolicy"],
                                       'supported values: "Always"'))
            if field == "containers" and c.get("restartPolicy") is not None:
                errs.append(FieldError("Forbidden", p + ".restartPolicy",
                                       detail="may not be set for non-init containers"))
            for j, m in enumerate(c.get("volumeMounts") or []):
                if m.get("name") not in vols:
                    errs.append(FieldError("NotFound", "%s.volumeMounts[%d].name" % (p, j),
                                           m.get("name")))
            for j, e in enumerate(c.get("env") or []):
                if not e.get("name"):
                    errs.append(FieldError("Required", "%s.env[%d].name" % (p, j)))
            for j, cl in enumerate((c.get("resources") or {}).get("claims") or []):
                if cl.get("name") not in claims:
                    errs.append(FieldError("NotFound", "%s.resources.claims[%d]" % (p, j),
                                           cl.get("name"), "must be one of the names in "
                                           "pod.spec.resourceClaims" +
                                           (": " + ", ".join(sorted(claims)) if claims else
                                            " which is empty")))
    if spec.get("restartPolicy") not in ("Always", "OnFailure", "Never"):
        errs.append(FieldError("NotSupported", "spec.restartPolicy", spec.get("restartPolicy"),
                               'supported values: "Always", "OnFailure", "Never"'))
    if old is not None:
        def masked(s):
            s = copy.deepcopy(s or {})
            for f in ("containers", "initContainers"):
                for c in s.get(f) or []:
                    if isinstance(c, dict):
                        c.pop("image", None)
            s.pop("activeDeadlineSeconds", None)
            s.pop("tolerations", None)
            return s
        if masked(spec) != masked(old.get("spec")):
            errs.append(FieldError("Forbidden", "spec", detail="pod updates may not change fields "
                                   "other than `spec.containers[*].image`,`spec.initContainers[*]"
                                   ".image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only "
                                   "additions to existing tolerations)"))
    return errs


def validate_meta(rt, obj, errs):
    meta = obj.get("metadata") or {}
    name = meta.get("name") or ""
    # Services' names are DNS-1035 labels, checked with their spec (kinds.py).
    label = rt.key == ("", "namespaces")
    if rt.key == ("", "services"):
        name = ""
    if rt.group == "rbac.authorization.k8s.io":
        # RBAC names are path segments (system:discovery), as
        # ValidateRBACName checks them.
        if name in (".", "..") or "/" in name or "%" in name:
            errs.append(FieldError("Invalid", "metadata.name", name,
                                   "may not be '.' or '..'" if name in (".", "..") else
                                   "may not contain '%s'" % ("/" if "/" in name else "%")))
    elif name and (len(name) > (63 if label else 253) or
                 not (DNS_LABEL if label else DNS_SUBDOMAIN).match(name)):
        errs.append(FieldError("Invalid", "metadata.name", name,
                               "a lowercase RFC 1123 %s must consist of lower case alphanumeric "
                               "characters, '-' or '.', and must start and end with an "
                               "alphanumeric character" % ("label" if label else "subdomain")))
    for k, v in (meta.get("labels") or {}).items():
        if not isinstance(v, str) or len(v) > 63 or not LABEL_VALUE.match(v):
            errs.append(FieldError("Invalid", "metadata.labels", v, "a valid label must be an "
                                   "empty string or consist of alphanumeric characters, '-', '_' "
                                   "or '.', and must start and end with an alphanumeric "
                                   "character"))
        prefix, _, nm = k.rpartition("/")
        if not nm or len(nm) > 63 or not LABEL_NAME.match(nm) or \
                (prefix and not DNS_SUBDOMAIN.match(prefix)):
            errs.append(FieldError("Invalid", "metadata.labels", k, "name part must consist of "
                                   "alphanumeric characters, '-', '_' or '.'"))
    for k, v in (meta.get("annotations") or {}).items():
        if not isinstance(v, str):
            errs.append(FieldError("Invalid", "metadata.annotations", v, "must be a string"))
    total = sum(len(k) + len(v) for k, v in (meta.get("annotations") or {}).items()
                if isinstance(v, str))
    if total > 256 * 1024:
        errs.append(FieldError("TooLong", "metadata.annotations", detail="may not be longer than "
                               "262144"))
    for i, ref in enumerate(meta.get("ownerReferences") or []):
        for f in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(f):
                errs.append(FieldError("Required", "metadata.ownerReferences[%d].%s" % (i, f)))
    if sum(1 for r in meta.get("ownerReferences") or [] if r.get("controller")) > 1:
        errs.append(FieldError("Invalid", "metadata.ownerReferences", shown='"array"',
                               detail="Only one reference can have Controller set to true"))
    for i, f in enumerate(meta.get("finalizers") or []):
        if not isinstance(f, str) or not f:
            errs.append(FieldError("Invalid", "metadata.finalizers[%d]" % i, f, "must be a "
                                   "qualified name"))


def validate_crd(crd):
    errs = []
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group = spec.get("group") or ""
    if not group:
        errs.append(FieldError("Required", "spec.group"))
    elif "." not in group:
        errs.append(FieldError("Invalid", "spec.group", group, "should be a domain with at least "
                               "one dot"))
    for f in ("plural", "kind"):
        if not names.get(f):
            errs.append(FieldError("Required", "spec.names." + f))
    if names.get("plural") and names["plural"] != names["plural"].lower():
        errs.append(FieldError("Invalid", "spec.names.plural", names["plural"],
                               "a lowercase RFC 1123 label"))
    want = "%s.%s" % (names.get("plural"), group)
    if (crd.get("metadata") or {}).get("name") != want:
        errs.append(FieldError("Invalid", "metadata.name", (crd.get("metadata") or {}).get("name"),
                               'must be spec.names.plural+"."+spec.group'))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        errs.append(FieldError("NotSupported", "spec.scope", spec.get("scope"),
                               'supported values: "Cluster", "Namespaced"'))
    versions = spec.get("versions") or []
    if not versions:
        errs.append(FieldError("Required", "spec.versions", detail="must have exactly one version "
                               "marked as storage version"))
    if sum(1 for v in versions if v.get("storage")) != 1:
        errs.append(FieldError("Invalid", "spec.versions", shown='"array"', detail="must have "
                               "exactly one version marked as storage version"))
    for i, v in enumerate(versions):
        p = "spec.versions[%d]" % i
        if not v.get("name"):
            errs.append(FieldError("Required", p + ".name"))
        schema = (v.get("schema") or {}).get("openAPIV3Schema")
        if not isinstance(schema, dict):
            errs.append(FieldError("Required", p + ".schema.openAPIV3Schema", detail="schemas are "
                                   "required"))
            continue
        if schema.get("type") != "object":
            errs.append(FieldError("Invalid", p + ".schema.openAPIV3Schema.type",
                                   schema.get("type"), 'must be object at the root'))
        check_rules(schema, p + ".schema.openAPIV3Schema", errs)
        scale = (v.get("subresources") or {}).get("scale")
        if scale:
            if not str(scale.get("specReplicasPath", "")).startswith(".spec."):
                errs.append(FieldError("Invalid", p + ".subresources.scale.specReplicasPath",
                                       scale.get("specReplicasPath"), "should be a json path "
                                       "under .spec"))
            if not str(scale.get("statusReplicasPath", "")).startswith(".status."):
                errs.append(FieldError("Invalid", p + ".subresources.scale.statusReplicasPath",
                                       scale.get("statusReplicasPath"), "should be a json path "
                                       "under .status"))
    if (spec.get("conversion") or {}).get("strategy", "None") != "None":
        errs.append(FieldError("NotSupported", "spec.conversion.strategy",
                               spec["conversion"]["strategy"], 'the cohort stand-in supports '
                               '"None" only'))
    return errs


def crd_defaults(crd):
    spec = crd.setdefault("spec", {})
    names = spec.setdefault("names", {})
    if names.get("kind"):
        names.setdefault("singular", names["kind"].lower())
        names.setdefault("listKind", names["kind"] + "List")
    spec.setdefault("scope", "Namespaced")
    spec.setdefault("conversion", {"strategy": "None"})


def crd_status(crd, old):
    spec = crd["spec"]
    now = rfc3339()
    old_status = (old or {}).get("status") or {}
    stored = list(old_status.get("storedVersions") or [])
    for v in spec.get("versions") or []:
        if v.get("storage") and v["name"] not in stored:
            stored.append(v["name"])
    prev = {c.get("type"): c for c in old_status.get("conditions") or []}

    def cond(t, reason, msg):
        c = prev.get(t)
        return {"type": t, "status": "True", "reason": reason, "message": msg,
                "lastTransitionTime": c["lastTransitionTime"] if c and c.get("status") == "True"
                else now}
    crd["status"] = {
        "acceptedNames": copy.deepcopy(spec["names"]),
        "conditions": [cond("NamesAccepted", "NoConflicts", "no conflicts found"),
                       cond("Established", "InitialNamesAccepted", "the initial names have been "
                            "accepted")],
        "storedVersions": stored,
    }
