"""Where the bytes of a save are written: a writer process per rank, or a thread as fallback.

The writer process is its own small program (`python -m ckpt.save.writer_proc`), started by the
trainer on its first save and fed through a private socket pair: the staging arena's
segments arrive once as file descriptors, then one message per file names its pieces
(literal bytes and arena ranges, see `ckpt.save.filewrite`). It never imports torch, so hashing,
page-cache copies, fsync and object-store uploads run on another core and never hold the
trainer's GIL. It dies with the trainer (PR_SET_PDEATHSIG, and on end of file on its socket),
so no orphan keeps writing into a step directory after a crash.

`ThreadSink` does the same work in the calling thread: for saves streamed from live tensors
(not staged), where memfd is missing, or with `CKPT_WRITER=thread`.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ckpt._faults import fault_point
from ckpt.errors import DiskFull, SaveFailed, StorageError
from ckpt.format.manifest import FileEntry
from ckpt.redact import redact
from ckpt.save.filewrite import PROGRESS, Fixed, Gate, Piece, piece_len
from ckpt.save.prefix import Prefixes
from ckpt.storage.pacing import writer_share
from ckpt.storage.store import Store

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")
# The writer's errors that the trainer raises as they are (the most specific first); any
# other fails the save (SaveFailed), its class named in the message.
_PASSED_ON: tuple[type[StorageError], ...] = (DiskFull, StorageError)
_MAX_FDS = 64
_START_TIMEOUT_S = 60.0
_SLOWEST_BYTES_PER_S = 1 << 20  # a write slower than this (plus timeout_s) is a hung store
# While it writes, the writer process says every so often that bytes moved (and how many are
# under way, showing nothing until done): the trainer takes one that moves nothing for
# timeout_s (plus those bytes at _SLOWEST_BYTES_PER_S) as hung, not only one past the whole
# write's deadline (hours, for a large file at _SLOWEST_BYTES_PER_S).
_BEAT_S = 0.25

# The writer's entry point: ckpt is loaded from the trainer's own copy (installed or a source
# tree), and nothing else is put ahead of the standard library or the environment's packages.
_BOOTSTRAP = """
import importlib.util, os, sys
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
init = os.path.join(sys.argv[1], "ckpt", "__init__.py")
spec = importlib.util.spec_from_file_location("ckpt", init, submodule_search_locations=[os.path.dirname(init)])
ckpt = importlib.util.module_from_spec(spec)
sys.modules["ckpt"] = ckpt
spec.loader.exec_module(ckpt)
from ckpt.save.writer_proc import main
sys.exit(main(sys.argv[2:]))
"""


class Segment(Protocol):
    """What a sink needs of an arena segment (`ckpt.save.arena.Segment`)."""

    id: int
    size: int
    fd: int

    @property
    def view(self) -> memoryview: ...


class ThreadSink:
    """Writes in the calling thread."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._prefixes = Prefixes()

    def write(
        self, rel: str, pieces: list[Piece], segments: Iterable[Segment], rank: int, step: int, fixed: Fixed | None = None,
        gate_fd: int | None = None,
    ) -> FileEntry:  # fmt: skip
        gate = Gate(gate_fd) if gate_fd is not None else None
        try:
            if fixed is not None:
                self._prefixes.learn(fixed[0], pieces[: fixed[1]])
                pieces = pieces[fixed[1] :]
            key = fixed[0] if fixed is not None else None
            return self._prefixes.write(self.store, rel, key, pieces, {s.id: s.view for s in segments}, rank, gate)
        finally:
            if gate is not None:
                gate.close()

    def close(self) -> None:
        self._prefixes.drop()


