"""TLS serving: the server's certificate (given, or a self-signed CA and a
serving certificate for 127.0.0.1 and localhost made with the openssl
command, as kube-apiserver makes one into --cert-dir when given none),
client certificates verified against --client-ca-file, and the user a
verified client certificate names (CN = user, O = groups, as Kubernetes
reads them).

make_ca() and issue() are also what tests use to make client certificates.
"""
import os
import ssl
import subprocess


def _openssl(*argv):
    r = subprocess.run(["openssl", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError("openssl %s failed: %s" % (argv[0], r.stderr.strip()))


def make_ca(directory, name="ca", cn="cohort-standin-ca"):
    """A self-signed CA (P-256) as DIR/NAME.crt and DIR/NAME.key; returns
    the two paths."""
    os.makedirs(directory, exist_ok=True)
    crt, key = os.path.join(directory, name + ".crt"), os.path.join(directory, name + ".key")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", key, "-out", crt, "-days", "2", "-subj", "/CN=" + cn,
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return crt, key


def issue(ca, directory, name, cn, groups=(), server=False, days=2):
    """A certificate signed by ca (a (crt, key) pair) as DIR/NAME.crt and
    DIR/NAME.key: a serving certificate for 127.0.0.1 and localhost when
    server, else a client certificate whose CN is the user and whose O
    entries are the groups. Returns the two paths."""
    crt, key = os.path.join(directory, name + ".crt"), os.path.join(directory, name + ".key")
    subj = "/CN=" + cn + "".join("/O=" + g for g in groups)
    ext = ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
           "-addext", "extendedKeyUsage=serverAuth"] if server else \
        ["-addext", "extendedKeyUsage=clientAuth"]
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", key, "-out", crt, "-days", str(days), "-subj", subj,
             "-CA", ca[0], "-CAkey", ca[1], "-addext", "basicConstraints=critical,CA:FALSE",
             "-addext", "keyUsage=critical,digitalSignature", *ext)
    return crt, key


def serving_files(args):
    """(cert, key, ca or None) to serve with: --tls-cert-file and
    --tls-private-key-file, or with --tls a CA and a serving certificate
    made into --cert-dir (kept when already there). (None, None, None)
    serves plain HTTP."""
    if args.tls_cert_file or args.tls_private_key_file:
        if not (args.tls_cert_file and args.tls_private_key_file):
            raise SystemExit("apiserver: --tls-cert-file and --tls-private-key-file go together")
        return args.tls_cert_file, args.tls_private_key_file, None
    if not args.tls:
        return None, None, None
    d = args.cert_dir
    ca = (os.path.join(d, "ca.crt"), os.path.join(d, "ca.key"))
    if not all(os.path.exists(p) for p in ca):
        ca = make_ca(d)
    cert = (os.path.join(d, "apiserver.crt"), os.path.join(d, "apiserver.key"))
    if not all(os.path.exists(p) for p in cert):
        cert = issue(ca, d, "apiserver", "127.0.0.1", server=True)
    return cert[0], cert[1], ca[0]


def server_context(cert, key, client_ca):
    """The SSLContext a TLS server serves with; client certificates are
    asked for and verified when client_ca names a file."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca:
        ctx.load_verify_locations(client_ca)
        # Optional, as kube-apiserver asks: a client without a certificate
        # still connects and authenticates with a token.
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def cert_user(sock):
    """The user a verified client certificate names, or None: CN is the
    name, each O a group (system:authenticated added, as Kubernetes
    does)."""
    getpeercert = getattr(sock, "getpeercert", None)
    if getpeercert is None:
        return None
    try:
        cert = getpeercert()
    except (ValueError, OSError):
        return None
    if not cert:
        return None
    cn, groups = None, []
    for rdn in cert.get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                cn = v
            elif k == "organizationName":
                groups.append(v)
    if not cn:
        return None
    return {"name": cn, "groups": groups + ["system:authenticated"]}
