"""CEL: a small, honest subset for x-kubernetes-validations.

Supported: literals (int, uint as int, double, string, bool, null, lists,
maps); self and oldSelf; field selection and indexing; has(); the
operators ! - * / % + - < <= > >= == != in && || ?: with CEL's typing (no
int+double), int64 overflow and division errors, and the commutative
error absorption of && and ||; size(), int(), uint(), double(), string(),
duration(), timestamp(); string methods contains, startsWith, endsWith,
matches, lowerAscii, upperAscii, trim, split, join, indexOf, substring,
replace; the macros all, exists, exists_one, map, filter; messageExpression.
Not supported, and refused when a CRD uses it: optional types (?. and
optionalOldSelf), the Kubernetes quantity/ip/cidr/url/format libraries,
sets, type() and comprehension over maps' values, cost estimation.
Transition rules (those naming oldSelf) run only on updates where the old
value exists at the same place, as in Kubernetes (see schema.py).

cel_compile() parses an expression into tuples; cel_eval() runs one
against an environment ({"self": ..., "oldSelf": ...}).
"""
import datetime
import re

from .common import is_int, is_num, parse_time


INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1


class CelError(Exception):
    pass


class Duration:
    """google.protobuf.Duration as CEL sees it, kept in nanoseconds."""
    __slots__ = ("ns",)

    def __init__(self, ns):
        self.ns = ns

    def __eq__(self, o):
        return isinstance(o, Duration) and o.ns == self.ns

    def __hash__(self):
        return hash(self.ns)

    def __repr__(self):
        return "duration(%dns)" % self.ns


class Timestamp:
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t

    def __eq__(self, o):
        return isinstance(o, Timestamp) and o.t == self.t

    def __hash__(self):
        return hash(self.t)


GO_UNITS = {"ns": 1, "us": 1000, "µs": 1000, "ms": 10 ** 6, "s": 10 ** 9, "m": 60 * 10 ** 9,
            "h": 3600 * 10 ** 9}


def parse_go_duration(s):
    """Go's time.ParseDuration, which CEL's duration() uses."""
    if not isinstance(s, str):
        raise CelError("no such overload: duration(%s)" % type(s).__name__)
    orig, sign = s, 1
    if s[:1] in "+-" and s:
        sign = -1 if s[0] == "-" else 1
        s = s[1:]
    if s == "0":
        return Duration(0)
    if not s:
        raise CelError('invalid duration "%s"' % orig)
    total = 0
    while s:
        m = re.match(r"^(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)", s)
        if not m:
            raise CelError('invalid duration "%s"' % orig)
        num, unit = m.group(1), m.group(2)
        whole, _, frac = num.partition(".")
        total += int(whole or "0") * GO_UNITS[unit]
        if frac:
            total += int(frac) * GO_UNITS[unit] // (10 ** len(frac))
        s = s[m.end():]
    if total > INT_MAX:
        raise CelError('invalid duration "%s"' % orig)
    return Duration(sign * total)


