"""Picking objects and fields: label selectors (the string and the
metav1.LabelSelector forms), field selectors, and the JSONPath that
additionalPrinterColumns and scale paths use (.a.b, [n], [-1:], [*],
[?(@.k=="v")]).
"""
import re

from .common import LABEL_NAME
from .errors import err_bad_request


class Selector:
    """A parsed label selector: a list of (key, op, values) requirements.
    Ops: =, !=, in, notin, exists, !exists (== is read as =)."""

    def __init__(self, reqs):
        self.reqs = reqs

    @staticmethod
    def parse(text):
        reqs = []
        s = text or ""
        i, n = 0, len(s)

        def skip():
            nonlocal i
            while i < n and s[i] == " ":
                i += 1

        def word():
            nonlocal i
            skip()
            j = i
            while i < n and (s[i].isalnum() or s[i] in "-_./"):
                i += 1
            return s[j:i]

        while True:
            skip()
            if i >= n:
                break
            neg = False
            if s[i] == "!":
                neg = True
                i += 1
            key = word()
            if not key:
                raise err_bad_request("unable to parse requirement: found '%s', expected: "
                                      "identifier" % s[i:i + 1])
            skip()
            if neg:
                reqs.append((key, "!exists", []))
            elif i >= n or s[i] == ",":
                reqs.append((key, "exists", []))
            elif s.startswith("==", i) or s.startswith("!=", i):
                op = "=" if s[i] == "=" else "!="
                i += 2
                reqs.append((key, op, [word()]))
            elif s[i] == "=":
                i += 1
                reqs.append((key, "=", [word()]))
            else:
                op = word()
                if op not in ("in", "notin"):
                    raise err_bad_request("unable to parse requirement: found '%s', expected: "
                                          "in, notin, =, ==, !=, gt, lt" % op)
                skip()
                if i >= n or s[i] != "(":
                    raise err_bad_request("unable to parse requirement: expected: '('")
                i += 1
                vals = []
                while True:
                    vals.append(word())
                    skip()
                    if i < n and s[i] == ",":
                        i += 1
                        continue
                    if i < n and s[i] == ")":
                        i += 1
                        break
                    raise err_bad_request("unable to parse requirement: expected: ')'")
                reqs.append((key, op, [v for v in vals if v != ""] or [""]))
            skip()
            if i < n:
                if s[i] != ",":
                    raise err_bad_request("unable to parse requirement: found '%s', expected: ','"
                                          % s[i])
                i += 1
        for key, op, vals in reqs:
            if len(key) > 317 or not LABEL_NAME.match(key.split("/")[-1]):
                raise err_bad_request("invalid label key %r" % key)
        return Selector(reqs)

    def matches(self, labels):
        labels = labels or {}
        for key, op, vals in self.reqs:
            has = key in labels
            v = labels.get(key)
            if op == "=" and not (has and v == vals[0]):
                return False
            if op == "!=" and has and v == vals[0]:
                return False
            if op == "in" and not (has and v in vals):
                return False
            if op == "notin" and has and v in vals:
                return False
            if op == "exists" and not has:
                return False
            if op == "!exists" and has:
                return False
        return True

    def empty(self):
        return not self.reqs


def selector_string(ls):
    """metav1.LabelSelector (object form) to its string form."""
    parts = ["%s=%s" % (k, v) for k, v in sorted((ls.get("matchLabels") or {}).items())]
    for e in ls.get("matchExpressions") or []:
        op = e.get("operator")
        if op == "In":
            parts.append("%s in (%s)" % (e["key"], ",".join(sorted(e.get("values") or []))))
        elif op == "NotIn":
            parts.append("%s notin (%s)" % (e["key"], ",".join(sorted(e.get("values") or []))))
        elif op == "Exists":
            parts.append(e["key"])
        elif op == "DoesNotExist":
            parts.append("!" + e["key"])
    return ",".join(parts)


def parse_field_selector(text, rt):
    """key=value, key==value, key!=value terms. Keys a kind does not index
    are refused with 400, as the real server does."""
    terms = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        m = re.match(r"^([A-Za-z0-9_.\-]+)\s*(==|!=|=)\s*(.*)$", part)
        if not m:
            raise err_bad_request("invalid selector: '%s'; can't understand '%s'" % (text, part))
        key, op, val = m.group(1), m.group(2), m.group(3)
        if key not in rt.field_labels:
            raise err_bad_request('field label not supported: %s' % key)
        terms.append((key, op != "!=", val))
    return terms


def field_value(obj, path):
    cur = obj
    for p in path.split("."):
        if not isinstance(cur, dict):
            return ""
        cur = cur.get(p)
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def fields_match(terms, obj):
    for key, eq, val in terms:
        if (field_value(obj, key) == val) != eq:
            return False
    return True


def jsonpath(obj, path):
    """All values a printer-column path selects."""
    cur = [obj]
    for tok in re.findall(r"\.[A-Za-z0-9_\-]+|\[[^\]]*\]|\.\*", path or ""):
        nxt = []
        for c in cur:
            if tok.startswith("."):
                key = tok[1:]
                if key == "*" and isinstance(c, dict):
                    nxt.extend(c.values())
                elif isinstance(c, dict) and key in c:
                    nxt.append(c[key])
                continue
            inner = tok[1:-1].strip()
            if not isinstance(c, list):
                continue
            if inner == "*":
                nxt.extend(c)
            elif inner.startswith("?("):
                m = re.match(r"^\?\(@\.([A-Za-z0-9_.\-]+)\s*==\s*['\"]([^'\"]*)['\"]\)$", inner)
                if m:
                    for x in c:
                        if str(field_value(x, m.group(1))) == m.group(2):
                            nxt.append(x)
            elif ":" in inner:
                a, _, b = inner.partition(":")
                nxt.extend(c[int(a) if a else None:int(b) if b else None])
            elif re.match(r"^-?\d+$", inner):
                i = int(inner)
                if -len(c) <= i < len(c):
                    nxt.append(c[i])
        cur = nxt
    return cur
