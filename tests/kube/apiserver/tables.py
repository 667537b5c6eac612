"""Table output (as=Table, what kubectl get prints), by kind: a CRD's
additionalPrinterColumns, and the built-in columns of the kinds kubectl
users look at.
"""
from .common import dumps, human_duration, is_num, parse_time, utcnow
from .selection import jsonpath


def col(name, typ="string", fmt="", prio=0, desc=""):
    return {"name": name, "type": typ, "format": fmt, "description": desc or name, "priority": prio}


def age_of(obj):
    t = parse_time((obj.get("metadata") or {}).get("creationTimestamp"))
    return human_duration((utcnow() - t).total_seconds()) if t else "<unknown>"


def pod_status_text(pod):
    """The STATUS column kubectl shows for a pod."""
    st = pod.get("status") or {}
    reason = st.get("reason") or st.get("phase") or "Pending"
    inits = st.get("initContainerStatuses") or []
    spec_inits = (pod.get("spec") or {}).get("initContainers") or []
    initializing = False
    for i, cs in enumerate(inits):
        state = cs.get("state") or {}
        sidecar = i < len(spec_inits) and spec_inits[i].get("restartPolicy") == "Always"
        term = state.get("terminated")
        if term and term.get("exitCode") == 0 and not sidecar:
            continue
        if sidecar and cs.get("started"):
            continue
        if term:
            reason = "Init:" + (term.get("reason") or "Error")
        elif (state.get("waiting") or {}).get("reason") not in (None, "PodInitializing"):
            reason = "Init:" + state["waiting"]["reason"]
        else:
            reason = "Init:%d/%d" % (i, len(spec_inits))
        initializing = True
        break
    if not initializing:
        running = False
        for cs in reversed(st.get("containerStatuses") or []):
            state = cs.get("state") or {}
            if (state.get("waiting") or {}).get("reason"):
                reason = state["waiting"]["reason"]
            elif (state.get("terminated") or {}).get("reason"):
                reason = state["terminated"]["reason"]
            elif state.get("terminated"):
                reason = "ExitCode:%d" % state["terminated"].get("exitCode", 0)
            elif state.get("running") and cs.get("ready"):
                running = True
        if reason == "Completed" and running:
            reason = "Running"
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        reason = "Terminating"
    return reason