_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<num>0[xX][0-9a-fA-F]+[uU]?|(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[uU]?)
  | (?P<str>[rR]?(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*"))
  | (?P<id>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>&&|\|\||==|!=|<=|>=|[-+*/%!<>?:.,()\[\]{}])
""", re.X)

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a",
            "b": "\b", "f": "\f", "v": "\v", "`": "`", "?": "?"}


def _unquote(text):
    raw = text[0] in "rR"
    if raw:
        text = text[1:]
    body = text[1:-1]
    if raw:
        return body
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        n = body[i + 1]
        if n in _ESCAPES:
            out.append(_ESCAPES[n])
            i += 2
        elif n in "uU":
            width = 4 if n == "u" else 8
            out.append(chr(int(body[i + 2:i + 2 + width], 16)))
            i += 2 + width
        elif n == "x":
            out.append(chr(int(body[i + 2:i + 4], 16)))
            i += 4
        else:
            raise CelError("invalid escape \\%s" % n)
    return "".join(out)


MACROS = ("all", "exists", "exists_one", "map", "filter")
RESERVED = {"as", "break", "const", "continue", "else", "for", "function", "if", "import",
            "let", "loop", "package", "namespace", "return", "var", "void", "while"}


class CelParser:
    """Recursive descent over CEL's grammar; builds tuples as AST nodes."""

    def __init__(self, text):
        self.text = text
        self.toks = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m:
                raise CelError("Syntax error: token recognition error at: '%s'" % text[pos])
            pos = m.end()
            kind = m.lastgroup
            if kind != "ws":
                self.toks.append((kind, m.group()))
        self.toks.append(("eof", ""))
        self.i = 0

    def peek(self, value=None):
        k, v = self.toks[self.i]
        if value is None:
            return v if k != "eof" else None
        return v == value and k in ("op", "id")

    def take(self, value=None):
        k, v = self.toks[self.i]
        if value is not None and v != value:
            raise CelError("Syntax error: expected '%s' but found '%s'" % (value, v or "EOF"))
        self.i += 1
        return k, v

    def parse(self):
        e = self.expr()
        if self.toks[self.i][0] != "eof":
            raise CelError("Syntax error: unexpected '%s'" % self.toks[self.i][1])
        return e

    def expr(self):
        c = self.or_()
        if self.peek("?"):
            self.take("?")
            a = self.or_()
            self.take(":")
            b = self.expr()
            return ("cond", c, a, b)
        return c

    def or_(self):
        e = self.and_()
        while self.peek("||"):
            self.take()
            e = ("or", e, self.and_())
        return e

    def and_(self):
        e = self.rel()
        while self.peek("&&"):
            self.take()
            e = ("and", e, self.rel())
        return e

    def rel(self):
        e = self.add()
        while self.peek() in ("<", "<=", ">", ">=", "==", "!=", "in") and \
                self.toks[self.i][0] in ("op", "id"):
            op = self.take()[1]
            e = ("bin", op, e, self.add())
        return e

    def add(self):
        e = self.mul()
        while self.peek() in ("+", "-") and self.toks[self.i][0] == "op":
            op = self.take()[1]
            e = ("bin", op, e, self.mul())
        return e

    def mul(self):
        e = self.unary()
        while self.peek() in ("*", "/", "%") and self.toks[self.i][0] == "op":
            op = self.take()[1]
            e = ("bin", op, e, self.unary())
        return e

    def unary(self):
        if self.peek("!") or self.peek("-"):
            op = self.take()[1]
            if op == "-" and self.toks[self.i][0] == "num":
                return self.member(self.number(negative=True))
            return ("un", op, self.unary())
        return self.member(self.primary())

    def number(self, negative=False):
        text = self.take()[1]
        sign = -1 if negative else 1
        try:
            if text[-1] in "uU":
                return ("lit", int(text[:-1], 0))
            if text.lower().startswith("0x"):
                v = sign * int(text, 16)
            elif any(c in text for c in ".eE"):
                return ("lit", sign * float(text))
            else:
                v = sign * int(text)
        except ValueError:
            raise CelError("invalid number %s" % text)
        if not INT_MIN <= v <= INT_MAX:
            raise CelError("integer literal out of range: %s" % text)
        return ("lit", v)

    def args(self):
        self.take("(")
        out = []
        if not self.peek(")"):
            out.append(self.expr())
            while self.peek(","):
                self.take()
                out.append(self.expr())
        self.take(")")
        return out

    def member(self, e):
        while True:
            if self.peek(".") and self.toks[self.i][0] == "op":
                self.take()
                if self.peek("?"):
                    raise CelError("optional field selection (.?) is not supported by this "
                                   "stand-in")
                k, name = self.take()
                if k != "id":
                    raise CelError("Syntax error: expected a field name after '.'")
                if self.peek("(") and self.toks[self.i][0] == "op":
                    if name in MACROS:
                        e = self.macro(name, e)
                    else:
                        e = ("call", name, e, self.args())
                else:
                    e = ("sel", e, name)
            elif self.peek("[") and self.toks[self.i][0] == "op":
                self.take()
                if self.peek("?"):
                    raise CelError("optional indexing ([?]) is not supported by this stand-in")
                idx = self.expr()
                self.take("]")
                e = ("idx", e, idx)
            else:
                return e

    def macro(self, name, target):
        self.take("(")
        k, var = self.take()
        if k != "id":
            raise CelError("Syntax error: %s() needs a variable name first" % name)
        self.take(",")
        body = self.expr()
        extra = None
        if self.peek(","):
            self.take()
            extra = self.expr()
        self.take(")")
        if extra is not None and name != "map":
            raise CelError("Syntax error: %s() takes two arguments" % name)
        return ("macro", name, target, var, body, extra)

    def primary(self):
        k, v = self.toks[self.i]
        if k == "num":
            return self.number()
        if k == "str":
            self.take()
            return ("lit", _unquote(v))
        if k == "id":
            self.take()
            if v in ("true", "false"):
                return ("lit", v == "true")
            if v == "null":
                return ("lit", None)
            if v in RESERVED:
                raise CelError("Syntax error: reserved identifier '%s'" % v)
            if self.peek("(") and self.toks[self.i][0] == "op":
                if v == "has":
                    self.take("(")
                    arg = self.expr()
                    self.take(")")
                    if arg[0] != "sel":
                        raise CelError("invalid argument to has() macro")
                    return ("has", arg)
                return ("call", v, None, self.args())
            return ("id", v)
        if v == "(":
            self.take()
            e = self.expr()
            self.take(")")
            return e
        if v == "[":
            self.take()
            items = []
            while not self.peek("]"):
                items.append(self.expr())
                if not self.peek(","):
                    break
                self.take()
            self.take("]")
            return ("list", items)
        if v == "{":
            self.take()
            pairs = []
            while not self.peek("}"):
                key = self.expr()
                self.take(":")
                pairs.append((key, self.expr()))
                if not self.peek(","):
                    break
                self.take()
            self.take("}")
            return ("map", pairs)
        raise CelError("Syntax error: unexpected '%s'" % (v or "EOF"))


def cel_compile(text):
    return CelParser(text).parse()


def cel_names(ast, out=None):
    """Identifiers an expression reads (to find transition rules)."""
    out = set() if out is None else out
    if isinstance(ast, tuple):
        if ast[0] == "id":
            out.add(ast[1])
        for part in ast[1:]:
            if isinstance(part, (tuple, list)):
                if isinstance(part, list):
                    for p in part:
                        cel_names(p, out)
                else:
                    cel_names(part, out)
    elif isinstance(ast, list):
        for p in ast:
            cel_names(p, out)
    return out


def _type_name(v):
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "double"
    if isinstance(v, str):
        return "string"
    if v is None:
        return "null_type"
    if isinstance(v, list):
        return "list"
    if isinstance(v, dict):
        return "map"
    if isinstance(v, Duration):
        return "google.protobuf.Duration"
    if isinstance(v, Timestamp):
        return "google.protobuf.Timestamp"
    return type(v).__name__


def _overload(op, *vals):
    return CelError("no such overload: %s(%s)" % (op, ", ".join(_type_name(v) for v in vals)))


def _check_int(v):
    if not INT_MIN <= v <= INT_MAX:
        raise CelError("integer overflow")
    return v


def cel_equal(a, b):
    if is_num(a) and is_num(b):
        return a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(cel_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(cel_equal(a[k], b[k]) for k in a)
    return a == b


def _compare(op, a, b):
    if is_num(a) and is_num(b):
        x, y = a, b
    elif isinstance(a, str) and isinstance(b, str):
        x, y = a, b
    elif isinstance(a, bool) and isinstance(b, bool):
        x, y = a, b
    elif isinstance(a, Duration) and isinstance(b, Duration):
        x, y = a.ns, b.ns
    elif isinstance(a, Timestamp) and isinstance(b, Timestamp):
        x, y = a.t, b.t
    else:
        raise _overload(op, a, b)
    return {"<": x < y, "<=": x <= y, ">": x > y, ">=": x >= y}[op]


def _arith(op, a, b):
    if is_int(a) and is_int(b):
        if op == "+":
            return _check_int(a + b)
        if op == "-":
            return _check_int(a - b)
        if op == "*":
            return _check_int(a * b)
        if b == 0:
            raise CelError("division by zero" if op == "/" else "modulus by zero")
        q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)    # truncates toward zero
        return _check_int(q) if op == "/" else a - b * q
    if type(a) is float and type(b) is float and op != "%":
        if op == "/":
            if b == 0.0:
                return float("inf") if a > 0 else float("-inf") if a < 0 else float("nan")
            return a / b
        return {"+": a + b, "-": a - b, "*": a * b}[op]
    if op == "+" and isinstance(a, str) and isinstance(b, str):
        return a + b
    if op == "+" and isinstance(a, list) and isinstance(b, list):
        return a + b
    if op in "+-" and isinstance(a, Duration) and isinstance(b, Duration):
        return Duration(_check_int(a.ns + b.ns if op == "+" else a.ns - b.ns))
    if op in "+-" and isinstance(a, Timestamp) and isinstance(b, Duration):
        d = datetime.timedelta(microseconds=b.ns / 1000)
        return Timestamp(a.t + d if op == "+" else a.t - d)
    if op == "-" and isinstance(a, Timestamp) and isinstance(b, Timestamp):
        return Duration(int((a.t - b.t).total_seconds() * 10 ** 9))
    raise _overload({"+": "_+_", "-": "_-_", "*": "_*_", "/": "_/_", "%": "_%_"}[op], a, b)


def _string_of(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, str)):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, Duration):
        return "%gs" % (v.ns / 1e9)
    if isinstance(v, Timestamp):
        return v.t.strftime("%Y-%m-%dT%H:%M:%SZ")
    raise _overload("string", v)


