"""A loopback HTTP server speaking the few Hugging Face Hub endpoints that push and download use."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml


def front_matter(card: str) -> str:
    """The YAML between a model card's opening `---` line and the next `---` line ('' if there is none)."""
    lines = card.split("\n")
    if not lines or lines[0] != "---" or "---" not in lines[1:]:
        return ""
    return "\n".join(lines[1:lines.index("---", 1)])


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}  # repo_id -> {"private": bool, "files": {path: bytes}, "commits": int}
        self.calls: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def do_POST(self):
                hub.calls.append(f"POST {self.path}")
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    req = json.loads(self._body())
                    repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                    hub.repos.setdefault(repo_id, {"private": req.get("visibility") == "private" or
                                                   req.get("private", False), "files": {}, "commits": 0})
                    return self._json(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})
                if path == "/api/validate-yaml":  # the model card's front matter must at least parse
                    content = json.loads(self._body())["content"]
                    yaml.safe_load(front_matter(content))
                    return self._json(200, {"warnings": [], "errors": []})
                m = re.fullmatch(r"/api/models/(.+)/(preupload|commit)/([^/]+)", path)
                if not m or m.group(1) not in hub.repos:
                    return self._json(404, {"error": f"no route or repo for {path}"})
                repo_id, action, revision = m.groups()
                if action == "preupload":
                    files = json.loads(self._body())["files"]
                    return self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                       "shouldIgnore": False} for f in files]})
                repo = hub.repos[repo_id]
                for line in self._body().splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        value = item["value"]
                        assert value["encoding"] == "base64"
                        repo["files"][value["path"]] = base64.b64decode(value["content"])
                repo["commits"] += 1
                sha = hashlib.sha1(str(repo["commits"]).encode()).hexdigest()
                return self._json(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{sha}", "commitOid": sha,
                                        "success": True})

            def _resolve(self, send_body: bool):
                hub.calls.append(f"{self.command} {self.path}")
                m = re.fullmatch(r"/(.+)/resolve/([^/]+)/(.+)", self.path.split("?")[0])
                repo = hub.repos.get(m.group(1)) if m else None
                data = repo["files"].get(m.group(3)) if repo else None
                if data is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("X-Repo-Commit", hashlib.sha1(str(repo["commits"]).encode()).hexdigest())
                self.end_headers()
                if send_body:
                    self.wfile.write(data)

            def do_HEAD(self):
                self._resolve(send_body=False)

            def do_GET(self):
                self._resolve(send_body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
