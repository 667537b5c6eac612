"""Protobuf request bodies. kubectl's generator commands (create namespace,
configmap, secret, serviceaccount, token, role, rolebinding,
clusterrole, clusterrolebinding) send typed objects as protobuf, with no
fallback to JSON. These few kinds are decoded from their field numbers in
k8s.io/api's generated.proto; any other protobuf body gets 415.
"""
import base64


PB_OWNER_REF = {1: ("kind", "string"), 3: ("name", "string"), 4: ("uid", "string"),
                5: ("apiVersion", "string"), 6: ("controller", "bool"),
                7: ("blockOwnerDeletion", "bool")}
PB_META = {1: ("name", "string"), 2: ("generateName", "string"), 3: ("namespace", "string"),
           5: ("uid", "string"), 6: ("resourceVersion", "string"), 7: ("generation", "int"),
           11: ("labels", "map"), 12: ("annotations", "map"),
           13: ("ownerReferences", "msgs", PB_OWNER_REF), 14: ("finalizers", "strings")}
PB_RULE = {1: ("verbs", "strings"), 2: ("apiGroups", "strings"), 3: ("resources", "strings"),
           4: ("resourceNames", "strings"), 5: ("nonResourceURLs", "strings")}
PB_SUBJECT = {1: ("kind", "string"), 2: ("apiGroup", "string"), 3: ("name", "string"),
              4: ("namespace", "string")}
PB_ROLE_REF = {1: ("apiGroup", "string"), 2: ("kind", "string"), 3: ("name", "string")}
PB_KINDS = {
    "Namespace": {1: ("metadata", "msg", PB_META),
                  2: ("spec", "msg", {1: ("finalizers", "strings")}),
                  3: ("status", "msg", {1: ("phase", "string")})},
    "ConfigMap": {1: ("metadata", "msg", PB_META), 2: ("data", "map"),
                  3: ("binaryData", "bytesmap"), 4: ("immutable", "bool")},
    "Secret": {1: ("metadata", "msg", PB_META), 2: ("data", "bytesmap"), 3: ("type", "string"),
               4: ("stringData", "map"), 5: ("immutable", "bool")},
    "ServiceAccount": {1: ("metadata", "msg", PB_META),
                       4: ("automountServiceAccountToken", "bool")},
    # kubectl create role, clusterrole, rolebinding, clusterrolebinding
    "Role": {1: ("metadata", "msg", PB_META), 2: ("rules", "msgs", PB_RULE)},
    "ClusterRole": {1: ("metadata", "msg", PB_META), 2: ("rules", "msgs", PB_RULE)},
    "RoleBinding": {1: ("metadata", "msg", PB_META), 2: ("subjects", "msgs", PB_SUBJECT),
                    3: ("roleRef", "msg", PB_ROLE_REF)},
    "ClusterRoleBinding": {1: ("metadata", "msg", PB_META), 2: ("subjects", "msgs", PB_SUBJECT),
                           3: ("roleRef", "msg", PB_ROLE_REF)},
    # kubectl create token
    "TokenRequest": {1: ("metadata", "msg", PB_META),
                     2: ("spec", "msg", {1: ("audiences", "strings"),
                                         3: ("boundObjectRef", "msg", {
                                             1: ("kind", "string"), 2: ("apiVersion", "string"),
                                             3: ("name", "string"), 4: ("uid", "string")}),
                                         4: ("expirationSeconds", "int")})},
}


def _pb_fields(buf):
    """Yields (field number, wire type, value) of one protobuf message."""
    i, n = 0, len(buf)

    def varint():
        nonlocal i
        shift = result = 0
        while True:
            if i >= n:
                raise ValueError("truncated varint")
            b = buf[i]
            i += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
    while i < n:
        tag = varint()
        num, wt = tag >> 3, tag & 7
        if wt == 0:
            yield num, wt, varint()
        elif wt == 1:
            i += 8
            yield num, wt, None
        elif wt == 2:
            ln = varint()
            if i + ln > n:
                raise ValueError("truncated field")
            yield num, wt, bytes(buf[i:i + ln])
            i += ln
        elif wt == 5:
            i += 4
            yield num, wt, None
        else:
            raise ValueError("unsupported wire type %d" % wt)


def _pb_decode(buf, desc):
    out = {}
    for num, wt, val in _pb_fields(buf):
        d = desc.get(num)
        if d is None or val is None:
            continue
        name, typ = d[0], d[1]
        if typ == "string":
            out[name] = val.decode()
        elif typ == "int":
            out[name] = val
        elif typ == "bool":
            out[name] = bool(val)
        elif typ == "strings":
            out.setdefault(name, []).append(val.decode())
        elif typ == "msg":
            out[name] = _pb_decode(val, d[2])
        elif typ == "msgs":
            out.setdefault(name, []).append(_pb_decode(val, d[2]))
        elif typ in ("map", "bytesmap"):
            entry = {k: v for k, _, v in _pb_fields(val)}
            key = (entry.get(1) or b"").decode()
            v = entry.get(2) or b""
            out.setdefault(name, {})[key] = v.decode() if typ == "map" else \
                base64.b64encode(v).decode()
    return out


def decode_k8s_protobuf(data):
    """The "k8s\\x00" envelope (runtime.Unknown) around one of PB_KINDS."""
    if data[:4] != b"k8s\x00":
        raise ValueError("missing the k8s protobuf magic")
    unknown = {num: val for num, _, val in _pb_fields(data[4:])}
    tm = {num: val for num, _, val in _pb_fields(unknown.get(1) or b"")}
    api_version = (tm.get(1) or b"").decode()
    kind = (tm.get(2) or b"").decode()
    desc = PB_KINDS.get(kind)
    if desc is None:
        raise KeyError(kind)
    obj = _pb_decode(unknown.get(2) or b"", desc)
    obj["apiVersion"] = api_version
    obj["kind"] = kind
    return obj