def _call(name, target, args):
    vals = ([target] if target is not _NO_TARGET else []) + args
    n = len(vals)
    if name == "size" and n == 1:
        v = vals[0]
        if isinstance(v, (str, list, dict)):
            return len(v)
        raise _overload("size", v)
    if name == "int" and n == 1 and target is _NO_TARGET:
        v = vals[0]
        if is_int(v):
            return v
        if isinstance(v, float):
            if v != v or not INT_MIN <= v <= INT_MAX:
                raise CelError("double out of int range")
            return int(v)
        if isinstance(v, str):
            try:
                return _check_int(int(v, 10))
            except ValueError:
                raise CelError("cannot convert %r to int" % v)
        if isinstance(v, Duration):
            return v.ns
        if isinstance(v, Timestamp):
            return int(v.t.timestamp())
        raise _overload("int", v)
    if name == "uint" and n == 1 and target is _NO_TARGET:
        v = _call("int", _NO_TARGET, vals)
        if v < 0:
            raise CelError("uint out of range")
        return v
    if name == "double" and n == 1 and target is _NO_TARGET:
        v = vals[0]
        if is_num(v):
            return float(v)
        if isinstance(v, str):
            try:
                return float(v)
            except ValueError:
                raise CelError("cannot convert %r to double" % v)
        raise _overload("double", v)
    if name == "string" and n == 1 and target is _NO_TARGET:
        return _string_of(vals[0])
    if name == "bool" and n == 1 and target is _NO_TARGET:
        v = vals[0]
        if isinstance(v, bool):
            return v
        if v in ("true", "True", "TRUE", "t", "1"):
            return True
        if v in ("false", "False", "FALSE", "f", "0"):
            return False
        raise _overload("bool", v)
    if name == "duration" and n == 1 and target is _NO_TARGET:
        return parse_go_duration(vals[0])
    if name == "timestamp" and n == 1 and target is _NO_TARGET:
        t = parse_time(vals[0])
        if t is None:
            raise CelError("invalid timestamp %r" % (vals[0],))
        return Timestamp(t)
    if target is not _NO_TARGET and isinstance(target, str):
        s = target
        if name in ("contains", "startsWith", "endsWith", "matches") and len(args) == 1 \
                and isinstance(args[0], str):
            a = args[0]
            if name == "contains":
                return a in s
            if name == "startsWith":
                return s.startswith(a)
            if name == "endsWith":
                return s.endswith(a)
            try:
                return re.search(a, s) is not None
            except re.error as e:
                raise CelError("invalid regular expression %r: %s" % (a, e))
        if name == "lowerAscii" and not args:
            return "".join(c.lower() if c.isascii() else c for c in s)
        if name == "upperAscii" and not args:
            return "".join(c.upper() if c.isascii() else c for c in s)
        if name == "trim" and not args:
            return s.strip()
        if name == "split" and len(args) in (1, 2) and isinstance(args[0], str):
            parts = s.split(args[0]) if args[0] else list(s)
            if len(args) == 2:
                lim = args[1]
                if lim == 0:
                    return []
                if lim > 0 and len(parts) > lim:
                    parts = parts[:lim - 1] + [args[0].join(parts[lim - 1:])]
            return parts
        if name == "indexOf" and len(args) in (1, 2) and isinstance(args[0], str):
            return s.find(args[0], args[1] if len(args) == 2 else 0)
        if name == "substring" and len(args) in (1, 2):
            end = args[1] if len(args) == 2 else len(s)
            if not 0 <= args[0] <= end <= len(s):
                raise CelError("index out of range")
            return s[args[0]:end]
        if name == "replace" and len(args) in (2, 3):
            return s.replace(args[0], args[1], -1 if len(args) == 2 else args[2])
    if name == "matches" and target is _NO_TARGET and n == 2:
        return _call("matches", vals[0], [vals[1]])
    if name == "join" and target is not _NO_TARGET and isinstance(target, list):
        sep = args[0] if args else ""
        if all(isinstance(x, str) for x in target):
            return sep.join(target)
    if name in ("getSeconds", "getMilliseconds") and isinstance(target, Duration) and not args:
        return int(target.ns / 10 ** 9) if name == "getSeconds" else int(target.ns / 10 ** 6)
    raise CelError("undeclared reference to '%s' (in container '')" % name
                   if target is _NO_TARGET else _overload(name, *vals))


