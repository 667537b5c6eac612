"""Errors: every failure leaves as a metav1.Status. ApiError carries the
HTTP code and reason; FieldError is one entry of a 422 Invalid's
field.ErrorList, worded as apimachinery words it.
"""
from .common import go_value


class ApiError(Exception):
    """A failure answered as a metav1.Status with this HTTP code."""

    def __init__(self, code, reason, message, details=None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self):
        st = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
              "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            st["details"] = self.details
        return st


def err_not_found(rt, name):
    return ApiError(404, "NotFound", '%s "%s" not found' % (rt.qualified, name),
                    {"name": name, "group": rt.group, "kind": rt.plural})


def err_conflict(rt, name, why=None):
    msg = ('Operation cannot be fulfilled on %s "%s": %s' %
           (rt.qualified, name, why or "the object has been modified; please apply your "
            "changes to the latest version and try again"))
    return ApiError(409, "Conflict", msg, {"name": name, "group": rt.group, "kind": rt.plural})


def err_bad_request(msg):
    return ApiError(400, "BadRequest", msg)


class FieldError:
    """One entry of field.ErrorList, formatted the way apimachinery does."""

    def __init__(self, kind, field, bad=None, detail="", shown=None):
        # Invalid, Required, NotSupported, Forbidden, TooLong, TooMany, Duplicate, NotFound
        self.kind = kind
        self.field = field
        self.bad = bad
        self.detail = detail
        self.shown = shown        # preformatted bad value, e.g. '"object"' for CEL errors
        self.blocking = False     # a type error: CEL rules are not run after one

    def body(self):
        bad = self.shown if self.shown is not None else go_value(self.bad)
        if self.kind == "Required":
            return "Required value" + (": " + self.detail if self.detail else "")
        if self.kind == "Forbidden":
            return "Forbidden" + (": " + self.detail if self.detail else "")
        if self.kind == "NotSupported":
            return "Unsupported value: %s: %s" % (bad, self.detail)
        if self.kind == "TooLong":
            return "Too long: " + self.detail
        if self.kind == "TooMany":
            return "Too many: %s: %s" % (bad, self.detail)
        if self.kind == "Duplicate":
            return "Duplicate value: %s" % bad
        if self.kind == "NotFound":
            return "Not found: %s" % bad
        return "Invalid value: %s: %s" % (bad, self.detail)

    def reason(self):
        return {"Required": "FieldValueRequired", "Forbidden": "FieldValueForbidden",
                "NotSupported": "FieldValueNotSupported", "TooLong": "FieldValueTooLong",
                "TooMany": "FieldValueTooMany", "Duplicate": "FieldValueDuplicate",
                "NotFound": "FieldValueNotFound", "Type": "FieldValueTypeInvalid"}.get(
                    self.kind, "FieldValueInvalid")

    def __str__(self):
        return "%s: %s" % (self.field, self.body()) if self.field else self.body()


def err_invalid(rt, name, errs):
    """422 Invalid, as errors.NewInvalid builds it."""
    text = str(errs[0]) if len(errs) == 1 else "[" + ", ".join(str(e) for e in errs) + "]"
    qual = rt.kind + ("." + rt.group if rt.group else "")
    causes = [{"reason": e.reason(), "message": e.body(), "field": e.field} for e in errs]
    return ApiError(422, "Invalid", '%s "%s" is invalid: %s' % (qual, name, text),
                    {"name": name, "group": rt.group, "kind": rt.kind, "causes": causes})
