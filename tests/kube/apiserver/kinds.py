"""Defaults and validation of the workload and network kinds a Helm chart
creates: apps/v1 Deployments (with their pod template), v1 Services,
policy/v1 PodDisruptionBudgets, networking.k8s.io/v1 NetworkPolicies, and
the label selectors they share; and of resource.k8s.io/v1beta1
ResourceClaimTemplates, which the operator makes for GPU cohorts. Each check is one the real API server
makes (pkg/apis/*/validation), worded as it words it, so that what the
stand-in accepts a real cluster accepts too; what it does not check is
listed in docs/sandbox.md.

KINDS maps a resource type's key to (defaults(obj, old), validate(obj,
old) -> [FieldError]); store.py runs both on create and update.
"""
import copy
import re

from .common import DNS_LABEL, DNS_SUBDOMAIN, LABEL_NAME, LABEL_VALUE, go_value, is_int
from .errors import FieldError
from .strategies import pod_defaults, validate_pod

IANA_SVC_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
PERCENT = re.compile(r"^[0-9]+%$")
PROTOCOLS = ("SCTP", "TCP", "UDP")
FIELD_PATHS = ("metadata.name", "metadata.namespace", "metadata.uid", "metadata.labels",
               "metadata.annotations", "spec.nodeName", "spec.serviceAccountName",
               "status.hostIP", "status.hostIPs", "status.podIP", "status.podIPs")
# kubectl's "no selector" is this; the real server prints Go's %#v of it.
SELECTOR_WORDING = "v1.LabelSelector{MatchLabels:map[string]string(nil), MatchExpressions:[]v1." \
                   "LabelSelectorRequirement(nil)}"


def _port_name_errs(name, path):
    """validation.IsValidPortName: an IANA service name."""
    errs = []
    if len(name) > 15:
        errs.append(FieldError("Invalid", path, name, "must be no more than 15 characters"))
    if not IANA_SVC_NAME.match(name) or "--" in name:
        errs.append(FieldError("Invalid", path, name, "must contain only alpha-numeric characters "
                               "(a-z, 0-9), and hyphens (-)"))
    elif not re.search(r"[a-z]", name):
        errs.append(FieldError("Invalid", path, name, "must contain at least one letter (a-z)"))
    return errs


def _port_number_errs(port, path):
    if not is_int(port) or not 1 <= port <= 65535:
        return [FieldError("Invalid", path, port, "must be between 1 and 65535, inclusive")]
    return []


def _int_or_string_port_errs(port, path):
    if isinstance(port, str):
        return _port_name_errs(port, path)
    return _port_number_errs(port, path)


# -- label selectors ---------------------------------------------------------


def selector_errs(sel, path):
    """ValidateLabelSelector: keys and values, operators, and values only
    where the operator takes them."""
    errs = []
    if sel is None:
        return errs
    if not isinstance(sel, dict):
        return [FieldError("Invalid", path, sel, "must be a label selector")]
    for k, v in (sel.get("matchLabels") or {}).items():
        prefix, _, nm = k.rpartition("/")
        if not nm or len(nm) > 63 or not LABEL_NAME.match(nm) or \
                (prefix and not DNS_SUBDOMAIN.match(prefix)):
            errs.append(FieldError("Invalid", path + ".matchLabels", k, "name part must consist "
                                   "of alphanumeric characters, '-', '_' or '.'"))
        if not isinstance(v, str) or len(v) > 63 or not LABEL_VALUE.match(v):
            errs.append(FieldError("Invalid", path + ".matchLabels", v, "a valid label must be "
                                   "an empty string or consist of alphanumeric characters, '-', "
                                   "'_' or '.', and must start and end with an alphanumeric "
                                   "character"))
    for i, req in enumerate(sel.get("matchExpressions") or []):
        p = "%s.matchExpressions[%d]" % (path, i)
        if not isinstance(req, dict):
            errs.append(FieldError("Invalid", p, req, "must be an object"))
            continue
        op, values = req.get("operator"), req.get("values") or []
        if not req.get("key"):
            errs.append(FieldError("Required", p + ".key"))
        if op in ("In", "NotIn"):
            if not values:
                errs.append(FieldError("Required", p + ".values", detail="must be specified when "
                                       "`operator` is 'In' or 'NotIn'"))
        elif op in ("Exists", "DoesNotExist"):
            if values:
                errs.append(FieldError("Forbidden", p + ".values", detail="may not be specified "
                                       "when `operator` is 'Exists' or 'DoesNotExist'"))
        else:
            errs.append(FieldError("Invalid", p + ".operator", op, "not a valid selector "
                                   "operator"))
    return errs


