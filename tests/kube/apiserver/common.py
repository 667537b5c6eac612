"""Time, JSON and name formats that every part of the stand-in uses: the
API's timestamps, kubectl's human durations, compact JSON, how a field
error shows a value, and the DNS and label patterns.
"""
import datetime
import json
import re


def utcnow():
    return datetime.datetime.now(datetime.timezone.utc)


def rfc3339(t=None):
    """metav1.Time: second precision, as the real server stores it."""
    return (t or utcnow()).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(s):
    """Parses RFC 3339 (with or without fractions); None when it is not one."""
    if not isinstance(s, str):
        return None
    m = re.match(r"^(\d{4})-(\d\d)-(\d\d)[Tt](\d\d):(\d\d):(\d\d)(\.\d+)?([Zz]|[+-]\d\d:\d\d)$", s)
    if not m:
        return None
    try:
        frac = float(m.group(7)) if m.group(7) else 0.0
        tz = datetime.timezone.utc
        if m.group(8) not in ("Z", "z"):
            sign = 1 if m.group(8)[0] == "+" else -1
            tz = datetime.timezone(sign * datetime.timedelta(hours=int(m.group(8)[1:3]),
                                                             minutes=int(m.group(8)[4:6])))
        t = datetime.datetime(int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4)),
                              int(m.group(5)), int(m.group(6)), tzinfo=tz)
        return t + datetime.timedelta(seconds=frac)
    except ValueError:
        return None


def human_duration(seconds):
    """Go's k8s.io/apimachinery/pkg/util/duration.HumanDuration, which is
    what the real server puts in date columns of a Table."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return "%ds" % s
    minutes = s // 60
    if minutes < 10:
        return "%dm" % minutes if s % 60 == 0 else "%dm%ds" % (minutes, s % 60)
    if minutes < 180:
        return "%dm" % minutes
    hours = s // 3600
    if hours < 8:
        return "%dh" % hours if minutes % 60 == 0 else "%dh%dm" % (hours, minutes % 60)
    if hours < 48:
        return "%dh" % hours
    if hours < 24 * 8:
        return "%dd" % (hours // 24) if hours % 24 == 0 else "%dd%dh" % (hours // 24, hours % 24)
    if hours < 24 * 365 * 2:
        return "%dd" % (hours // 24)
    if hours < 24 * 365 * 8:
        dy = (hours // 24) % 365
        return "%dy" % (hours // 24 // 365) if dy == 0 else "%dy%dd" % (hours // 24 // 365, dy)
    return "%dy" % (hours // 24 // 365)


def dumps(obj):
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def go_value(v):
    """How a field error shows a bad value: strings quoted, numbers bare."""
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return str(v)
    return json.dumps("object" if isinstance(v, dict) else "array")


DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def is_int(v):
    """An integer as CEL and OpenAPI see one: True is not 1."""
    return type(v) is int


def is_num(v):
    return type(v) in (int, float)
