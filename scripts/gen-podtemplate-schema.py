#!/usr/bin/env python3
"""Turns io.k8s.api.core.v1.PodTemplateSpec from a Kubernetes OpenAPI v3
document (the kubernetes repository's api/openapi-spec/v3/api__v1_openapi.json,
or what a server serves at /openapi/v3/api/v1) into a structural CRD schema,
as controller-gen does for a Go type that embeds corev1.PodTemplateSpec:

- every $ref resolved in place (PodSpec does not recurse; a cycle is an error);
- descriptions dropped, to keep the CRD under the API server's limits;
- defaults dropped (the API server defaults the pod when the operator creates
  it), except on list-map keys that are not required: a structural schema
  needs each key required or defaulted (containerPort's protocol: TCP);
- int-or-string and Quantity become x-kubernetes-int-or-string, Quantity
  with its pattern; Time becomes a date-time string;
- the list-type, list-map-keys, map-type and required markers kept; patch
  strategies, enums, GVKs and unions dropped (Deployment's pod template is
  checked for those by Go code, not by its schema);
- the template's metadata keeps labels and annotations as string maps and
  x-kubernetes-preserve-unknown-fields for the rest of ObjectMeta, so the
  API server prunes nothing from it (a bare `type: object` would prune all).

On that schema it lays what cohort itself adds (OVERLAY: the template's
description, spec required, the reserved sidecar name, at most 32 containers)
and writes it, as YAML, between the BEGIN and END lines of each CRD named.
It also writes spec.checkpoint.volume (between the BEGIN VOLUME and END
VOLUME lines): the same schema's Volume, less its name (the operator names
it) and the sources Kubernetes mounts read-only (configMap, secret,
downwardAPI, projected, image), with exactly one source required:


  scripts/gen-podtemplate-schema.py OPENAPI.json crds/trainingcohorts.cohort.dev.yaml \
      charts/cohort/crds/trainingcohorts.cohort.dev.yaml

The input used for the committed CRD is Kubernetes 1.32's /openapi/v3/api/v1
(sha256 in SOURCE below). With no CRD named, it prints the schema as JSON.
With --from-crd CRD.yaml in place of OPENAPI.json it takes the template's
schema from that CRD's generated block (for a change to the overlays alone).
"""
import json
import sys

QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
KEEP = ("type", "format", "items", "properties", "additionalProperties", "required",
        "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type")
REF = "#/components/schemas/"


def special(name):
    if name == "io.k8s.apimachinery.pkg.util.intstr.IntOrString":
        return {"x-kubernetes-int-or-string": True,
                "anyOf": [{"type": "integer"}, {"type": "string"}]}
    if name == "io.k8s.apimachinery.pkg.api.resource.Quantity":
        return {"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN,
                "anyOf": [{"type": "integer"}, {"type": "string"}]}
    if name in ("io.k8s.apimachinery.pkg.apis.meta.v1.Time",
                "io.k8s.apimachinery.pkg.apis.meta.v1.MicroTime"):
        return {"type": "string", "format": "date-time"}
    if name == "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta":
        strmap = {"type": "object", "additionalProperties": {"type": "string"}}
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                "properties": {"labels": strmap, "annotations": dict(strmap)}}
    return None


def convert(node, schemas, stack):
    ref = node.get("$ref")
    all_of = node.get("allOf")
    if all_of and len(all_of) == 1 and "$ref" in all_of[0]:
        ref = all_of[0]["$ref"]
    if ref:
        name = ref[len(REF):]
        got = special(name)
        if got is not None:
            return got
        if name in stack:
            raise SystemExit("gen-podtemplate-schema: %s refers to itself" % name)
        return convert(schemas[name], schemas, stack + (name,))
    if node.get("format") == "int-or-string":
        return special("io.k8s.apimachinery.pkg.util.intstr.IntOrString")
    out = {}
    for k in KEEP:
        if k not in node:
            continue
        v = node[k]
        if k == "items":
            v = convert(v, schemas, stack)
        elif k == "additionalProperties" and isinstance(v, dict):
            v = convert(v, schemas, stack)
        elif k == "properties":
            v = {p: convert(s, schemas, stack) for p, s in sorted(v.items())}
        out[k] = v
    if out.get("type") == "array" and out.get("x-kubernetes-list-type") == "map":
        req = set(out["items"].get("required") or [])
        props = out["items"].get("properties") or {}
        for key in out.get("x-kubernetes-list-map-keys") or []:
            sub = node.get("items") or {}
            sub = schemas[(sub.get("allOf") or [sub])[0].get("$ref", REF)[len(REF):]] \
                if (sub.get("allOf") or sub.get("$ref")) else sub
            dflt = (sub.get("properties") or {}).get(key, {}).get("default")
            if key not in req and dflt is not None:
                props[key]["default"] = dflt
            elif key not in req:
                raise SystemExit("gen-podtemplate-schema: list-map key %s has no default" % key)
    if "type" not in out and "properties" in out:
        out["type"] = "object"
    return out


SOURCE = ("Kubernetes 1.32 /openapi/v3/api/v1, sha256 "
          "e70786b2b36d53fa99dd72910f2ef82a12384abc8d28ce144ebc9899c32b109c")
BEGIN = "# BEGIN generated by scripts/gen-podtemplate-schema.py"
END = "# END generated by scripts/gen-podtemplate-schema.py"
BEGIN_VOLUME = "# BEGIN VOLUME generated by scripts/gen-podtemplate-schema.py"
END_VOLUME = "# END VOLUME generated by scripts/gen-podtemplate-schema.py"
# Volume sources a pod can only read: no place for checkpoints.
READ_ONLY_SOURCES = ("configMap", "secret", "downwardAPI", "projected", "image")