def table_for(rt, version, objs):
    """Column definitions and rows for a list of objects of one type."""
    if rt.crd is not None:
        cols = [col("Name", fmt="name", desc="Name must be unique within a namespace.")]
        pcs = rt.columns.get(version)
        if pcs is None:
            pcs = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        for pc in pcs:
            cols.append(col(pc["name"], pc.get("type", "string"), pc.get("format", ""),
                            pc.get("priority", 0), pc.get("description", "")))

        def cells(o):
            out = [o["metadata"]["name"]]
            for pc in pcs:
                vals = jsonpath(o, pc.get("jsonPath"))
                if not vals or vals[0] is None:
                    out.append(None)
                    continue
                v = vals[0]
                t = pc.get("type", "string")
                if t == "date":
                    ts = parse_time(v)
                    out.append(human_duration((utcnow() - ts).total_seconds()) if ts else v)
                elif t == "integer" and is_num(v):
                    out.append(int(v))
                elif t == "string" and not isinstance(v, str):
                    out.append(dumps(v))
                else:
                    out.append(v)
            return out
        return cols, [cells(o) for o in objs]
    k = rt.key
    if k == ("", "pods"):
        cols = [col("Name", fmt="name"), col("Ready"), col("Status"), col("Restarts"), col("Age"),
                col("IP", prio=1), col("Node", prio=1), col("Nominated Node", prio=1),
                col("Readiness Gates", prio=1)]

        def cells(o):
            st = o.get("status") or {}
            css = st.get("containerStatuses") or []
            total = len((o.get("spec") or {}).get("containers") or [])
            ready = sum(1 for c in css if c.get("ready"))
            inits = st.get("initContainerStatuses") or []
            restarts = sum(c.get("restartCount", 0) for c in css + inits)
            return [o["metadata"]["name"], "%d/%d" % (ready, total), pod_status_text(o),
                    str(restarts), age_of(o), st.get("podIP") or "<none>",
                    (o.get("spec") or {}).get("nodeName") or "<none>", "<none>", "<none>"]
        return cols, [cells(o) for o in objs]
    if k == ("", "namespaces"):
        return [col("Name", fmt="name"), col("Status"), col("Age")], \
            [[o["metadata"]["name"], (o.get("status") or {}).get("phase", ""), age_of(o)]
             for o in objs]
    if k == ("coordination.k8s.io", "leases"):
        return [col("Name", fmt="name"), col("Holder"), col("Age")], \
            [[o["metadata"]["name"], (o.get("spec") or {}).get("holderIdentity") or "", age_of(o)]
             for o in objs]
    if k == ("", "nodes"):
        def ready(o):
            c = [x for x in (o.get("status") or {}).get("conditions") or [] if x.get("type") ==
                 "Ready"]
            return "Ready" if c and c[0].get("status") == "True" else "NotReady"
        return [col("Name", fmt="name"), col("Status"), col("Roles"), col("Age"), col("Version")], \
            [[o["metadata"]["name"], ready(o), "<none>", age_of(o),
              ((o.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion", "")]
             for o in objs]
    if k == ("", "events"):
        def last(o):
            t = parse_time(o.get("lastTimestamp") or o.get("eventTime") or
                           o["metadata"].get("creationTimestamp"))
            return human_duration((utcnow() - t).total_seconds()) if t else "<unknown>"

        def target(o):
            io = o.get("involvedObject") or {}
            return "%s/%s" % ((io.get("kind") or "").lower(), io.get("name", ""))
        return [col("Last Seen"), col("Type"), col("Reason"), col("Object"), col("Message"),
                col("Name", fmt="name", prio=1)], \
            [[last(o), o.get("type", ""), o.get("reason", ""), target(o), o.get("message", ""),
              o["metadata"]["name"]] for o in objs]
    if k == ("", "services"):
        def ports(o):
            return ",".join("%s/%s" % (p.get("port"), p.get("protocol", "TCP"))
                            for p in (o.get("spec") or {}).get("ports") or []) or "<none>"
        return [col("Name", fmt="name"), col("Type"), col("Cluster-IP"), col("External-IP"),
                col("Port(s)"), col("Age")], \
            [[o["metadata"]["name"], (o.get("spec") or {}).get("type", "ClusterIP"),
              (o.get("spec") or {}).get("clusterIP", ""), "<none>", ports(o), age_of(o)]
             for o in objs]
    if k == ("", "configmaps"):
        return [col("Name", fmt="name"), col("Data", "integer"), col("Age")], \
            [[o["metadata"]["name"], len(o.get("data") or {}) + len(o.get("binaryData") or {}),
              age_of(o)] for o in objs]
    if k == ("", "secrets"):
        return [col("Name", fmt="name"), col("Type"), col("Data", "integer"), col("Age")], \
            [[o["metadata"]["name"], o.get("type", "Opaque"), len(o.get("data") or {}), age_of(o)]
             for o in objs]
    if k == ("apps", "deployments"):
        def dep(o):
            st = o.get("status") or {}
            return [o["metadata"]["name"], "%d/%d" % (st.get("readyReplicas", 0),
                                                      (o.get("spec") or {}).get("replicas", 1)),
                    st.get("updatedReplicas", 0), st.get("availableReplicas", 0), age_of(o)]
        return [col("Name", fmt="name"), col("Ready"), col("Up-to-date", "integer"),
                col("Available", "integer"), col("Age")], [dep(o) for o in objs]
    if k == ("apiextensions.k8s.io", "customresourcedefinitions"):
        return [col("Name", fmt="name"), col("Created At", "date")], \
            [[o["metadata"]["name"], o["metadata"].get("creationTimestamp")] for o in objs]
    return [col("Name", fmt="name"), col("Age")], [[o["metadata"]["name"], age_of(o)] for o in objs]