_NO_TARGET = object()


def cel_eval(ast, env):
    k = ast[0]
    if k == "lit":
        return ast[1]
    if k == "id":
        if ast[1] not in env:
            raise CelError("undeclared reference to '%s'" % ast[1])
        return env[ast[1]]
    if k == "sel":
        obj = cel_eval(ast[1], env)
        if isinstance(obj, dict):
            if ast[2] not in obj:
                raise CelError("no such key: %s" % ast[2])
            return obj[ast[2]]
        raise CelError("type '%s' does not support field selection" % _type_name(obj))
    if k == "has":
        obj = cel_eval(ast[1][1], env)
        if isinstance(obj, dict):
            return ast[1][2] in obj
        raise CelError("invalid type for field selection")
    if k == "idx":
        obj = cel_eval(ast[1], env)
        i = cel_eval(ast[2], env)
        if isinstance(obj, list):
            if not is_num(i) or int(i) != i:
                raise _overload("_[_]", obj, i)
            if not 0 <= int(i) < len(obj):
                raise CelError("index out of bounds: %s" % i)
            return obj[int(i)]
        if isinstance(obj, dict):
            if i not in obj:
                raise CelError("no such key: %s" % (i,))
            return obj[i]
        raise _overload("_[_]", obj, i)
    if k == "un":
        v = cel_eval(ast[2], env)
        if ast[1] == "!":
            if type(v) is not bool:
                raise _overload("!_", v)
            return not v
        if is_int(v):
            return _check_int(-v)
        if isinstance(v, float):
            return -v
        if isinstance(v, Duration):
            return Duration(-v.ns)
        raise _overload("-_", v)
    if k in ("and", "or"):
        stop = k == "or"            # the value that decides: true for ||, false for &&
        vals = []
        for side in (ast[1], ast[2]):
            try:
                v = cel_eval(side, env)
            except CelError as e:
                v = e
            if v is stop:
                return stop
            vals.append(v)
        for v in vals:
            if isinstance(v, CelError):
                raise v
            if type(v) is not bool:
                raise _overload("_&&_" if k == "and" else "_||_", *vals)
        return not stop
    if k == "cond":
        c = cel_eval(ast[1], env)
        if type(c) is not bool:
            raise _overload("_?_:_", c)
        return cel_eval(ast[2] if c else ast[3], env)
    if k == "bin":
        op = ast[1]
        a = cel_eval(ast[2], env)
        b = cel_eval(ast[3], env)
        if op == "==":
            return cel_equal(a, b)
        if op == "!=":
            return not cel_equal(a, b)
        if op in ("<", "<=", ">", ">="):
            return _compare(op, a, b)
        if op == "in":
            if isinstance(b, list):
                return any(cel_equal(a, x) for x in b)
            if isinstance(b, dict):
                return a in b
            raise _overload("@in", a, b)
        return _arith(op, a, b)
    if k == "list":
        return [cel_eval(x, env) for x in ast[1]]
    if k == "map":
        return {cel_eval(a, env): cel_eval(b, env) for a, b in ast[1]}
    if k == "call":
        target = _NO_TARGET if ast[2] is None else cel_eval(ast[2], env)
        return _call(ast[1], target, [cel_eval(a, env) for a in ast[3]])
    if k == "macro":
        _, name, target, var, body, extra = ast
        coll = cel_eval(target, env)
        if isinstance(coll, dict):
            items = list(coll.keys())
        elif isinstance(coll, list):
            items = coll
        else:
            raise _overload(name, coll)
        sub = dict(env)
        if name in ("all", "exists"):
            want = name == "exists"
            err = None
            for it in items:
                sub[var] = it
                try:
                    v = cel_eval(body, sub)
                except CelError as e:
                    err = err or e
                    continue
                if type(v) is not bool:
                    raise _overload(name, v)
                if v is want:
                    return want
            if err:
                raise err
            return not want
        if name == "exists_one":
            count = 0
            for it in items:
                sub[var] = it
                v = cel_eval(body, sub)
                if type(v) is not bool:
                    raise _overload(name, v)
                count += v
            return count == 1
        if name == "filter":
            out = []
            for it in items:
                sub[var] = it
                v = cel_eval(body, sub)
                if type(v) is not bool:
                    raise _overload(name, v)
                if v:
                    out.append(it)
            return out
        out = []                    # map(x, expr) or map(x, predicate, expr)
        for it in items:
            sub[var] = it
            if extra is None:
                out.append(cel_eval(body, sub))
            else:
                keep = cel_eval(body, sub)
                if type(keep) is not bool:
                    raise _overload(name, keep)
                if keep:
                    out.append(cel_eval(extra, sub))
        return out
    raise CelError("cannot evaluate %s" % k)


def cel_value(value, schema):
    """A JSON value as CEL sees it under its schema: numbers typed by the
    schema (type: number is a double even when written 3)."""
    if value is None or not isinstance(schema, dict):
        return value
    t = schema.get("type")
    if t == "number" and is_num(value):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        return {k: cel_value(v, props.get(k) or (addl if isinstance(addl, dict) else None))
                for k, v in value.items()}
    if isinstance(value, list):
        return [cel_value(v, schema.get("items")) for v in value]
    return value