def selector_matches(sel, labels):
    """Whether a LabelSelector selects an object with these labels."""
    labels = labels or {}
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for req in sel.get("matchExpressions") or []:
        k, op, vals = req.get("key"), req.get("operator"), req.get("values") or []
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and k in labels and labels[k] in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


def _empty_selector(sel):
    return not sel or (not sel.get("matchLabels") and not sel.get("matchExpressions"))


# -- pod templates -----------------------------------------------------------


def _container_errs(spec, path):
    """What validate_pod leaves out and a chart's pods use: ports, probes'
    ports, the fieldRef paths of env, the security context's numbers."""
    errs = []
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or []):
            if not isinstance(c, dict):
                continue
            p = "%s.%s[%d]" % (path, field, i)
            names = set()
            for j, port in enumerate(c.get("ports") or []):
                pp = "%s.ports[%d]" % (p, j)
                errs += _port_number_errs(port.get("containerPort"), pp + ".containerPort")
                if port.get("name"):
                    errs += _port_name_errs(port["name"], pp + ".name")
                    if port["name"] in names:
                        errs.append(FieldError("Duplicate", pp + ".name", port["name"]))
                    names.add(port["name"])
                if port.get("protocol", "TCP") not in PROTOCOLS:
                    errs.append(FieldError("NotSupported", pp + ".protocol", port["protocol"],
                                           'supported values: "SCTP", "TCP", "UDP"'))
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                pr = c.get(probe)
                if not isinstance(pr, dict):
                    continue
                handlers = [h for h in ("exec", "httpGet", "tcpSocket", "grpc") if pr.get(h)]
                if len(handlers) != 1:
                    errs.append(FieldError("Required", "%s.%s" % (p, probe), detail="must specify "
                                           "a handler type"))
                for h in ("httpGet", "tcpSocket"):
                    if isinstance(pr.get(h), dict):
                        errs += _int_or_string_port_errs(pr[h].get("port"),
                                                         "%s.%s.%s.port" % (p, probe, h))
                if probe != "readinessProbe" and pr.get("successThreshold", 1) != 1:
                    errs.append(FieldError("Invalid", "%s.%s.successThreshold" % (p, probe),
                                           pr["successThreshold"], "must be 1"))
            for j, e in enumerate(c.get("env") or []):
                ref = ((e.get("valueFrom") or {}).get("fieldRef") or {}) if isinstance(e, dict) \
                    else {}
                fp = ref.get("fieldPath")
                if ref and not (fp in FIELD_PATHS or
                                re.match(r"^metadata\.(labels|annotations)\['[^']+'\]$", fp or "")):
                    errs.append(FieldError("NotSupported", "%s.env[%d].valueFrom.fieldRef."
                                           "fieldPath" % (p, j), fp, "supported values: " +
                                           ", ".join(go_value(x) for x in FIELD_PATHS)))
            sc = c.get("securityContext") or {}
            for k in ("runAsUser", "runAsGroup"):
                if k in sc and (not is_int(sc[k]) or not 0 <= sc[k] <= 2147483647):
                    errs.append(FieldError("Invalid", "%s.securityContext.%s" % (p, k), sc[k],
                                           "must be between 0 and 2147483647, inclusive"))
            if sc.get("privileged") and sc.get("allowPrivilegeEscalation") is False:
                errs.append(FieldError("Invalid", p + ".securityContext", shown='"object"',
                                       detail="cannot set `allowPrivilegeEscalation` to false and "
                                       "`privileged` to true"))
    return errs


def template_errs(tmpl, path, restart_policies=("Always",)):
    """A PodTemplateSpec: its labels, its pod spec as a pod's (validate_pod,
    paths under `path`), and the restart policy the workload allows."""
    errs = []
    if not isinstance(tmpl, dict):
        return [FieldError("Required", path)]
    spec = tmpl.get("spec") or {}
    for e in validate_pod({"spec": spec}, None):
        e.field = path + "." + e.field
        errs.append(e)
    errs += _container_errs(spec, path + ".spec")
    rp = spec.get("restartPolicy")
    if rp in ("Always", "OnFailure", "Never") and rp not in restart_policies:
        errs.append(FieldError("NotSupported", path + ".spec.restartPolicy", rp,
                               "supported values: " + ", ".join(go_value(x)
                                                                for x in restart_policies)))
    return errs


