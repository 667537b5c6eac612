"""Structural schemas of custom resources: pruning, defaulting, OpenAPI v3
value validation (with ratcheting), and the x-kubernetes-validations
rules, compiled and run by cel.py.
"""
import copy
import json
import re

from .cel import CelError, cel_compile, cel_equal, cel_eval, cel_names, cel_value
from .common import dumps, go_value, is_int, is_num, parse_time
from .errors import FieldError


OBJECT_META_FIELDS = {"name", "generateName", "namespace", "selfLink", "uid", "resourceVersion",
                      "generation", "creationTimestamp", "deletionTimestamp",
                      "deletionGracePeriodSeconds", "labels", "annotations", "ownerReferences",
                      "finalizers", "managedFields"}


def _join(path, key):
    return key if not path else path + "." + key


def prune(value, schema, path, unknown, root=False):
    """Drops what the schema does not declare (recording each path in
    unknown, for fieldValidation) and nulls in fields that are not nullable,
    as the real server does before defaulting."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, dict):
        embedded = root or schema.get("x-kubernetes-embedded-resource")
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields")
        out = {}
        for k, v in value.items():
            p = _join(path, k)
            if embedded and k in ("apiVersion", "kind"):
                out[k] = v
                continue
            if embedded and k == "metadata" and isinstance(v, dict):
                meta = {}
                for mk, mv in v.items():
                    if mk in OBJECT_META_FIELDS:
                        meta[mk] = mv
                    else:
                        unknown.append(_join(p, mk))
                out[k] = meta
                continue
            sub = props.get(k)
            if sub is None and isinstance(addl, dict):
                sub = addl
            if sub is None:
                if preserve or addl is True:
                    out[k] = v
                else:
                    unknown.append(p)
                continue
            if v is None and not sub.get("nullable"):
                continue
            out[k] = prune(v, sub, p, unknown)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(x, schema["items"], "%s[%d]" % (path, i), unknown)
                for i, x in enumerate(value)]
    return value


def apply_defaults(value, schema):
    """Fills absent fields from `default`, then defaults inside them, so
    that `default: {}` on an object brings its children's defaults."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        for k, sub in props.items():
            if k not in value and isinstance(sub, dict) and "default" in sub:
                value[k] = copy.deepcopy(sub["default"])
        for k in list(value):
            sub = props.get(k) or (addl if isinstance(addl, dict) else None)
            if sub:
                value[k] = apply_defaults(value[k], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i in range(len(value)):
            value[i] = apply_defaults(value[i], schema["items"])
    return value


def _json_type(v):
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return "null"


def _type_ok(t, v):
    return {"object": isinstance(v, dict), "array": isinstance(v, list),
            "string": isinstance(v, str), "boolean": isinstance(v, bool),
            "integer": is_int(v),
            "number": is_num(v)}.get(t, True)


FORMATS = {
    "date-time": lambda s: parse_time(s) is not None,
    "date": lambda s: re.match(r"^\d{4}-\d\d-\d\d$", s) is not None,
    "byte": lambda s: re.match(r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$",
                               s) is not None,
    "uuid": lambda s: re.match(r"^[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}$",
                               s) is not None,
}


def _type_error(path, want, got):
    e = FieldError("Invalid", path, shown=json.dumps(got),
                   detail='%s in body must be of type %s: "%s"' % (path, want, got))
    e.blocking = True
    return e


def validate_schema(value, schema, path, errs, old=None, ratchet=False):
    """OpenAPI v3 value validation as the CRD handler does it. With
    ratchet, a subtree equal to the old object's is not re-validated
    (CRD validation ratcheting, on by default since Kubernetes 1.30)."""
    if not isinstance(schema, dict):
        return
    if ratchet and old is not None and value == old:
        return
    if value is None:
        if not schema.get("nullable") and schema.get("type"):
            errs.append(_type_error(path, schema["type"], "null"))
        return
    t = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not (is_int(value) or isinstance(value, str)):
            errs.append(_type_error(path, "int-or-string", _json_type(value)))
            return
    elif t and not _type_ok(t, value):
        errs.append(_type_error(path, t, _json_type(value)))
        return
    if "enum" in schema and not any(cel_equal(value, e) for e in schema["enum"]):
        errs.append(FieldError("NotSupported", path, value, "supported values: " +
                               ", ".join(go_value(e) for e in schema["enum"])))
    if is_num(value):
        if "minimum" in schema:
            if schema.get("exclusiveMinimum") and value <= schema["minimum"]:
                errs.append(FieldError("Invalid", path, value, "%s in body should be greater "
                                       "than %s" % (path, schema["minimum"])))
            elif value < schema["minimum"]:
                errs.append(FieldError("Invalid", path, value, "%s in body should be greater than "
                                       "or equal to %s" % (path, schema["minimum"])))
        if "maximum" in schema:
            if schema.get("exclusiveMaximum") and value >= schema["maximum"]:
                errs.append(FieldError("Invalid", path, value, "%s in body should be less than %s"
                                       % (path, schema["maximum"])))
            elif value > schema["maximum"]:
                errs.append(FieldError("Invalid", path, value, "%s in body should be less than or "
                                       "equal to %s" % (path, schema["maximum"])))
        if schema.get("multipleOf") and value % schema["multipleOf"] != 0:
            errs.append(FieldError("Invalid", path, value, "%s in body should be a multiple of %s"
                                   % (path, schema["multipleOf"])))
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errs.append(FieldError("TooLong", path, value, "may not be longer than %d" %
                                   schema["maxLength"]))
        if "minLength" in schema and len(value) < schema["minLength"]:
            errs.append(FieldError("Invalid", path, value, "%s in body should be at least %d chars "
                                   "long" % (path, schema["minLength"])))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errs.append(FieldError("Invalid", path, value, "%s in body should match '%s'" %
                                   (path, schema["pattern"])))
        fmt = FORMATS.get(schema.get("format"))
        if fmt and not fmt(value):
            errs.append(FieldError("Invalid", path, value, "%s in body must be of type %s: %s" %
                                   (path, schema["format"], json.dumps(value))))
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errs.append(FieldError("TooMany", path, shown=str(len(value)),
                                   detail="must have at most %d items" % schema["maxItems"]))
        if "minItems" in schema and len(value) < schema["minItems"]:
            errs.append(FieldError("Invalid", path, shown=str(len(value)),
                                   detail="%s in body should have at least %d items" %
                                   (path, schema["minItems"])))
        lt = schema.get("x-kubernetes-list-type")
        if lt == "set" or schema.get("uniqueItems"):
            for i, x in enumerate(value):
                if any(cel_equal(x, y) for y in value[:i]):
                    errs.append(FieldError("Duplicate", "%s[%d]" % (path, i), x))
        if lt == "map":
            keys = schema.get("x-kubernetes-list-map-keys") or []
            seen = []
            for i, x in enumerate(value):
                if isinstance(x, dict):
                    k = [x.get(kk) for kk in keys]
                    if k in seen:
                        errs.append(FieldError("Duplicate", "%s[%d]" % (path, i),
                                               shown=dumps({kk: x.get(kk) for kk in keys})))
                    seen.append(k)
        items = schema.get("items")
        if isinstance(items, dict):
            olds = _correlate_list(old, schema) if ratchet else {}
            for i, x in enumerate(value):
                validate_schema(x, items, "%s[%d]" % (path, i), errs,
                                olds.get(_list_key(x, schema, i)), ratchet)
    if isinstance(value, dict):
        for r in schema.get("required") or []:
            if r not in value:
                errs.append(FieldError("Required", _join(path, r)))
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            errs.append(FieldError("TooMany", path, shown=str(len(value)),
                                   detail="must have at most %d items" % schema["maxProperties"]))
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            errs.append(FieldError("Invalid", path, shown=str(len(value)),
                                   detail="%s in body should have at least %d properties" %
                                   (path, schema["minProperties"])))
        for k, v in value.items():
            sub = props.get(k) or (addl if isinstance(addl, dict) else None)
            if sub is not None:
                validate_schema(v, sub, _join(path, k), errs,
                                old.get(k) if isinstance(old, dict) else None, ratchet)
    for sub in schema.get("allOf") or []:
        validate_schema(value, sub, path, errs)
    if schema.get("anyOf"):
        if not any(not _errs_of(value, s, path) for s in schema["anyOf"]):
            errs.append(FieldError("Invalid", path, value, "%s in body must match at least one "
                                   "schema in anyOf" % path))
    if schema.get("oneOf"):
        n = sum(1 for s in schema["oneOf"] if not _errs_of(value, s, path))
        if n != 1:
            errs.append(FieldError("Invalid", path, value, "%s in body must match exactly one "
                                   "schema in oneOf" % path))
    if isinstance(schema.get("not"), dict) and not _errs_of(value, schema["not"], path):
        errs.append(FieldError("Invalid", path, value, "%s in body must not match the schema in "
                               "not" % path))


def _errs_of(value, schema, path):
    e = []
    validate_schema(value, schema, path, e)
    return e


def _list_key(item, schema, i):
    if schema.get("x-kubernetes-list-type") == "map" and isinstance(item, dict):
        return tuple(dumps(item.get(k)) for k in schema.get("x-kubernetes-list-map-keys") or [])
    return None


def _correlate_list(old, schema):
    """Old items of a map-type list by key: the only list items Kubernetes
    correlates for oldSelf and ratcheting."""
    if not isinstance(old, list) or schema.get("x-kubernetes-list-type") != "map":
        return {}
    return {_list_key(x, schema, i): x for i, x in enumerate(old)}


_CEL_CACHE = {}


def cel_rule(text):
    """Compiled rule (cached), or raises CelError."""
    got = _CEL_CACHE.get(text)
    if got is None:
        ast = cel_compile(text)
        got = (ast, "oldSelf" in cel_names(ast))
        _CEL_CACHE[text] = got
    return got


def check_rules(schema, path, errs):
    """At CRD create/update: every rule must compile in the subset, and the
    fields it names must be declared (unknown names are a compile error in
    Kubernetes too). Returns errors as FieldErrors."""
    if not isinstance(schema, dict):
        return
    for i, r in enumerate(schema.get("x-kubernetes-validations") or []):
        p = "%s.x-kubernetes-validations[%d]" % (path, i)
        if not isinstance(r, dict) or not isinstance(r.get("rule"), str):
            errs.append(FieldError("Required", p + ".rule"))
            continue
        if r.get("optionalOldSelf"):
            errs.append(FieldError("Forbidden", p + ".optionalOldSelf",
                                   detail="not supported by the cohort API server stand-in"))
        for key in ("rule", "messageExpression"):
            if isinstance(r.get(key), str):
                try:
                    cel_rule(r[key])
                except CelError as e:
                    errs.append(FieldError("Invalid", p + "." + key, r[key],
                                           "compilation failed: %s" % e))
        if r.get("reason") not in (None, "FieldValueInvalid", "FieldValueForbidden",
                                   "FieldValueRequired", "FieldValueDuplicate"):
            errs.append(FieldError("NotSupported", p + ".reason", r.get("reason"),
                                   'supported values: "FieldValueDuplicate", '
                                   '"FieldValueForbidden", "FieldValueInvalid", '
                                   '"FieldValueRequired"'))
    for k, sub in (schema.get("properties") or {}).items():
        check_rules(sub, path + ".properties[%s]" % k, errs)
    if isinstance(schema.get("items"), dict):
        check_rules(schema["items"], path + ".items", errs)
    if isinstance(schema.get("additionalProperties"), dict):
        check_rules(schema["additionalProperties"], path + ".additionalProperties", errs)


def validate_rules(value, old, schema, path, errs, ratchet=False):
    """Runs x-kubernetes-validations at every schema node that has a value."""
    if not isinstance(schema, dict) or value is None:
        return
    unchanged = old is not None and value == old
    rules = schema.get("x-kubernetes-validations") or []
    if rules:
        self_v = cel_value(value, schema)
        old_v = cel_value(old, schema) if old is not None else None
        shown = json.dumps(schema.get("type") or ("object" if isinstance(value, dict) else
                                                  _json_type(value)))
        for r in rules:
            ast, transition = cel_rule(r["rule"])
            if transition and old is None:
                continue
            if ratchet and unchanged and not transition:
                continue
            env = {"self": self_v}
            if old is not None:
                env["oldSelf"] = old_v
            field = path + (r.get("fieldPath") or "")
            field = field.lstrip(".")
            try:
                ok = cel_eval(ast, env)
                if type(ok) is not bool:
                    raise CelError("rule did not evaluate to a bool")
            except CelError as e:
                errs.append(FieldError("Invalid", field, shown=shown,
                                       detail="%s evaluating rule: %s" % (e, r["rule"])))
                continue
            if ok:
                continue
            msg = r.get("message") or "failed rule: %s" % r["rule"]
            if r.get("messageExpression"):
                try:
                    m = cel_eval(cel_rule(r["messageExpression"])[0], env)
                    if isinstance(m, str) and m.strip() and "\n" not in m:
                        msg = m
                except CelError:
                    pass
            kind = {"FieldValueForbidden": "Forbidden", "FieldValueRequired": "Required",
                    "FieldValueDuplicate": "Duplicate"}.get(r.get("reason"), "Invalid")
            errs.append(FieldError(kind, field, shown=shown, detail=msg))
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        for k, v in value.items():
            sub = props.get(k) or (addl if isinstance(addl, dict) else None)
            if sub is not None:
                validate_rules(v, old.get(k) if isinstance(old, dict) else None, sub,
                               _join(path, k), errs, ratchet)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        olds = _correlate_list(old, schema)
        for i, x in enumerate(value):
            validate_rules(x, olds.get(_list_key(x, schema, i)), schema["items"],
                           "%s[%d]" % (path, i), errs, ratchet)
