"""A Hugging Face Hub cache written by the tests, in huggingface_hub's own on-disk layout.

``models--ORG--NAME/`` holds ``blobs/<hash>`` (the file contents), ``snapshots/<commit>/<file>``
(relative symlinks into ``blobs/``) and ``refs/<revision>`` (the commit), as
``huggingface_hub.snapshot_download`` writes them (its "Manage huggingface_hub cache-system"
guide). With ``HF_HUB_CACHE`` pointing here and ``HF_HUB_OFFLINE=1`` the real resolution code
of huggingface_hub runs, and nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from edgebuild.example import example_draft_dir

ORG = "edgebuild-test"
#: the example pair, published under three ids (role -> id)
IDS = {
    "bf16": f"{ORG}/SmolLM2-135M-Instruct",
    "nvfp4": f"{ORG}/SmolLM2-135M-Instruct-NVFP4",
    "draft": f"{ORG}/SmolLM2-135M-DSpark",
}


def _blob(path: Path) -> str:
    """The blob name: sha256 of the content (the Hub names LFS blobs by their sha256)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def publish(
    cache: Path,
    repo_id: str,
    folder: Path,
    revision: str = "main",
    files: list[str] | None = None,
    commit: str | None = None,
) -> str:
    """Publish ``folder``'s top-level files (or ``files``) as ``repo_id@revision``; returns the
    commit (40 hex). Blobs are hard links where possible (the example weights are ~270 MB)."""
    names = files if files is not None else sorted(p.name for p in folder.iterdir() if p.is_file())
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    if commit is None:
        material = repo_id + revision + "".join(f"{n}:{(folder / n).stat().st_size}" for n in names)
        commit = hashlib.sha1(material.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in names:
        blob = repo / "blobs" / _blob(folder / name)
        if not blob.exists():
            try:
                os.link(folder / name, blob)
            except OSError:
                shutil.copyfile(folder / name, blob)
        link = snapshot / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)  # the Hub writes no trailing newline
    return commit


def publish_example_pair(cache: Path, bf16_dir: Path, nvfp4_dir: Path) -> dict:
    """The example BF16 target, NVFP4 target and DSpark draft under :data:`IDS`.

    Returns ``{"cache": path, "commits": {role: commit}, "ids": IDS}``.
    """
    cache.mkdir(parents=True, exist_ok=True)
    commits = {
        "bf16": publish(cache, IDS["bf16"], bf16_dir),
        "nvfp4": publish(cache, IDS["nvfp4"], nvfp4_dir),
        "draft": publish(cache, IDS["draft"], example_draft_dir()),
    }
    return {"cache": cache, "commits": commits, "ids": dict(IDS)}


# ---------------------------------------------------------------------- a local Hub server
class FakeHub:
    """A stand-in for the Hub's HTTP API on 127.0.0.1, enough for huggingface_hub's
    ``snapshot_download`` / ``list_repo_files`` (repo info, tree, resolve HEAD + GET), so the
    online code paths and their errors run without a network (``HF_ENDPOINT`` points here).

    ``add(repo_id, files)`` publishes ``{name: bytes}`` at one commit; ``gated`` /
    ``private`` make the repo answer as the Hub does without access. Every request is
    recorded in :attr:`requests` as ``(method, path)``.
    """

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self._server = None

    def add(
        self, repo_id: str, files: dict[str, bytes], gated: bool = False, private: bool = False
    ):
        commit = hashlib.sha1((repo_id + "".join(sorted(files))).encode()).hexdigest()
        self.repos[repo_id] = {"commit": commit, "files": files, "gated": gated, "private": private}
        return commit

    def start(self) -> str:
        import http.server
        import threading

        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # ---------------------------------------------------------------- routes
    def _reply(self, h, status, body=b"", headers=None, head=False):
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _error(self, h, status, code=None, message=None, head=False):
        headers = {"Content-Type": "application/json"}
        if code:
            headers["X-Error-Code"] = code
        if message:
            headers["X-Error-Message"] = message
        self._reply(h, status, json.dumps({"error": message or code}).encode(), headers, head)

    def _handle(self, h, head: bool) -> None:
        from urllib.parse import unquote, urlparse

        path = unquote(urlparse(h.path).path)
        self.requests.append(("HEAD" if head else "GET", path))
        parts = path.strip("/").split("/")
        api = parts[:2] == ["api", "models"]
        repo_id = "/".join(parts[2:4] if api else parts[0:2])
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(h, 404, "RepoNotFound", head=head)
        if repo["gated"]:
            return self._error(h, 403, "GatedRepo", "Access to model is restricted", head)
        if repo["private"]:
            msg = (
                "Invalid credentials in Authorization header"
                if h.headers.get("authorization")
                else None
            )
            return self._error(h, 401, None if msg else "RepoNotFound", msg, head)
        kind, rev = (parts[4], parts[5]) if api else (parts[2], parts[3])
        if rev not in ("main", repo["commit"]):
            return self._error(h, 404, "RevisionNotFound", head=head)
        if api and kind == "revision":
            info = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": repo["commit"],
                "siblings": [{"rfilename": f} for f in sorted(repo["files"])],
            }
            return self._reply(
                h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}
            )
        if api and kind == "tree":
            tree = [
                {"type": "file", "oid": hashlib.sha1(b).hexdigest(), "size": len(b), "path": f}
                for f, b in sorted(repo["files"].items())
            ]
            return self._reply(
                h, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}
            )
        name = "/".join(parts[4:])
        if kind != "resolve" or name not in repo["files"]:
            return self._error(h, 404, "EntryNotFound", head=head)
        body = repo["files"][name]
        headers = {"X-Repo-Commit": repo["commit"], "ETag": f'"{hashlib.sha256(body).hexdigest()}"'}
        return self._reply(h, 200, body, headers, head)


def folder_files(folder: Path) -> dict[str, bytes]:
    """``{name: bytes}`` of a folder's top-level files (for :meth:`FakeHub.add`)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