# -- apps/v1 Deployment ------------------------------------------------------


def _percent_or_int(v):
    """(value, is_percent) of an IntOrString, or None when it is neither."""
    if is_int(v):
        return v, False
    if isinstance(v, str) and PERCENT.match(v):
        return int(v[:-1]), True
    return None


def deployment_defaults(obj, old):
    spec = obj.setdefault("spec", {})
    spec.setdefault("replicas", 1)
    spec.setdefault("revisionHistoryLimit", 10)
    spec.setdefault("progressDeadlineSeconds", 600)
    st = spec.setdefault("strategy", {})
    st.setdefault("type", "RollingUpdate")
    if st["type"] == "RollingUpdate":
        ru = st.setdefault("rollingUpdate", {})
        ru.setdefault("maxUnavailable", "25%")
        ru.setdefault("maxSurge", "25%")
    tmpl = spec.get("template")
    if isinstance(tmpl, dict):
        tmpl.setdefault("metadata", {})
        pod = {"spec": tmpl.setdefault("spec", {})}
        pod_defaults(pod)


def validate_deployment(obj, old):
    errs = []
    spec = obj.get("spec") or {}
    r = spec.get("replicas")
    if not is_int(r) or r < 0:
        errs.append(FieldError("Invalid", "spec.replicas", r, "must be greater than or equal "
                               "to 0"))
    sel = spec.get("selector")
    tmpl = spec.get("template")
    if sel is None:
        errs.append(FieldError("Required", "spec.selector"))
    elif _empty_selector(sel):
        errs.append(FieldError("Invalid", "spec.selector", shown=SELECTOR_WORDING,
                               detail="empty selector is invalid for deployment"))
    else:
        errs += selector_errs(sel, "spec.selector")
        labels = ((tmpl or {}).get("metadata") or {}).get("labels") if isinstance(tmpl, dict) \
            else None
        if not selector_matches(sel, labels):
            errs.append(FieldError("Invalid", "spec.template.metadata.labels",
                                   shown="map[string]string{%s}" % ", ".join(
                                       '"%s":"%s"' % kv for kv in sorted((labels or {}).items())),
                                   detail="`selector` does not match template `labels`"))
    errs += template_errs(tmpl, "spec.template")
    st = spec.get("strategy") or {}
    typ = st.get("type")
    if typ not in ("Recreate", "RollingUpdate"):
        errs.append(FieldError("NotSupported", "spec.strategy.type", typ,
                               'supported values: "Recreate", "RollingUpdate"'))
    elif typ == "Recreate" and st.get("rollingUpdate") is not None:
        errs.append(FieldError("Forbidden", "spec.strategy.rollingUpdate", detail="may not be "
                               "specified when strategy `type` is 'Recreate'"))
    elif typ == "RollingUpdate":
        ru = st.get("rollingUpdate") or {}
        got = {}
        for k in ("maxUnavailable", "maxSurge"):
            v = _percent_or_int(ru.get(k))
            if v is None:
                errs.append(FieldError("Invalid", "spec.strategy.rollingUpdate." + k, ru.get(k),
                                       "a valid percent string must be a numeric string followed "
                                       "by an ending '%'"))
            elif v[0] < 0:
                errs.append(FieldError("Invalid", "spec.strategy.rollingUpdate." + k, ru.get(k),
                                       "must be greater than or equal to 0"))
            elif k == "maxUnavailable" and v[1] and v[0] > 100:
                errs.append(FieldError("Invalid", "spec.strategy.rollingUpdate." + k, ru.get(k),
                                       "must not be greater than 100%"))
            got[k] = v
        if got.get("maxUnavailable") and got.get("maxSurge") and \
                got["maxUnavailable"][0] == 0 and got["maxSurge"][0] == 0:
            errs.append(FieldError("Invalid", "spec.strategy.rollingUpdate.maxUnavailable",
                                   ru.get("maxUnavailable"), "may not be 0 when `maxSurge` is 0"))
    if old is not None and (old.get("spec") or {}).get("selector") != sel:
        errs.append(FieldError("Invalid", "spec.selector", shown=SELECTOR_WORDING if not sel
                               else '"object"', detail="field is immutable"))
    return errs