class ProcessSink:
    """Writes in a writer process of its own (started here, stopped by `close`)."""

    def __init__(self, store: Store, storage_options: dict[str, Any] | None = None, timeout_s: float = 600.0) -> None:
        self.store = store
        self.timeout_s = timeout_s
        # Fails here, in the trainer, for options that cannot be sent (a credential callable).
        transfer = writer_share(store.transfer)  # IMPORTANT: it and the trainer keep to the rank's share together
        init = pickle.dumps(("init", store.root if store.is_local else store.url, dict(storage_options or {}), transfer, store.checksum_algo))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above ckpt/save/
        try:
            # IMPORTANT: its own session, so a SIGTERM to the trainer's process group (scancel,
            # a pod runtime) leaves the preemption checkpoint's writer alive; it still dies with
            # the trainer (PR_SET_PDEATHSIG, tied to this thread: the Checkpointer's save thread,
            # which lives as long as the writer is used; and end of file on its socket).
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, src, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            theirs.close()
        self.sock = ours
        self._sent: set[int] = set()
        self._prefix_sent: int | None = None  # the key of the prefix the writer holds, its bytes
        self._prefix_bytes = 0
        self._broken = False  # a message went unanswered: never used again
        reply = self._call(init, _START_TIMEOUT_S, "starting")
        if reply[0] != "ok":
            self.close()
            raise OSError(f"the writer process cannot open {store.display}: {reply[-1]}")

    def write(
        self, rel: str, pieces: list[Piece], segments: Iterable[Segment], rank: int, step: int, fixed: Fixed | None = None,
        gate_fd: int | None = None,
    ) -> FileEntry:  # fmt: skip
        try:
            return self._write(rel, pieces, list(segments), rank, step, fixed, gate_fd)
        finally:
            if gate_fd is not None:
                os.close(gate_fd)  # sent with the write (the writer has its own), or never sent

    def _write(
        self, rel: str, pieces: list[Piece], segments: list[Segment], rank: int, step: int, fixed: Fixed | None, gate_fd: int | None
    ) -> FileEntry:
        new = [s for s in segments if s.id not in self._sent]
        for i in range(0, len(new), _MAX_FDS):
            batch = new[i : i + _MAX_FDS]
            self._call(pickle.dumps(("segments", [(s.id, s.size) for s in batch])), self.timeout_s, f"writing {rel}", [s.fd for s in batch])
            self._sent.update(s.id for s in batch)
        live = [s.id for s in segments]
        self._sent.intersection_update(live)
        if fixed is not None:  # the layout's fixed pieces go once; each write names them
            if fixed[0] != self._prefix_sent:
                head = pieces[: fixed[1]]
                self._call(pickle.dumps(("prefix", fixed[0], head), protocol=5), self.timeout_s, f"writing {rel}")
                self._prefix_sent, self._prefix_bytes = fixed[0], sum(map(piece_len, head))
            pieces = pieces[fixed[1] :]
        else:
            self._prefix_sent = None  # the writer drops its prefix (Prefixes.write)
        nbytes = sum(map(piece_len, pieces)) + (self._prefix_bytes if fixed is not None else 0)
        deadline = self.timeout_s + nbytes / _SLOWEST_BYTES_PER_S
        message = ("write", rel, pieces, live, rank, step, fixed[0] if fixed is not None else None)
        gate = [gate_fd] if gate_fd is not None else []
        reply = self._call(pickle.dumps(message, protocol=5), deadline, f"writing {rel}", gate, stall_s=self.timeout_s)
        if reply[0] == "ok":
            entry: FileEntry = reply[1]
            return entry
        self._prefix_sent = None  # whatever went wrong, the next write sends the prefix again
        kind, message = reply[1], reply[2]
        raise next((c for c in _PASSED_ON if c.__name__ == kind), SaveFailed)(message)

    def _call(self, payload: bytes, timeout_s: float, doing: str, fds: Sequence[int] = (), stall_s: float | None = None) -> Any:
        """Send one message and wait for its reply; a writer that died or hangs fails the save:
        one that answers nothing within `timeout_s` or, with `stall_s`, moves no bytes for
        that long (plus, at the slowest rate, the time for what it said is under way)."""
        deadline = time.monotonic() + timeout_s
        waited = timeout_s if stall_s is None else min(timeout_s, stall_s)
        to_deadline = waited == timeout_s  # the wait under way ends at the deadline
        try:
            self.sock.settimeout(waited)
            _send(self.sock, payload, fds)
            reply, _ = _recv(self.sock)
            while reply is not None and reply[0] == "moved":  # the heartbeat: bytes moved
                left = deadline - time.monotonic()
                stall = (stall_s or 0) + reply[1] / _SLOWEST_BYTES_PER_S
                waited, to_deadline = min(left, stall), left <= stall
                if waited <= 0:
                    raise TimeoutError
                self.sock.settimeout(waited)
                reply, _ = _recv(self.sock)
        except TimeoutError:
            self._broken = True
            self.proc.kill()
            how = f"gave no answer within {timeout_s:.0f} s" if to_deadline else f"moved no bytes for {waited:.0f} s"
            raise SaveFailed(
                f"the writer process {how} {doing} in {self.store.display} (a hung store?); "
                "it was killed and the next save starts a new one"
            ) from None
        except OSError as e:
            log.debug("writer process socket: %s", e)
            reply = None
        if reply is None:
            self._broken = True
            raise SaveFailed(f"the writer process died {doing} in {self.store.display} ({self._exit_status()})")
        return reply

    @property
    def alive(self) -> bool:
        return not self._broken and self.proc.poll() is None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # in the kernel, on a disk that stopped answering
                log.error("the writer process %d does not die (stuck in I/O?): left behind", self.proc.pid)

    def _exit_status(self) -> str:
        try:
            rc = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"


