"""Patches: RFC 7386 merge patch, RFC 6902 JSON patch, and the strategic
merge patch that kubectl sends for built-in kinds.
"""
import copy

from .common import dumps


class PatchError(Exception):
    pass


def merge_patch(target, patch):
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            result.pop(k, None)
        else:
            result[k] = merge_patch(result.get(k), v)
    return result


def _pointer(path):
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError("invalid JSON pointer %r" % path)
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc, parts):
    cur = doc
    for p in parts:
        if isinstance(cur, dict):
            if p not in cur:
                raise PatchError("doc is missing path: /%s" % "/".join(parts))
            cur = cur[p]
        elif isinstance(cur, list):
            if not p.isdigit() or int(p) >= len(cur):
                raise PatchError("doc is missing path: /%s" % "/".join(parts))
            cur = cur[int(p)]
        else:
            raise PatchError("doc is missing path: /%s" % "/".join(parts))
    return cur


def _index(container, key, adding):
    if key == "-" and adding:
        return len(container)
    if not key.isdigit() or (key != "0" and key.startswith("0")):
        raise PatchError("invalid array index %r" % key)
    i = int(key)
    if i > len(container) or (not adding and i == len(container)):
        raise PatchError("array index %d out of bounds" % i)
    return i


def json_patch(doc, ops):
    """RFC 6902: add, remove, replace, move, copy, test."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be an array of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError("invalid JSON patch operation %s" % dumps(op))
        kind = op["op"]
        parts = _pointer(op["path"])

        def put(value, parts=parts):
            nonlocal doc
            if not parts:
                doc = value
                return
            parent = _walk(doc, parts[:-1])
            if isinstance(parent, dict):
                parent[parts[-1]] = value
            elif isinstance(parent, list):
                parent.insert(_index(parent, parts[-1], True), value)
            else:
                raise PatchError("cannot add to a scalar at %s" % op["path"])

        def take(parts):
            parent = _walk(doc, parts[:-1])
            if isinstance(parent, dict):
                if parts[-1] not in parent:
                    raise PatchError("unable to remove nonexistent key: %s: missing value" %
                                     parts[-1])
                return parent.pop(parts[-1])
            if isinstance(parent, list):
                return parent.pop(_index(parent, parts[-1], False))
            raise PatchError("cannot remove from a scalar")

        if kind == "add":
            put(copy.deepcopy(op.get("value")))
        elif kind == "remove":
            take(parts)
        elif kind == "replace":
            if parts:
                _walk(doc, parts)       # must exist
                take(parts)
            put(copy.deepcopy(op.get("value")))
        elif kind in ("move", "copy"):
            src = _pointer(op.get("from", ""))
            value = copy.deepcopy(_walk(doc, src))
            if kind == "move":
                take(src)
            put(value)
        elif kind == "test":
            if _walk(doc, parts) != op.get("value"):
                raise PatchError("testing value %s failed" % op["path"])
        else:
            raise PatchError("unexpected kind of operation %r" % kind)
    return doc


# Merge keys from the Go struct tags of the built-in types kubectl patches.
# Lists not named here are replaced whole, as lists without a patch strategy are.
SMP_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name",
            "env": "name", "volumes": "name", "volumeMounts": "mountPath",
            "volumeDevices": "devicePath", "imagePullSecrets": "name", "conditions": "type",
            "ownerReferences": "uid", "hostAliases": "ip", "resourceClaims": "name",
            "topologySpreadConstraints": "topologyKey"}
SMP_SETS = {"finalizers"}


def strategic_merge_patch(target, patch, parent=""):
    """The part of strategic merge patch that kubectl apply produces for
    built-in kinds: merge-keyed lists, $patch replace/delete, $retainKeys,
    $deleteFromPrimitiveList and $setElementOrder (order is not enforced)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    if "$retainKeys" in patch:
        keep = set(patch["$retainKeys"] or [])
        result = {k: v for k, v in result.items() if k in keep}
    for k, v in patch.items():
        if k in ("$patch", "$retainKeys") or k.startswith("$setElementOrder/"):
            continue
        if k.startswith("$deleteFromPrimitiveList/"):
            field = k.split("/", 1)[1]
            if isinstance(result.get(field), list):
                result[field] = [x for x in result[field] if x not in (v or [])]
            continue
        if v is None:
            result.pop(k, None)
            continue
        key = SMP_KEYS.get(k)
        if k == "ports":
            key = "containerPort" if parent in ("containers", "initContainers") else "port"
        cur = result.get(k)
        if isinstance(v, list) and key and isinstance(cur, list):
            merged = copy.deepcopy(cur)
            for item in v:
                if not isinstance(item, dict):
                    merged.append(copy.deepcopy(item))
                    continue
                at = next((i for i, x in enumerate(merged)
                           if isinstance(x, dict) and x.get(key) == item.get(key)), None)
                if item.get("$patch") == "delete":
                    if at is not None:
                        merged.pop(at)
                elif at is None:
                    merged.append({a: b for a, b in item.items() if a != "$patch"})
                else:
                    merged[at] = strategic_merge_patch(merged[at], item, k)
            result[k] = merged
        elif isinstance(v, list) and k in SMP_SETS and isinstance(cur, list):
            result[k] = cur + [x for x in v if x not in cur]
        elif isinstance(v, list):
            result[k] = [strategic_merge_patch(None, x, k) if isinstance(x, dict) else x
                         for x in v if not (isinstance(x, dict) and x.get("$patch") == "delete")]
        elif isinstance(v, dict):
            sub = strategic_merge_patch(cur, v, k)
            if sub is None:
                result.pop(k, None)
            else:
                result[k] = sub
        else:
            result[k] = v
    return result