# -- v1 Service --------------------------------------------------------------

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def service_defaults(obj, old):
    spec = obj.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    if spec["type"] != "ExternalName":
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        spec.setdefault("internalTrafficPolicy", "Cluster")
    for p in spec.get("ports") or []:
        if isinstance(p, dict):
            p.setdefault("protocol", "TCP")
            if spec["type"] != "ExternalName" and "port" in p:
                p.setdefault("targetPort", p["port"])


def validate_service(obj, old):
    errs = []
    name = (obj.get("metadata") or {}).get("name") or ""
    if name and (len(name) > 63 or not DNS_1035.match(name)):
        errs.append(FieldError("Invalid", "metadata.name", name, "a DNS-1035 label must consist "
                               "of lower case alphanumeric characters or '-', start with an "
                               "alphabetic character, and end with an alphanumeric character "
                               "(e.g. 'my-name',  or 'abc-123', regex used for validation is "
                               "'[a-z]([-a-z0-9]*[a-z0-9])?')"))
    spec = obj.get("spec") or {}
    typ = spec.get("type")
    if typ not in ("ClusterIP", "ExternalName", "LoadBalancer", "NodePort"):
        errs.append(FieldError("NotSupported", "spec.type", typ, 'supported values: '
                               '"ClusterIP", "ExternalName", "LoadBalancer", "NodePort"'))
    ports = spec.get("ports") or []
    if not ports and typ != "ExternalName" and spec.get("clusterIP") != "None":
        errs.append(FieldError("Required", "spec.ports"))
    names, seen = set(), set()
    for i, p in enumerate(ports):
        pp = "spec.ports[%d]" % i
        if not isinstance(p, dict):
            errs.append(FieldError("Invalid", pp, p, "must be an object"))
            continue
        n = p.get("name")
        if len(ports) > 1 and not n:
            errs.append(FieldError("Required", pp + ".name"))
        elif n:
            if not DNS_LABEL.match(n) or len(n) > 63:
                errs.append(FieldError("Invalid", pp + ".name", n, "a lowercase RFC 1123 label "
                                       "must consist of lower case alphanumeric characters or "
                                       "'-', and must start and end with an alphanumeric "
                                       "character"))
            if n in names:
                errs.append(FieldError("Duplicate", pp + ".name", n))
            names.add(n)
        errs += _port_number_errs(p.get("port"), pp + ".port")
        if p.get("protocol") not in PROTOCOLS:
            errs.append(FieldError("NotSupported", pp + ".protocol", p.get("protocol"),
                                   'supported values: "SCTP", "TCP", "UDP"'))
        if "targetPort" in p:
            errs += _int_or_string_port_errs(p["targetPort"], pp + ".targetPort")
        if (p.get("port"), p.get("protocol")) in seen:
            errs.append(FieldError("Duplicate", pp, shown="core.ServicePort{Name:\"%s\", "
                                   "Protocol:\"%s\", Port:%s}" % (n or "", p.get("protocol"),
                                                                  p.get("port"))))
        seen.add((p.get("port"), p.get("protocol")))
    for k, v in (spec.get("selector") or {}).items():
        if not isinstance(v, str):
            errs.append(FieldError("Invalid", "spec.selector", v, "must be a string"))
    if spec.get("sessionAffinity") not in ("ClientIP", "None"):
        errs.append(FieldError("NotSupported", "spec.sessionAffinity",
                               spec.get("sessionAffinity"), 'supported values: "ClientIP", '
                               '"None"'))
    return errs


# -- policy/v1 PodDisruptionBudget -------------------------------------------