class Sinks:
    """A rank's sinks, one per store (its root, or the node spool): a writer process started on
    the first save there and again if it died; a thread of the trainer where no process can
    be (`CKPT_WRITER=thread`, an arena that cannot be shared, a child that cannot start)."""

    def __init__(self, root: Store, storage_options: dict[str, Any] | None) -> None:
        self._root, self._options = root, storage_options
        self._sinks: dict[str, ProcessSink | ThreadSink] = {}  # by the store's URL

    def open(self, store: Store, shareable: bool, timeout_s: float) -> ProcessSink | ThreadSink:
        """The sink for `store`, started if need be (a process's requests give up after
        `timeout_s`); `shareable`: the staging arena can be handed to a process."""
        sink = self._sinks.get(store.url)
        if isinstance(sink, ProcessSink) and not sink.alive:
            sink.close()
            sink = None
        if sink is None:
            if shareable and os.environ.get("CKPT_WRITER", "process") == "process":
                try:
                    sink = ProcessSink(store, self._options if store is self._root else None, timeout_s)
                except Exception as e:  # unpicklable storage options, no fork, a store the child cannot open
                    log.warning("cannot start the writer process (%s): writing in a thread of the trainer", redact(str(e)))
            if sink is None:
                sink = ThreadSink(store)
            self._sinks[store.url] = sink
        return sink

    def get(self, url: str) -> ProcessSink | ThreadSink | None:
        """The sink started for the store at `url`, if any."""
        return self._sinks.get(url)

    def values(self) -> list[ProcessSink | ThreadSink]:
        return list(self._sinks.values())

    def close(self) -> None:
        for sink in self._sinks.values():
            sink.close()
        self._sinks.clear()


def _send(sock: socket.socket, payload: bytes, fds: Sequence[int] = ()) -> None:
    header = _HEADER.pack(len(payload))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(payload)


