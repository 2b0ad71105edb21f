"""What the node agent takes from the spool's `jobs/`, which whoever runs a trainer on the
node can write: each hand-off request, parsed once per version of its file (a malformed
one is none, and never stops the agent), and the store a request may send files to (under
`allowed_roots`, on the agent's own endpoint, with the agent's own credentials).
"""

from __future__ import annotations

import json
import os
import threading

import fsspec

from ckpt.agent.config import Config, within
from ckpt.errors import InvalidCheckpoint
from ckpt.node.spool import FAILED, Request, public_options, read_json, status_of
from ckpt.redact import redact
from ckpt.storage.store import Store, Transfer


class Requests:
    """The request files of a spool, each parsed once per version of it (its mtime)."""

    def __init__(self) -> None:
        self._parsed: dict[str, tuple[float, Request | None]] = {}  # path -> (mtime, parsed)

    def get(self, path: str) -> Request | None:
        """The request in a file; None when it is missing, malformed or passed over."""
        try:
            mtime = os.lstat(path).st_mtime_ns
        except OSError:
            return None
        cached = self._parsed.get(path)
        if cached is None or cached[0] != mtime:
            cached = self._parsed[path] = (mtime, _load(path))
        return cached[1]

    def state(self, path: str) -> str | None:
        """The request's state by the agent's status file (`Request.state`); FAILED for a
        file that holds no request."""
        request = self.get(path)
        return request.state(read_json(status_of(path))) if request is not None else FAILED

    def keep_only(self, paths: list[str]) -> None:
        """Forget the files that are gone."""
        for gone in set(self._parsed) - set(paths):
            del self._parsed[gone]

    def pass_over(self, path: str) -> None:
        """Take the file for no request until it changes."""
        if path in self._parsed:
            self._parsed[path] = (self._parsed[path][0], None)


def _load(path: str) -> Request | None:
    try:
        return Request.from_doc(read_json(path))
    except (ValueError, TypeError):
        return None


def handed_off_bytes(request_path: str, name: str) -> int:
    """The size of a file a request hands off, as the spool holds it now (0: not there)."""
    try:
        return os.lstat(os.path.join(os.path.dirname(os.path.dirname(request_path)), name)).st_size
    except OSError:
        return 0


class Roots:
    """The stores requests send files to, one per root and options, opened on first use."""

    def __init__(self, config: Config, transfer: Transfer) -> None:
        self.config = config
        self._transfer = transfer
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()

    def store(self, request: Request) -> Store:
        """The store of the request's root; InvalidCheckpoint for a root or endpoint the
        agent must not write to."""
        root = request.root
        if fsspec.utils.get_protocol(root) == "file":
            # IMPORTANT: a local root as resolved now, checked and written the same: writes
            # walk it from / following no link (`durable.open_new`), so a link swapped in later
            # is refused rather than followed past allowed_roots.
            root = os.path.realpath(os.path.expanduser(root.split("://", 1)[-1]))
        if self.config.allowed_roots and not any(within(root, p) for p in self.config.allowed_roots):
            raise InvalidCheckpoint(f"{redact(request.root)} is not under the agent's allowed_roots")
        # IMPORTANT: a trainer says where the store is (endpoint, region), never more: the
        # agent's own credentials go only where its config says, and with allowed_roots, a
        # root is under them on the agent's own endpoint, not on one the request names.
        asked = public_options(request.storage_options)
        if self.config.allowed_roots and _endpoint(asked) not in (None, _endpoint(self.config.storage_options)):
            raise InvalidCheckpoint(f"{redact(request.root)}: the request names another endpoint ({redact(str(_endpoint(asked)))}) than the agent's")
        options = {**asked, **self.config.storage_options}
        key = json.dumps([root, options], sort_keys=True, default=str)
        with self._lock:
            if key not in self._stores:
                self._stores[key] = Store(root, options, self._transfer)
            return self._stores[key]


def _endpoint(options: dict) -> str | None:
    """The endpoint storage options name (s3fs takes it at the top or in client_kwargs)."""
    return options.get("endpoint_url") or (options.get("client_kwargs") or {}).get("endpoint_url")