def validate_pdb(obj, old):
    errs = []
    spec = obj.get("spec") or {}
    if spec.get("minAvailable") is not None and spec.get("maxUnavailable") is not None:
        errs.append(FieldError("Invalid", "spec", shown='"object"', detail="minAvailable and "
                               "maxUnavailable cannot be both set"))
    for k in ("minAvailable", "maxUnavailable"):
        if spec.get(k) is None:
            continue
        v = _percent_or_int(spec[k])
        if v is None:
            errs.append(FieldError("Invalid", "spec." + k, spec[k], "a valid percent string must "
                                   "be a numeric string followed by an ending '%'"))
        elif v[0] < 0:
            errs.append(FieldError("Invalid", "spec." + k, spec[k], "must be greater than or "
                                   "equal to 0"))
        elif v[1] and v[0] > 100:
            errs.append(FieldError("Invalid", "spec." + k, spec[k], "must not be greater than "
                                   "100%"))
    policy = spec.get("unhealthyPodEvictionPolicy")
    if policy is not None and policy not in ("AlwaysAllow", "IfHealthyBudget"):
        errs.append(FieldError("NotSupported", "spec.unhealthyPodEvictionPolicy", policy,
                               'supported values: "AlwaysAllow", "IfHealthyBudget"'))
    errs += selector_errs(spec.get("selector"), "spec.selector")
    return errs


# -- networking.k8s.io/v1 NetworkPolicy --------------------------------------


def _peer_errs(peer, path):
    if not isinstance(peer, dict):
        return [FieldError("Invalid", path, peer, "must be an object")]
    errs = []
    n = sum(1 for k in ("podSelector", "namespaceSelector", "ipBlock") if peer.get(k) is not None)
    if n == 0:
        errs.append(FieldError("Required", path, detail="must specify a peer"))
    elif peer.get("ipBlock") is not None and n > 1:
        errs.append(FieldError("Forbidden", path, detail="may not specify both ipBlock and "
                               "another peer"))
    for k in ("podSelector", "namespaceSelector"):
        errs += selector_errs(peer.get(k), "%s.%s" % (path, k))
    ip = peer.get("ipBlock")
    if ip is not None and not (ip or {}).get("cidr"):
        errs.append(FieldError("Required", path + ".ipBlock.cidr"))
    return errs


def _np_port_errs(port, path):
    errs = []
    if port.get("protocol", "TCP") not in PROTOCOLS:
        errs.append(FieldError("NotSupported", path + ".protocol", port["protocol"],
                               'supported values: "SCTP", "TCP", "UDP"'))
    p, end = port.get("port"), port.get("endPort")
    if p is not None:
        errs += _int_or_string_port_errs(p, path + ".port")
    if end is not None:
        if isinstance(p, str):
            errs.append(FieldError("Invalid", path + ".endPort", end, "may not be specified when "
                                   "`port` is non-numeric"))
        elif p is None:
            errs.append(FieldError("Required", path + ".port", detail="must be specified when "
                                   "`endPort` is specified"))
        elif _port_number_errs(end, ""):
            errs += _port_number_errs(end, path + ".endPort")
        elif is_int(p) and end < p:
            errs.append(FieldError("Invalid", path + ".endPort", end, "must be greater than or "
                                   "equal to `port`"))
    return errs


def networkpolicy_defaults(obj, old):
    spec = obj.setdefault("spec", {})
    spec.setdefault("podSelector", {})
    if "policyTypes" not in spec:
        spec["policyTypes"] = ["Ingress"] + (["Egress"] if spec.get("egress") else [])
    for direction in ("ingress", "egress"):
        for rule in spec.get(direction) or []:
            for port in (rule or {}).get("ports") or []:
                if isinstance(port, dict):
                    port.setdefault("protocol", "TCP")


def validate_networkpolicy(obj, old):
    errs = []
    spec = obj.get("spec") or {}
    errs += selector_errs(spec.get("podSelector"), "spec.podSelector")
    for direction, peers in (("ingress", "from"), ("egress", "to")):
        for i, rule in enumerate(spec.get(direction) or []):
            p = "spec.%s[%d]" % (direction, i)
            for j, port in enumerate((rule or {}).get("ports") or []):
                errs += _np_port_errs(port, "%s.ports[%d]" % (p, j))
            for j, peer in enumerate((rule or {}).get(peers) or []):
                errs += _peer_errs(peer, "%s.%s[%d]" % (p, peers, j))
    types = spec.get("policyTypes") or []
    for i, t in enumerate(types):
        if t not in ("Egress", "Ingress"):
            errs.append(FieldError("NotSupported", "spec.policyTypes[%d]" % i, t,
                                   'supported values: "Egress", "Ingress"'))
    if len(types) > 2:
        errs.append(FieldError("Invalid", "spec.policyTypes", shown='"array"', detail="may not "
                               "specify more than two policyTypes"))
    return errs


# -- resource.k8s.io/v1beta1 ResourceClaimTemplate ---------------------------

