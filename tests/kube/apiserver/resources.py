"""Resource types: what each served kind is (group, versions, names,
scope, subresources, field labels, schemas), for the built-in kinds and
for a CRD's kind.
"""
import re


COMMON_FIELD_LABELS = ("metadata.name", "metadata.namespace")


def version_priority(v):
    """Kubernetes version ordering: GA > beta > alpha, then by numbers."""
    m = re.match(r"^v(\d+)(?:(alpha|beta)(\d+))?$", v)
    if not m:
        return (3, 0, 0, v)
    rank = {None: 0, "beta": 1, "alpha": 2}[m.group(2)]
    return (rank, -int(m.group(1)), -int(m.group(3) or 0), v)


class ResourceType:
    """One served resource: a built-in kind or a CRD's kind."""

    def __init__(self, group, versions, kind, plural, singular, namespaced, short_names=(),
                 categories=(), status=False, scale=None, crd=None, field_labels=(),
                 unconditional_update=True, schemas=None, columns=None, storage=None):
        self.group = group
        self.versions = sorted(versions, key=version_priority)   # served, preferred first
        self.storage_version = storage or self.versions[0]
        self.kind = kind
        self.list_kind = kind + "List"
        self.plural = plural
        self.singular = singular
        self.namespaced = namespaced
        self.short_names = list(short_names)
        self.categories = list(categories)
        self.status = status              # bool, or {version: bool} for CRDs
        self.scale = scale                # {specReplicasPath, ...} or per version
        self.crd = crd                    # the CRD object (None for built-ins)
        self.field_labels = set(COMMON_FIELD_LABELS) | set(field_labels)
        self.unconditional_update = unconditional_update
        self.schemas = schemas or {}      # version -> openAPIV3Schema
        self.columns = columns or {}      # version -> additionalPrinterColumns
        self.extra_subresources = []      # ("binding", "Binding", verbs) ...
        # metadata.generation exists only where the kind's strategy sets it
        # (custom resources, CRDs, workloads); ConfigMaps, Pods (before
        # 1.33), Leases and the like have none.
        self.generation = crd is not None

    @property
    def key(self):
        return (self.group, self.plural)

    @property
    def qualified(self):
        return self.plural + ("." + self.group if self.group else "")

    def gv(self, version=None):
        v = version or self.storage_version
        return "%s/%s" % (self.group, v) if self.group else v

    def has_status(self, version=None):
        if isinstance(self.status, dict):
            return self.status.get(version or self.storage_version, False)
        return self.status

    def scale_paths(self, version=None):
        if self.crd is not None:
            return self.scale.get(version or self.storage_version) if self.scale else None
        return self.scale

    def schema(self, version=None):
        return self.schemas.get(version or self.storage_version)


# Served only when named in --runtime-config, as Kubernetes 1.32 serves
# its beta resource.k8s.io API only with --runtime-config (and the
# DynamicResourceAllocation feature gate).
OPTIONAL_APIS = ("resource.k8s.io/v1beta1",)


def builtin_types(runtime_config=()):
    """The built-in types, with the optional APIs named in runtime_config
    (group/version strings)."""
    T = ResourceType
    pods = T("", ["v1"], "Pod", "pods", "pod", True, ["po"], ["all"], status=True,
             field_labels=("spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
                           "spec.serviceAccountName", "spec.hostNetwork", "status.phase",
                           "status.podIP", "status.nominatedNodeName"))
    pods.extra_subresources = [("binding", "", "v1", "Binding", ["create"]),
                               ("log", "", "v1", "Pod", ["get"])]
    serviceaccounts = T("", ["v1"], "ServiceAccount", "serviceaccounts", "serviceaccount", True,
                        ["sa"])
    serviceaccounts.extra_subresources = [("token", "authentication.k8s.io", "v1", "TokenRequest",
                                           ["create"])]
    return [
        T("", ["v1"], "Namespace", "namespaces", "namespace", False, ["ns"], status=True,
          field_labels=("status.phase",)),
        pods,
        T("", ["v1"], "Event", "events", "event", True, ["ev"],
          field_labels=("involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                        "involvedObject.uid", "involvedObject.apiVersion",
                        "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
                        "reportingComponent", "source", "type")),
        T("", ["v1"], "ConfigMap", "configmaps", "configmap", True, ["cm"]),
        T("", ["v1"], "Secret", "secrets", "secret", True, field_labels=("type",)),
        T("", ["v1"], "Service", "services", "service", True, ["svc"], ["all"], status=True),
        serviceaccounts,
        T("", ["v1"], "Endpoints", "endpoints", "endpoints", True, ["ep"]),
        T("", ["v1"], "Node", "nodes", "node", False, ["no"], status=True,
          field_labels=("spec.unschedulable",)),
        T("apps", ["v1"], "Deployment", "deployments", "deployment", True, ["deploy"], ["all"],
          status=True, scale={"specReplicasPath": ".spec.replicas",
                              "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": "spec.selector"}),
        T("coordination.k8s.io", ["v1"], "Lease", "leases", "lease", True),
        T("apiextensions.k8s.io", ["v1"], "CustomResourceDefinition", "customresourcedefinitions",
          "customresourcedefinition", False, ["crd", "crds"], ["api-extensions"], status=True),
        T("rbac.authorization.k8s.io", ["v1"], "Role", "roles", "role", True),
        T("rbac.authorization.k8s.io", ["v1"], "RoleBinding", "rolebindings", "rolebinding", True),
        T("rbac.authorization.k8s.io", ["v1"], "ClusterRole", "clusterroles", "clusterrole", False),
        T("rbac.authorization.k8s.io", ["v1"], "ClusterRoleBinding", "clusterrolebindings",
          "clusterrolebinding", False),
        T("policy", ["v1"], "PodDisruptionBudget", "poddisruptionbudgets", "poddisruptionbudget",
          True, ["pdb"], status=True),
        T("networking.k8s.io", ["v1"], "NetworkPolicy", "networkpolicies", "networkpolicy", True,
          ["netpol"]),
        T("autoscaling", ["v2"], "HorizontalPodAutoscaler", "horizontalpodautoscalers",
          "horizontalpodautoscaler", True, ["hpa"], ["all"], status=True),
    ] + ([T("resource.k8s.io", ["v1beta1"], "ResourceClaimTemplate", "resourceclaimtemplates",
            "resourceclaimtemplate", True)] if "resource.k8s.io/v1beta1" in runtime_config else [])


def type_from_crd(crd):
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    served = [v for v in spec.get("versions") or [] if v.get("served")]
    storage = next((v["name"] for v in spec.get("versions") or [] if v.get("storage")), None)
    rt = ResourceType(spec["group"], [v["name"] for v in served] or [storage], names["kind"],
                      names["plural"], names.get("singular") or names["kind"].lower(),
                      spec.get("scope", "Namespaced") == "Namespaced",
                      names.get("shortNames") or [],
                      names.get("categories") or [], crd=crd, unconditional_update=False,
                      storage=storage)
    rt.list_kind = names.get("listKind") or names["kind"] + "List"
    rt.status = {v["name"]: "status" in (v.get("subresources") or {}) for v in served}
    rt.scale = {v["name"]: (v.get("subresources") or {}).get("scale") for v in served}
    rt.schemas = {v["name"]: (v.get("schema") or {}).get("openAPIV3Schema") for v in served}
    rt.columns = {v["name"]: v.get("additionalPrinterColumns") for v in served}
    return rt