def _recv(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message and the file descriptors that came with it; (None, []) at end of file."""
    data, fds, _, _ = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    if not data:
        return None, []
    header = data + _recv_exactly(sock, _HEADER.size - len(data))
    payload = _recv_exactly(sock, _HEADER.unpack(header)[0])
    # The peer is our own parent over a private socket pair: nothing from storage.
    return pickle.loads(payload), list(fds)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    while len(view):
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("the peer closed the socket mid-message")
        view = view[got:]
    return bytes(buf)


def _die_with_parent(parent: int) -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


class _Heartbeat:
    """The writer process's replies, and while it writes, a message every `_BEAT_S` in which
    bytes moved (`filewrite.PROGRESS`): ("moved", the bytes under way that show no progress
    until done). None comes after the write's own reply."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._lock = threading.Lock()  # one message at a time on the socket
        self._seen: tuple[int, int] | None = None  # the progress last told; None: not writing
        threading.Thread(target=self._run, name="ckpt-writer-beat", daemon=True).start()

    def writing(self) -> None:
        with self._lock:
            self._seen = (PROGRESS.moved, PROGRESS.waiting)

    def reply(self, payload: bytes) -> None:
        with self._lock:
            self._seen = None
            _send(self.sock, payload)

    def _run(self) -> None:
        while True:
            time.sleep(_BEAT_S)
            with self._lock:
                now = (PROGRESS.moved, PROGRESS.waiting)
                if self._seen is not None and now != self._seen:
                    self._seen = now
                    try:
                        _send(self.sock, pickle.dumps(("moved", now[1])))
                    except OSError:  # the trainer is gone: the main loop ends too
                        return


def serve(sock: socket.socket) -> None:
    """The writer process's loop: until the trainer closes the socket."""
    store: Store | None = None
    maps: dict[int, mmap.mmap] = {}
    prefixes = Prefixes()
    beat = _Heartbeat(sock)
    while True:
        msg, fds = _recv(sock)
        if msg is None:
            return
        if msg[0] == "init":
            try:
                store = Store(msg[1], msg[2], msg[3])
                store.checksum_algo = msg[4]
                reply: tuple[Any, ...] = ("ok",)
            except Exception as e:  # told to the trainer, which writes in a thread instead
                reply = ("err", f"{type(e).__name__}: {e}")
            beat.reply(pickle.dumps(reply))
        elif msg[0] == "segments":
            for (seg_id, size), fd in zip(msg[1], fds, strict=True):
                maps[seg_id] = mmap.mmap(fd, size, prot=mmap.PROT_READ)
                os.close(fd)
            beat.reply(pickle.dumps(("ok",)))
        elif msg[0] == "prefix":
            prefixes.learn(msg[1], msg[2])
            beat.reply(pickle.dumps(("ok",)))
        elif msg[0] == "write":
            beat.writing()
            _, rel, pieces, live, rank, step, key = msg
            gate = Gate(fds.pop()) if fds else None  # the staging copies still being made
            for fd in fds:  # none other is sent with a write
                os.close(fd)
            if set(maps) - set(live):
                prefixes.release()  # IMPORTANT: its views of a segment would keep it mapped
            for seg_id in set(maps) - set(live):
                with contextlib.suppress(BufferError):
                    maps.pop(seg_id).close()
            fault_point("writer_process", rank, step)
            try:
                if store is None:
                    raise RuntimeError("write before init")
                entry = prefixes.write(store, rel, key, pieces, {i: memoryview(maps[i]) for i in live}, rank, gate)
                reply = ("ok", entry)
            except Exception as e:  # reported to the trainer, which fails the save
                kind = next((c.__name__ for c in _PASSED_ON if isinstance(e, c)), type(e).__name__)
                reply = (
                    "err",
                    kind,
                    str(e) if isinstance(e, StorageError) else f"{type(e).__name__}: {e}",
                )
            finally:
                if gate is not None:
                    gate.close()
            beat.reply(pickle.dumps(reply))


def main(argv: list[str]) -> int:
    """`argv`: the socket's file descriptor and the trainer's pid."""
    _die_with_parent(int(argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the trainer's to handle
    logging.basicConfig(level=logging.WARNING, format="ckpt writer: %(message)s")
    with socket.socket(fileno=int(argv[0])) as sock:
        serve(sock)
    return 0