MAX_DEVICE_REQUESTS = 32
ALLOCATION_MODES = ("All", "ExactCount")


def claim_template_defaults(obj, old):
    """ResourceClaimTemplate's defaults (pkg/apis/resource/v1beta1):
    allocationMode ExactCount, and count 1 for it; and the template's
    metadata as Go writes an empty ObjectMeta back."""
    if isinstance(obj.get("spec"), dict):
        obj["spec"].setdefault("metadata", {"creationTimestamp": None})
    spec = ((obj.get("spec") or {}).get("spec") or {})
    for r in ((spec.get("devices") or {}).get("requests") or []):
        if isinstance(r, dict):
            r.setdefault("allocationMode", "ExactCount")
            if r["allocationMode"] == "ExactCount":
                r.setdefault("count", 1)


def validate_claim_template(obj, old):
    """ValidateResourceClaimTemplate, for what a claim's device requests
    say (selectors, constraints and configs are not checked), and its spec
    immutable on update."""
    errs = []
    spec = (obj.get("spec") or {}).get("spec")
    if not isinstance(spec, dict):
        spec = {}
    reqs = (spec.get("devices") or {}).get("requests") or []
    if len(reqs) > MAX_DEVICE_REQUESTS:
        errs.append(FieldError("TooMany", "spec.spec.devices.requests", len(reqs),
                               "must have at most %d items" % MAX_DEVICE_REQUESTS))
    names = set()
    for i, r in enumerate(reqs):
        p = "spec.spec.devices.requests[%d]" % i
        if not isinstance(r, dict):
            errs.append(FieldError("Invalid", p, r, "must be an object"))
            continue
        n = r.get("name")
        if not n:
            errs.append(FieldError("Required", p + ".name"))
        elif not isinstance(n, str) or len(n) > 63 or not DNS_LABEL.match(n):
            errs.append(FieldError("Invalid", p + ".name", n, "a lowercase RFC 1123 label must "
                                   "consist of lower case alphanumeric characters or '-', and "
                                   "must start and end with an alphanumeric character"))
        elif n in names:
            errs.append(FieldError("Duplicate", p + ".name", n))
        names.add(n)
        cls = r.get("deviceClassName")
        if not cls:
            errs.append(FieldError("Required", p + ".deviceClassName"))
        elif not isinstance(cls, str) or len(cls) > 253 or not DNS_SUBDOMAIN.match(cls):
            errs.append(FieldError("Invalid", p + ".deviceClassName", cls, "a lowercase RFC 1123 "
                                   "subdomain must consist of lower case alphanumeric "
                                   "characters, '-' or '.', and must start and end with an "
                                   "alphanumeric character"))
        mode = r.get("allocationMode")
        if mode not in ALLOCATION_MODES:
            errs.append(FieldError("NotSupported", p + ".allocationMode", mode,
                                   'supported values: "All", "ExactCount"'))
        elif mode == "ExactCount" and (not is_int(r.get("count")) or r["count"] <= 0):
            errs.append(FieldError("Invalid", p + ".count", r.get("count"),
                                   "must be greater than zero"))
        elif mode == "All" and r.get("count") not in (None, 0):
            errs.append(FieldError("Invalid", p + ".count", r.get("count"),
                                   "must not be specified when allocationMode is 'All'"))
    if old is not None and (old.get("spec") or {}) != (obj.get("spec") or {}):
        errs.append(FieldError("Invalid", "spec", shown='"object"', detail="field is immutable"))
    return errs


def _noop(obj, old):
    pass


KINDS = {
    ("apps", "deployments"): (deployment_defaults, validate_deployment),
    ("", "services"): (service_defaults, validate_service),
    ("policy", "poddisruptionbudgets"): (_noop, validate_pdb),
    ("networking.k8s.io", "networkpolicies"): (networkpolicy_defaults, validate_networkpolicy),
    ("resource.k8s.io", "resourceclaimtemplates"): (claim_template_defaults,
                                                    validate_claim_template),
}


def defaults_and_errors(rt, obj, old):
    """Applies the kind's defaults to obj and returns its field errors
    (an empty list for kinds this module does not know)."""
    d, v = KINDS.get(rt.key, (_noop, lambda o, old: []))
    d(obj, old)
    return v(obj, copy.deepcopy(old) if old is not None else None)