def overlay(schema):
    """What cohort adds to the pod template: the operator injects a
    container named cohort-sidecar, so a trainer container may not take it."""
    schema["description"] = (
        "The trainer pod, as in a Deployment, validated by Kubernetes 1.32's "
        "PodTemplateSpec schema. The operator adds the sidecar (a native sidecar "
        "init container named cohort-sidecar), a shared emptyDir for the trainer's "
        "socket, labels and an owner reference.")
    schema["required"] = ["spec"]
    spec = schema["properties"]["spec"]
    spec["x-kubernetes-validations"] = [{
        "rule": "self.containers.all(c, c.name != 'cohort-sidecar')",
        "message": "the container name cohort-sidecar is reserved for the injected sidecar",
        "fieldPath": ".containers"}]
    containers = spec["properties"]["containers"]
    containers["minItems"] = 1
    containers["maxItems"] = 32
    name = containers["items"]["properties"]["name"]
    name["minLength"] = 1
    name["maxLength"] = 63
    return schema


def volume_source(template):
    """spec.checkpoint.volume: the template's Volume without its name and
    the read-only sources, one source exactly (the API server's Go code
    checks that for a pod's volumes; here the schema must)."""
    vol = json.loads(json.dumps(template["properties"]["spec"]["properties"]["volumes"]["items"]))
    props = vol["properties"]
    for k in ("name",) + READ_ONLY_SOURCES:
        props.pop(k, None)
    vol.pop("required", None)
    vol["minProperties"] = 1
    vol["maxProperties"] = 1
    vol["description"] = (
        "Where checkpoints are kept: one Kubernetes volume source (persistentVolumeClaim, "
        "hostPath, nfs, emptyDir, csi, ephemeral, ...), as in a pod's volumes less the name "
        "and the read-only sources (configMap, secret, downwardAPI, projected, image). "
        "Mounted into every sidecar at /var/lib/cohort/checkpoints with subPath "
        "NAMESPACE/NAME, so cohorts sharing a volume never mix. Only a volume that outlives "
        "the pods (a PVC, hostPath, nfs, ...) lets a cohort resume after all its pods are "
        "gone; an emptyDir is lost with its pod.")
    return vol


def scalar(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    if isinstance(v, str) and v and all(c.isalnum() or c in "-_." for c in v) \
            and not v[0].isdigit() and v not in ("true", "false", "null", "yes", "no", "on",
                                                 "off", "y", "n"):
        return v
    return json.dumps(v)


def to_yaml(v, indent):
    """Block YAML for dicts, flow for lists of scalars; strings quoted
    whenever plain YAML could read them as something else."""
    pad = " " * indent
    lines = []
    if isinstance(v, dict):
        for k, x in v.items():
            if isinstance(x, dict) and x:
                lines.append("%s%s:" % (pad, k))
                lines += to_yaml(x, indent + 2)
            elif isinstance(x, list) and x and isinstance(x[0], dict):
                lines.append("%s%s:" % (pad, k))
                for item in x:
                    sub = to_yaml(item, indent + 4)
                    lines.append(pad + "  - " + sub[0].lstrip())
                    lines += sub[1:]
            elif isinstance(x, list):
                lines.append("%s%s: [%s]" % (pad, k, ", ".join(scalar(i) for i in x)))
            elif isinstance(x, dict):
                lines.append("%s%s: {}" % (pad, k))
            else:
                lines.append("%s%s: %s" % (pad, k, scalar(x)))
    return lines


def splice(path, schema, begin=BEGIN, end=END):
    with open(path) as f:
        lines = f.read().split("\n")
    starts = [i for i, ln in enumerate(lines) if ln.strip() == begin]
    ends = [i for i, ln in enumerate(lines) if ln.strip() == end]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise SystemExit("gen-podtemplate-schema: %s needs one %s line and one %s line "
                         "after it" % (path, begin, end))
    indent = len(lines[starts[0]]) - len(lines[starts[0]].lstrip())
    body = ["%s# From %s." % (" " * indent, SOURCE)] + to_yaml(schema, indent)
    lines[starts[0] + 1:ends[0]] = body
    with open(path, "w") as f:
        f.write("\n".join(lines))


def template_from_crd(path):
    """The template's schema as a CRD's generated block holds it (overlay
    included, which overlay() sets again to the same values)."""
    import yaml
    with open(path) as f:
        crd = yaml.safe_load(f)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["template"]


def main(argv):
    if len(argv) < 2:
        sys.stderr.write("usage: gen-podtemplate-schema.py OPENAPI.json|--from-crd CRD.yaml [CRD.yaml...]\n")
        return 2
    if argv[1] == "--from-crd" and len(argv) >= 3:
        schema = template_from_crd(argv[2])
        argv = argv[1:]
    else:
        with open(argv[1]) as f:
            schemas = json.load(f)["components"]["schemas"]
        root = "io.k8s.api.core.v1.PodTemplateSpec"
        schema = convert(schemas[root], schemas, (root,))
    if len(argv) == 2:
        json.dump(schema, sys.stdout, indent=1, sort_keys=True)
        sys.stdout.write("\n")
        return 0
    schema = overlay(schema)
    volume = volume_source(schema)
    for path in argv[2:]:
        splice(path, schema)
        splice(path, volume, BEGIN_VOLUME, END_VOLUME)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
