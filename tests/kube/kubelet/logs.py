"""Container logs over HTTP: the kubelet's /containerLogs, which the API
server proxies pods/log to (follow, previous, tailLines).
"""
import http.server
import os
import time
import urllib.parse


class LogHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def do_GET(self):
        u = urllib.parse.urlsplit(self.path)
        q = dict(urllib.parse.parse_qsl(u.query))
        parts = [p for p in u.path.split("/") if p]
        if len(parts) != 4 or parts[0] != "containerLogs":
            return self._text(404, "not found\n")
        kubelet = self.server.kubelet
        w, c = kubelet.find_container(parts[1], parts[2], parts[3])
        if c is None:
            return self._text(404, 'container "%s" in pod "%s" not found\n' % (parts[3], parts[2]))
        restart = c.restarts
        if q.get("previous") in ("true", "1"):
            if restart == 0:
                return self._text(400, 'previous terminated container "%s" in pod "%s" not found\n'
                                  % (parts[3], parts[2]))
            restart -= 1
        path = os.path.join(w.log_dir, c.name, "%d.log" % restart)
        if not os.path.exists(path) and restart > 0:      # waiting to restart: show the last run
            restart -= 1
            path = os.path.join(w.log_dir, c.name, "%d.log" % restart)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            data = b""
        if q.get("tailLines"):
            n = int(q["tailLines"])
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-n:]) if n > 0 else b""
        follow = q.get("follow") in ("true", "1") and q.get("previous") not in ("true", "1")
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            if data:
                self._chunk(data)
            if follow:
                with open(path, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    while True:
                        more = f.read(65536)
                        if more:
                            self._chunk(more)
                            continue
                        if not c.running() or c.restarts != restart or kubelet.stopping.is_set():
                            break
                        time.sleep(0.1)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True

    def _chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _text(self, code, text):
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
