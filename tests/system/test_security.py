"""Security: signed manifests, nothing unpickled unguarded, no secret in any output of a run,
no path out of the root, listeners on loopback.

Real parts: Checkpointers saving with DCP, 2-rank jobs of tests/workers/worker.py over gloo, a real
`ckpt agent` process, the `ckpt` CLI as a subprocess, the moto S3 server on loopback.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import boto3
import pytest
import torch

import ckpt
from ckpt.agent.config import Config
from ckpt.agent.daemon import Agent
from ckpt.errors import InvalidCheckpoint, RestoreFailed
from ckpt.format.manifest import Manifest
from ckpt.format.signing import SigningKey
from ckpt.metrics import Metrics
from ckpt.node.spool import Request, Spool, check_request, read_json, status_of
from ckpt.storage.store import Store
from tests.support.cli import ckpt_cli
from tests.support.cli import start as start_ckpt
from tests.support.jobs import RANKS, rank_logs
from tests.support.launch import REPO, WORKERS, free_port, start, wait

CLI = [sys.executable, "-m", "ckpt.cli.main"]
WORKER = WORKERS / "worker.py"
KEY = "signing-key-0123456789-abcdef-Nr1"
OTHER_KEY = "another-key-0123456789-abcdef-Nr2"


def step_dir(step: int) -> str:
    return f"step-{step:010d}"


def train(root: Path | str, steps: int, *, key: str | None = None, restore: str | int = "latest", **kw) -> ckpt.Checkpointer:
    """A one-process job saving every step with real DCP; returns its Checkpointer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckpt.Checkpointer(
        str(root), model=model, optimizer=opt, interval=ckpt.Every(steps=1), keep=kw.pop("keep", ckpt.Keep(last=100)),
        restore=restore, signing_key=key, **kw,
    ) as cp:
        for _ in range(cp.step, steps):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
    return cp


def manifest_doc(root: Path, step: int) -> dict:
    return json.loads((root / step_dir(step) / "manifest.json").read_text())


def write_manifest(root: Path, step: int, doc: dict) -> None:
    (root / step_dir(step) / "manifest.json").write_text(json.dumps(doc))


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return ckpt_cli(*args, env=env)


def one_line_error(r: subprocess.CompletedProcess, rc: int = 2) -> str:
    assert r.returncode == rc, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.fixture(autouse=True)
def _thread_writer(monkeypatch):
    monkeypatch.setenv("CKPT_WRITER", "thread")  # in-process jobs: no writer process to spawn
    for name in ("CKPT_SIGNING_KEY", "CKPT_SIGNING_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)


# -- 1. signing ---------------------------------------------------------------------------------
def test_with_a_key_tampered_and_unsigned_checkpoints_are_passed_over_saying_why(tmp_path, caplog):
    root = tmp_path / "root"
    train(root, 3, key=KEY)
    for step in (1, 2, 3):
        sig = manifest_doc(root, step)["signature"]
        assert sig["alg"] == "hmac-sha256" and sig["key_id"] == SigningKey(KEY).key_id and len(sig["mac"]) == 64
    # Step 3: a file entry changed under the old signature (another file's bytes and checksum).
    doc = manifest_doc(root, 3)
    doc["files"]["__0_0.distcp"] = manifest_doc(root, 2)["files"]["__0_0.distcp"]
    (root / step_dir(3) / "__0_0.distcp").write_bytes((root / step_dir(2) / "__0_0.distcp").read_bytes())
    write_manifest(root, 3, doc)
    # Step 4: saved by a job without the key, so unsigned.
    train(root, 4, restore=2)
    assert "signature" not in manifest_doc(root, 4)

    with caplog.at_level(logging.WARNING, logger="ckpt"):
        cp = train(root, 4, key=KEY, save_on_exit=False)
    assert cp.restored_step == 2
    assert f"{step_dir(4)}: unsigned, and a signing key" in caplog.text
    assert f"{step_dir(3)}: its signature does not match its content" in caplog.text
    assert KEY not in caplog.text

    # Without a key, signatures are not checked: the newest commit restores as ever.
    assert train(root, 4, save_on_exit=False).restored_step == 4
    # A step asked for by number is refused just the same.
    with pytest.raises(RestoreFailed, match="unsigned"):
        train(root, 5, key=KEY, restore=4)


def test_with_the_wrong_key_nothing_is_trusted_and_the_restore_fails_instead_of_starting_over(tmp_path):
    root = tmp_path / "root"
    train(root, 2, key=KEY)
    before = sorted(p.relative_to(root) for p in root.rglob("*") if "events" not in p.parts)
    with pytest.raises(RestoreFailed) as e:
        train(root, 3, key=OTHER_KEY)
    assert "signed with another key" in str(e.value) and "restore='none'" in str(e.value)
    assert KEY not in str(e.value) and OTHER_KEY not in str(e.value)
    assert sorted(p.relative_to(root) for p in root.rglob("*") if "events" not in p.parts) == before


def test_the_key_comes_from_a_key_file_then_the_environment_and_is_never_shown(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    monkeypatch.setenv("CKPT_SIGNING_KEY", OTHER_KEY)
    assert SigningKey.resolve().key_id == SigningKey(OTHER_KEY).key_id
    monkeypatch.setenv("CKPT_SIGNING_KEY_FILE", str(key_file))
    key = SigningKey.resolve()
    assert key.key_id == SigningKey(KEY).key_id  # the file wins; its newline is not key
    assert SigningKey.resolve(OTHER_KEY.encode()).key_id == SigningKey(OTHER_KEY).key_id
    assert KEY not in repr(key) and KEY not in str(vars(ckpt.Checkpointer(str(tmp_path / "r"))))
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(key)
    with pytest.raises(ValueError, match="at least 16 bytes") as e:
        SigningKey("short-secret")
    assert "short-secret" not in str(e.value)
    monkeypatch.setenv("CKPT_SIGNING_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read the signing key file"):
        ckpt.Checkpointer(str(tmp_path / "r"))


def test_a_signature_survives_json_and_a_copy_but_not_a_change(tmp_path):
    key = SigningKey(KEY)
    m = key.sign(Manifest(step=1, world_size=2, created=time.time(), files={}, counters={"step": 1, "tokens": 3}, user={"run": "a", "n": [1, 2.5]}))
    parsed = Manifest.from_json(m.to_json())
    assert key.check(parsed) == ("signed-ok", "")
    for field, value in (("world_size", 3), ("user", {"run": "b", "n": [1, 2.5]}), ("created", m.created + 1)):
        changed = Manifest.from_json(m.to_json())
        setattr(changed, field, value)
        assert key.check(changed)[0] == "BAD", field
    assert SigningKey(OTHER_KEY).check(parsed)[0] == "BAD"
    with pytest.raises(InvalidCheckpoint, match="signature"):
        Manifest.from_json(json.dumps({**json.loads(m.to_json()), "signature": "x"}).encode())


def test_a_signing_job_checksums_its_files_with_blake3_so_that_the_signature_covers_the_data(tmp_path, monkeypatch, caplog):
    """xxh3-64 is not cryptographic: a signature over xxh3 checksums would not stop a forger who
    crafts data with the same checksums. A job with a key checksums every file, per block
    too, with BLAKE3; checkpoints signed over xxh3 (an earlier ckpt) still restore, with a
    warning."""
    import blake3

    monkeypatch.setenv("CKPT_WRITER", "process")  # the writer process must learn the algorithm too
    caplog.set_level(logging.WARNING, logger="ckpt")
    root = tmp_path / "root"

    def job(steps: int, key: str | None) -> ckpt.Checkpointer:
        model = torch.nn.Linear(1024, 768)  # a 3 MB data file: checksummed per block
        with ckpt.Checkpointer(str(root), model=model, interval=ckpt.Every(steps=1), keep=ckpt.Keep(last=100), signing_key=key) as cp:
            for _ in range(cp.step, steps):
                with torch.no_grad():
                    model.weight.add_(0.5)
                cp.step_done()
        return cp

    def algorithms(step: int) -> set[str]:
        return {e["checksum"].partition(":")[0] for e in manifest_doc(root, step)["files"].values()}

    job(1, None)
    assert algorithms(1) == {"xxh3_64", "xxh3_64-blocks"}  # without a key, as ever
    # Step 1 signed as an earlier ckpt signed: over its xxh3 checksums. Trusted, with a warning.
    write_manifest(root, 1, json.loads(SigningKey(KEY).sign(Manifest.from_json((root / step_dir(1) / "manifest.json").read_bytes())).to_json()))
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert job(1, KEY).restored_step == 1
    assert f"{step_dir(1)} is signed, but .metadata, __0_0.distcp carry xxh3-64 checksums" in caplog.text

    assert job(3, KEY).restored_step == 1
    for step in (2, 3):
        assert algorithms(step) == {"blake3", "blake3-blocks"}
        for name, e in manifest_doc(root, step)["files"].items():  # computed here independently
            data = (root / step_dir(step) / name).read_bytes()
            if e["block"]:
                blocks = [blake3.blake3(data[i : i + e["block"]]).hexdigest() for i in range(0, len(data), e["block"])]
                assert e["blocks"] == blocks and len(blocks) > 2, name
                assert e["checksum"] == "blake3-blocks:" + blake3.blake3(b"".join(bytes.fromhex(b) for b in blocks)).hexdigest()
            else:
                assert e["checksum"] == "blake3:" + blake3.blake3(data).hexdigest(), name
    assert "cannot start the writer process" not in caplog.text  # written there, not in a thread
    # One byte of step 3's second block changed: caught by BLAKE3, and step 2 restores.
    data_file = root / step_dir(3) / "__0_0.distcp"
    blob = bytearray(data_file.read_bytes())
    blob[(1 << 20) + 12345] ^= 0x01
    data_file.write_bytes(bytes(blob))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert job(3, KEY).restored_step == 2
    assert "checksum mismatch" in caplog.text and "xxh3" not in caplog.text
    assert "CORRUPT" in cli("verify", str(root), "--deep", "--step", "3").stdout


def test_a_checksum_this_ckpt_cannot_check_is_never_trusted(tmp_path, caplog):
    root = tmp_path / "root"
    train(root, 2)
    doc = manifest_doc(root, 2)
    doc["files"][".metadata"]["checksum"] = "sha1:" + "0" * 40  # a newer ckpt's, or planted
    write_manifest(root, 2, doc)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert train(root, 2, save_on_exit=False).restored_step == 1
    assert "its checksum is 'sha1', which this ckpt cannot check (it knows xxh3_64, blake3)" in caplog.text
    r = cli("verify", str(root), "--step", "2")
    assert r.returncode == 1 and "'sha1', which this ckpt cannot check" in r.stdout, (r.stdout, r.stderr)


def _plant_unsigned(root: Path, like: int, step: int) -> dict:
    """A copy of checkpoint `like` as step `step`, unsigned and dated an hour ahead: the newest
    commit by its manifest, as someone with write access to the root could make it."""
    shutil.copytree(root / step_dir(like), root / step_dir(step))
    doc = manifest_doc(root, like)
    del doc["signature"]
    doc["step"], doc["created"] = step, doc["created"] + 3600
    write_manifest(root, step, doc)
    return doc


def test_with_a_key_retention_counts_only_trusted_checkpoints_and_leaves_the_others_alone(tmp_path):
    root = tmp_path / "root"
    train(root, 2, key=KEY)
    planted = _plant_unsigned(root, like=2, step=50)
    cp = train(root, 5, key=KEY, keep=ckpt.Keep(last=2))
    # Restored the newest trusted one (50 is passed over), then kept the two newest trusted (the
    # restored one retired as the run left). Counting the planted one as the newest would have
    # deleted step 4.
    assert cp.restored_step == 2
    assert sorted(p.name for p in root.glob("step-*")) == [step_dir(s) for s in (4, 5, 50)]
    assert manifest_doc(root, 50) == planted  # neither counted nor deleted


def test_ckpt_gc_with_a_key_keeps_the_newest_trusted_and_leaves_the_untrusted_alone(tmp_path):
    root = tmp_path / "root"
    train(root, 4, key=KEY)
    shutil.rmtree(root / step_dir(2))
    _plant_unsigned(root, like=1, step=2)  # below the newest step, dated after it
    keyless = cli("gc", str(root), "--keep-last", "1", "--dry-run")  # signatures unchecked
    assert f"would delete {root}/{step_dir(4)}" in keyless.stdout, keyless.stdout + keyless.stderr  # every trusted one
    assert "holds signed checkpoints but no signing key was given" in keyless.stderr
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    r = cli("gc", str(root), "--keep-last", "1", "--signing-key-file", str(key_file))
    assert r.returncode == 0, r.stdout + r.stderr
    # Not debris either, though below the newest commit: it may be a run's from before a key rotation.
    assert sorted(p.name for p in root.glob("step-*")) == [step_dir(2), step_dir(4)]
    assert f"left alone (not counted, not deleted): {root}/{step_dir(2)}: unsigned" in r.stdout
    # `rm` with the key protects the newest signed one, not the newest by date.
    refused = cli("rm", str(root), "--step", "4", "--signing-key-file", str(key_file))
    assert "newest committed checkpoint" in one_line_error(refused)
    gone = cli("rm", str(root), "--step", "2", env={"CKPT_SIGNING_KEY_FILE": str(key_file)})
    assert gone.returncode == 0 and sorted(p.name for p in root.glob("step-*")) == [step_dir(4)], gone.stderr
    for out in (r, refused, gone):
        assert KEY not in out.stdout + out.stderr


@pytest.fixture
def signed_root(tmp_path) -> tuple[Path, Path]:
    """(a root whose steps 1-2 are signed with KEY and step 3 is not, a file holding KEY)."""
    root = tmp_path / "root"
    train(root, 2, key=KEY)
    train(root, 3)  # step 3 unsigned
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    return root, key_file


def test_ckpt_verify_reports_signed_ok_bad_and_unsigned_and_fails_on_untrusted(tmp_path, signed_root):
    root, key_file = signed_root
    ok = cli("verify", str(root), "--signing-key-file", str(key_file), "--step", "2")
    assert ok.returncode == 0 and f"{step_dir(2)}  ok  signed-ok" in ok.stdout, ok.stdout + ok.stderr
    doc = manifest_doc(root, 1)
    doc["user"] = {"forged": True}
    write_manifest(root, 1, doc)
    everything = cli("verify", str(root), "--json", env={"CKPT_SIGNING_KEY_FILE": str(key_file)})
    assert everything.returncode == 1, everything.stderr
    verdicts = {c["step"]: c["signature"] for c in json.loads(everything.stdout)["checkpoints"]}
    assert verdicts == {1: "BAD", 2: "signed-ok", 3: "unsigned"}
    by_env = cli("verify", str(root), "--step", "3", env={"CKPT_SIGNING_KEY": KEY})
    assert by_env.returncode == 1 and "UNTRUSTED  unsigned" in by_env.stdout
    keyless = cli("verify", str(root), "--step", "2")  # no key: signatures are not checked
    assert keyless.returncode == 0 and "signed" not in keyless.stdout
    missing = cli("verify", str(root), "--signing-key-file", str(tmp_path / "nope"))
    assert "cannot read the signing key file" in one_line_error(missing)
    # A copy keeps the signature: the destination verifies with the key.
    assert cli("cp", str(root), str(tmp_path / "copy"), "--step", "2").returncode == 0
    copied = cli("verify", str(tmp_path / "copy"), "--signing-key-file", str(key_file))
    assert copied.returncode == 0 and "signed-ok" in copied.stdout, copied.stdout + copied.stderr
    for r in (ok, everything, by_env, keyless, missing, copied):
        assert KEY not in r.stdout + r.stderr


def test_with_a_key_cp_restore_export_and_diff_use_only_a_checkpoint_signed_with_it(tmp_path, signed_root):
    """The verbs that read a whole checkpoint trust what `show` trusts: with a key, the newest
    signed one (saying which newer ones they passed over), and a step not signed with it is
    refused (exit 1; diff 2, its 1 being "they differ"); without one, the newest by commit, as before."""
    root, key_file = signed_root
    keyed = ("--signing-key-file", str(key_file))
    copied = cli("cp", str(root), str(tmp_path / "copy"), *keyed)
    assert copied.returncode == 0 and step_dir(2) in copied.stdout, copied.stdout + copied.stderr
    assert f"{step_dir(3)} (" in copied.stderr  # passed over, said
    assert sorted(p.name for p in (tmp_path / "copy").glob("step-*")) == [step_dir(2)]
    restored = cli("restore", str(root), "--to", str(tmp_path / "to"), env={"CKPT_SIGNING_KEY_FILE": str(key_file)})
    assert restored.returncode == 0 and sorted(p.name for p in (tmp_path / "to").glob("step-*")) == [step_dir(2)], restored.stderr
    exported = cli("export", str(root), "--format", "torch", "--out", str(tmp_path / "x.pt"), *keyed)
    assert exported.returncode == 0 and step_dir(2) in exported.stdout, exported.stdout + exported.stderr
    for refused, rc in (
        (cli("cp", str(root), str(tmp_path / "copy3"), "--step", "3", *keyed), 1),
        (cli("export", str(root), "--step", "3", "--format", "torch", "--out", str(tmp_path / "y.pt"), *keyed), 1),
        (cli("diff", f"{root}:2", f"{root}:3", *keyed), 2),  # diff's 1 means "they differ"
        (cli("load-test", str(root), "--world-size", "2", "--step", "3", *keyed), 1),
    ):
        assert "step 3 is untrusted: " in one_line_error(refused, rc=rc), refused.stderr
    assert not (tmp_path / "copy3").exists() and not (tmp_path / "y.pt").exists()
    keyless = cli("cp", str(root), str(tmp_path / "copy-any"))
    assert keyless.returncode == 0 and sorted(p.name for p in (tmp_path / "copy-any").glob("step-*")) == [step_dir(3)]
    for r in (copied, restored, exported, keyless):
        assert KEY not in r.stdout + r.stderr


def test_ckpt_ls_and_show_say_whose_signature_a_checkpoint_carries_and_with_a_key_whether_it_holds(tmp_path, signed_root):
    root, key_file = signed_root
    kid = SigningKey(KEY).key_id

    def rows(r: subprocess.CompletedProcess) -> dict[str, str]:
        assert r.returncode == 0 and r.stdout.splitlines()[0].split()[-1] == "SIGNATURE", r.stdout + r.stderr
        return {line.split()[0]: line for line in r.stdout.splitlines()[1:] if line.split() and line.split()[0].isdigit()}

    keyless = cli("ls", str(root))
    assert rows(keyless)["2"].endswith(f"key {kid}, not checked") and rows(keyless)["3"].endswith("unsigned"), keyless.stdout
    keyed = cli("ls", str(root), "--signing-key-file", str(key_file))
    assert " committed " in rows(keyed)["2"] and rows(keyed)["2"].endswith("signed-ok"), keyed.stdout
    assert " untrusted " in rows(keyed)["3"] and rows(keyed)["3"].endswith("unsigned"), keyed.stdout
    docs = {d["step"]: d for d in json.loads(cli("ls", str(root), "--json", env={"CKPT_SIGNING_KEY": KEY}).stdout)}
    assert [(docs[n]["state"], docs[n]["signature"], docs[n]["signed_key_id"]) for n in (2, 3)] == [("committed", "signed-ok", kid), ("untrusted", "unsigned", None)]
    assert {d["signature"] for d in json.loads(cli("ls", str(root), "--json").stdout)} == {None}  # not checked without a key
    # `show`: without a key the newest by commit (unsigned step 3); with one, the newest
    # signed, saying on stderr which newer ones it passed over.
    assert "signature: unsigned" in cli("show", str(root)).stdout
    assert f"signature: key {kid}, not checked (no key given)" in cli("show", str(root), "--step", "2").stdout
    shown = cli("show", str(root), "--signing-key-file", str(key_file))
    assert shown.returncode == 0 and f"{step_dir(2)}\n" in shown.stdout and f"signature: signed-ok (key {kid})" in shown.stdout, shown.stdout + shown.stderr
    assert f"not signed with the key are not shown: {step_dir(3)}" in shown.stderr
    doc = json.loads(cli("show", str(root), "--json", env={"CKPT_SIGNING_KEY": KEY}).stdout)
    assert (doc["dir"], doc["signature"], doc["signed_key_id"]) == (step_dir(2), "signed-ok", kid)
    refused = cli("show", str(root), "--step", "3", "--signing-key-file", str(key_file))
    assert "step 3 is untrusted: " in one_line_error(refused, rc=1) and "not trusted" in refused.stderr
    # A key id that is not one (a planted manifest's) is not printed as it is.
    doc = manifest_doc(root, 1)
    doc["signature"]["key_id"] = "\x1b[2Jevil"
    write_manifest(root, 1, doc)
    assert "\x1b" not in cli("ls", str(root)).stdout and "(not a key id)" in cli("ls", str(root)).stdout
    # A root with no signed checkpoint and no key lists as it always did.
    plain = tmp_path / "plain"
    train(plain, 1)
    assert "SIGNATURE" not in cli("ls", str(plain)).stdout
    for r in (keyless, keyed, shown, refused):
        assert KEY not in r.stdout + r.stderr


@pytest.mark.slow
def test_a_manifest_the_agent_commits_is_signed_though_the_key_never_reaches_the_spool_or_the_agent(tmp_path):
    from tests.support.agentd import agent, until

    spool, root = tmp_path / "spool", tmp_path / "root"
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    ranks_env = {"CKPT_SPOOL": str(spool), "CKPT_SIGNING_KEY_FILE": str(key_file)}
    common = ("--root", root, "--every", 5, "--log-level", "DEBUG")
    with agent(spool, tmp_path / "agent.log") as a:  # the agent's environment holds no key
        # Both ranks die right after handing step 5 off: only the agent can commit it.
        procs = start(RANKS, WORKER, *map(str, (*common, "--steps", 5, "--no-save-on-exit")), env={**ranks_env, "CKPT_FAULT": "after_handoff:*:5"}, log_dir=tmp_path)
        assert wait(procs) == [-signal.SIGKILL] * RANKS, rank_logs(tmp_path)
        until("the agent to commit step 5", lambda: (root / step_dir(5) / "manifest.json").exists(), logs=a.text)
        until("the agent to log its commit", lambda: "committed" in a.text(), logs=a.text)  # logged after the write
        spool_bytes = b"".join(p.read_bytes() for p in spool.rglob("*") if p.is_file())
        drafts = list((root / step_dir(5) / ".durable").glob("*.draft"))
        assert len(drafts) == 1 and b'"signature"' in drafts[0].read_bytes()  # rank 0's draft, signed, in the root
        # The restart restores the agent's commit, trusting it by its signature.
        procs = start(RANKS, WORKER, *map(str, (*common, "--steps", 7, "--out", tmp_path / "out")), env=ranks_env, log_dir=tmp_path)
        assert wait(procs) == [0] * RANKS, rank_logs(tmp_path)
        agent_log = a.text()
    key = SigningKey(KEY)
    assert key.check(Manifest.from_json((root / step_dir(5) / "manifest.json").read_bytes()))[0] == "signed-ok"
    handed_off = Manifest.from_json((root / step_dir(5) / "manifest.json").read_bytes()).files.values()
    assert {e.checksum.partition(":")[0] for e in handed_off} == {"blake3"}  # written to the spool as to the root
    assert key.check(Manifest.from_json((root / step_dir(7) / "manifest.json").read_bytes()))[0] == "signed-ok"
    assert [torch.load(f"{tmp_path / 'out'}.rank{r}.pt", weights_only=True)["restored_step"] for r in range(RANKS)] == [5] * RANKS
    for blob in (spool_bytes, agent_log.encode(), *(p.read_bytes() for p in spool.rglob("*") if p.is_file())):
        assert KEY.encode() not in blob


# -- 2. nothing is unpickled unguarded ----------------------------------------------------------
# Each unpickling in ckpt/ that is not torch.load(weights_only=True), and why it is safe.
ALLOWED_UNPICKLING = {
    ("writer_proc.py", "_recv", "pickle.loads"): "messages from our own parent over a private socket pair, never storage",
    ("collectives.py", "Group", "pickle.loads"): "objects of this job's own ranks over ckpt's gloo group (as torch's "
    "broadcast_object_list and gather_object, which it replaces, unpickled them), never storage",
    ("dcp_metadata.py", "_MetadataUnpickler", "pickle._Unpickler"): "the allowlisting unpickler of checksum-verified .metadata",
    ("dcp_metadata.py", "load_metadata", "_MetadataUnpickler"): "checksum-verified bytes, through the allowlist",
    ("bytes_item.py", "_PlainUnpickler", "pickle._Unpickler"): "the unpickler that refuses every global, "
    "extension code and persistent id: plain values only (test_restore_stream.py's plain-value tests)",
    ("bytes_item.py", "_plain", "_PlainUnpickler"): "checksum-verified bytes, through the refusing unpickler",
    ("bytes_item.py", "load_plain_pickle", "_PlainUnpickler"): "a pickle of another tool's (torchtitan's data loader "
    "position), through the refusing unpickler: plain values only (test_metadata_unpickler.py)",
}
PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
# The C unpickler's names and the pure-Python one's (pickle._Unpickler, _load, _loads).
UNPICKLING_NAMES = ("load", "loads", "Unpickler", "Unpickler_", "_load", "_loads", "_Unpickler")


def unguarded_unpickling(source: str, filename: str) -> list[str]:
    """Where `source` may unpickle other than as ALLOWED_UNPICKLING says: torch.load without
    weights_only=True, pickle.load(s)/Unpickler (or an import of them by another name)."""
    found = []

    def dotted(node: ast.AST) -> str:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return f"{dotted(node.value)}.{node.attr}"
        return ""

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and scope == "" else scope
            where = f"{filename}:{getattr(child, 'lineno', '?')}"
            if isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] in PICKLE_MODULES | {"torch"}:
                bad = [a.name for a in child.names if a.name in UNPICKLING_NAMES]
                if bad:
                    found.append(f"{where}: from {child.module} import {bad}")
            if isinstance(child, ast.Import):
                found.extend(f"{where}: import {a.name} as {a.asname}" for a in child.names if a.asname and a.name.split(".")[0] in PICKLE_MODULES)
            names = [dotted(child.func)] if isinstance(child, ast.Call) else [dotted(b) for b in child.bases] if isinstance(child, ast.ClassDef) else []
            for name in names:
                head = name.split(".")[0]
                if name in ("torch.load", "torch.serialization.load"):
                    weights_only = [k for k in child.keywords if k.arg == "weights_only"]  # type: ignore[union-attr]
                    if not (weights_only and isinstance(weights_only[0].value, ast.Constant) and weights_only[0].value.value is True):
                        found.append(f"{where}: {name} without weights_only=True")
                elif (head in PICKLE_MODULES and name.rsplit(".", 1)[-1] in UNPICKLING_NAMES) or name in {k[2] for k in ALLOWED_UNPICKLING}:
                    if (filename, inner, name) not in ALLOWED_UNPICKLING:
                        found.append(f"{where}: {name} in {inner or 'module level'}")
            visit(child, inner)

    visit(ast.parse(source), "")
    return found


def test_every_unpickling_in_ckpt_is_weights_only_or_allowlisted():
    sources = sorted((REPO / "ckpt").rglob("*.py"))
    assert len(sources) > 30
    found = [hit for path in sources for hit in unguarded_unpickling(path.read_text(), path.name)]
    assert found == [], "unguarded unpickling (use weights_only=True, or say why in ALLOWED_UNPICKLING):\n" + "\n".join(found)
    # The scan itself finds what it must.
    bad = (
        "import torch, pickle\nimport pickle as p\nfrom pickle import loads\n"
        "def f(b):\n    torch.load(b)\n    torch.load(b, weights_only=False)\n    pickle.loads(b)\n"
        "class U(pickle.Unpickler):\n    pass\n"
        "def _recv(b):\n    return pickle.load(b)\n"
        "class V(pickle._Unpickler):\n    pass\n"
        "from pickle import _loads\n"
    )
    assert len(unguarded_unpickling(bad, "writer_proc.py")) == 9
    assert unguarded_unpickling("import torch\ntorch.load(b, map_location='cpu', weights_only=True)\n", "x.py") == []


# -- 3. no secret anywhere in a whole run ---------------------------------------------------------
@pytest.mark.slow
def test_no_secret_appears_in_any_output_log_manifest_event_or_spool_file_of_a_run(tmp_path, s3_endpoint):
    secrets = {
        "access key": "AKIASCANACCESSNR7Q2X",
        "secret key": "scan-Secret/Key+Nr7",
        "session token": "scan-Session-Token/Nr8+",
        "signing key": "scan-signing-key-0123456789abcdef",
        "url password": "url-Secret-In-Scan-Nr9",
    }
    aws = {
        "AWS_ACCESS_KEY_ID": secrets["access key"],
        "AWS_SECRET_ACCESS_KEY": secrets["secret key"],
        "AWS_SESSION_TOKEN": secrets["session token"],
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_endpoint,
    }
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y").create_bucket(Bucket=bucket)
    root = f"s3://{bucket}/run"
    key_file = tmp_path / "signing.key"
    key_file.write_text(secrets["signing key"])
    options = json.dumps({"endpoint_url": s3_endpoint, "key": secrets["access key"], "secret": secrets["secret key"], "token": secrets["session token"]})
    logs, spool = tmp_path / "logs", tmp_path / "spool"
    logs.mkdir()
    port = free_port()
    ranks_env = {**aws, "CKPT_SIGNING_KEY_FILE": str(key_file), "CKPT_METRICS_PORT": str(port), "CKPT_WRITER": "process"}
    args = ["--root", root, "--every", "3", "--storage-options", options, "--log-level", "DEBUG", "--step-sleep", "0.2"]
    outputs: dict[str, bytes] = {}

    # Run 1: straight to the store, metrics served (scraped while it trains).
    procs = start(RANKS, WORKER, *args, "--steps", "6", env=ranks_env, log_dir=logs)
    scraped = b""
    while not scraped and all(p.poll() is None for p in procs):
        with contextlib.suppress(OSError):
            scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
        time.sleep(0.2)
    assert wait(procs) == [0] * RANKS, rank_logs(logs)
    assert b"ckpt_" in scraped
    outputs["metrics scrape"] = scraped

    # Run 2: through a node agent logging JSON, with its own credentials (the same ones here).
    from tests.support.agentd import agent

    with agent(spool, logs / "agent.log", "--log-format", "json", env=aws) as a:
        procs = start(RANKS, WORKER, *args, "--steps", "12", env={**ranks_env, "CKPT_SPOOL": str(spool), "CKPT_METRICS_PORT": str(free_port())}, log_dir=logs)
        assert wait(procs) == [0] * RANKS, rank_logs(logs)
        a.proc.send_signal(signal.SIGTERM)
        a.proc.wait(timeout=60)
        agent_log = a.text()
    assert '"message": "committed' in agent_log

    # The admin CLI with the credentials in options, the environment and a URL.
    cred_options = [f"--storage-option=endpoint_url={s3_endpoint}", f"--storage-option=key={secrets['access key']}", f"--storage-option=secret={secrets['secret key']}", f"--storage-option=token={secrets['session token']}"]
    in_url = f"s3://{secrets['access key']}:{secrets['url password']}@{bucket}/run"
    for name, call in {
        "verify": ["verify", root, "-v", "--signing-key-file", str(key_file), *cred_options],
        "show": ["show", root, "--json", *cred_options],
        "events": ["events", root, *cred_options],
        "ls with credentials in the URL": ["ls", in_url, f"--storage-option=endpoint_url={s3_endpoint}"],
    }.items():
        r = subprocess.run([*CLI, *call], capture_output=True, env={**os.environ, **aws, "PYTHONPATH": str(REPO)}, timeout=120)
        outputs[f"ckpt {name}"] = r.stdout + r.stderr
        if name == "verify":
            assert r.returncode == 0 and b"signed-ok" in r.stdout, r.stdout + r.stderr

    # Everything the run left: logs, spool, every object under the root.
    for path in tmp_path.rglob("*"):
        if path.is_file() and path != key_file:
            outputs[str(path.relative_to(tmp_path))] = path.read_bytes()
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")
    objects = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    for k in objects:
        outputs[f"s3://{bucket}/{k}"] = s3.get_object(Bucket=bucket, Key=k)["Body"].read()

    # The run did what it claims: debug logging, signed commits by the ranks and the agent,
    # events written, the spool used.
    rank_text = (logs / "rank0.log").read_text()
    assert "ckpt.checkpointer step 3 staged in" in rank_text
    assert any(k.endswith("events/") or "/events/" in k for k in objects)
    manifests = [k for k in objects if k.endswith("manifest.json")]
    assert len(manifests) >= 4
    for k in manifests:
        assert SigningKey(secrets["signing key"]).check(Manifest.from_json(outputs[f"s3://{bucket}/{k}"]))[0] == "signed-ok", k
    assert any(k.startswith("spool/") for k in outputs)
    leaks = [
        f"{what} in {where}"
        for where, blob in outputs.items()
        for what, secret in secrets.items()
        for form in {secret, urllib.parse.quote(secret, safe=""), json.dumps(secret)[1:-1]}
        if form.encode() in blob
    ]
    assert leaks == [], "\n".join(leaks)


# -- 4. nothing reaches outside the root --------------------------------------------------------
def test_paths_that_escape_the_root_are_refused(tmp_path):
    store = Store(str(tmp_path / "root"))
    for bad in ("../x", "/etc/passwd", "step-0000000001/../../x", "a/../../b", ".."):
        with pytest.raises(ValueError, match="escapes the checkpoint root"):
            store.path(bad)
    assert store.path("step-0000000001", "__0_0.distcp").startswith(str(tmp_path / "root") + "/")
    for bad in ("../1", "-1", "step-1", True, 1.5):
        with pytest.raises(ValueError, match="restore must be"):
            ckpt.Checkpointer(str(tmp_path / "root"), restore=bad)
    doc = {"step": 1, "world_size": 1, "created": 0.0, "format": "ckpt", "format_version": 2}
    for name in ("../evil", "/etc/passwd", "a/../../b", ""):
        with pytest.raises(InvalidCheckpoint, match="not a path inside the step directory"):
            Manifest.from_json(json.dumps({**doc, "files": {name: {"size": 1, "checksum": "xxh3_64:00", "rank": 0}}}).encode())


def test_a_root_that_is_a_checkpoint_is_refused_and_nothing_is_written_into_it(tmp_path):
    root = tmp_path / "root"
    train(root, 2)
    committed = root / step_dir(2)
    before = {p: p.read_bytes() for p in committed.rglob("*") if p.is_file()}
    for lease in (ckpt.Lease(), None):
        with pytest.raises(ValueError, match=f"{step_dir(2)} is a checkpoint .* not a checkpoint root"):
            train(committed, 3, lease=lease)
    assert {p: p.read_bytes() for p in committed.rglob("*") if p.is_file()} == before
    other = tmp_path / "another-tools-dir"  # a manifest.json that is not a ckpt one: not refused
    other.mkdir()
    (other / "manifest.json").write_text('{"name": "my-dataset"}')
    assert train(other, 1).step == 1


def test_wrong_objects_and_options_are_refused_when_the_checkpointer_is_made_not_at_its_first_save(tmp_path):
    """With interval="auto" the first save comes minutes into a run: a wrong argument must
    fail the constructor, with what was wrong, and write nothing."""
    root = str(tmp_path / "root")
    model = torch.nn.Linear(2, 2)
    bad = [
        (ValueError, "keep must be ckpt.Keep", {"keep": 3}),
        (TypeError, "model must be a torch.nn.Module", {"model": "m"}),
        (TypeError, "optimizer 0 must be a torch.optim.Optimizer, not Linear", {"model": model, "optimizer": model}),
        (TypeError, r"scheduler 0 \(int\) has no state_dict", {"model": model, "scheduler": 1}),
        (TypeError, r"extra\['ema'\] \(str\) has no state_dict", {"extra": {"ema": "x"}}),
        (TypeError, "metadata goes into every manifest, as JSON: Object of type object", {"metadata": {"o": object()}}),
        (ValueError, "timeout_s must be a positive number", {"timeout_s": 0}),
        (ValueError, "agree_every_s must be a positive number", {"agree_every_s": float("nan")}),
        (ValueError, "host_memory_budget must be a positive number of bytes", {"host_memory_budget": -1}),
        (ValueError, "on_error must be 'raise', 'log' or a number", {"on_error": 0}),
        (ValueError, "restore must be 'latest', 'none' or a step number", {"restore": True}),
        (ValueError, "if_busy must be 'wait' or 'skip'", {"if_busy": "drop"}),
        (ValueError, r"lease must be a ckpt.Lease\(...\) or None", {"lease": 60}),
        (ValueError, "interval must be 'auto', ckpt.Auto", {"interval": 100}),
    ]
    for kind, message, kw in bad:
        with pytest.raises(kind, match=message):
            ckpt.Checkpointer(root, **kw)
    assert not os.path.exists(root)
    assert ckpt.Checkpointer(root, host_memory_budget=8e9).host_memory_budget == 8_000_000_000  # a float, as 8e9 is


def test_the_loop_calls_outside_the_block_or_a_second_enter_are_refused_and_leave_the_object_usable(tmp_path):
    """step_done() or save() before the `with` (a script that forgot it would train the whole
    run with nothing saved) or after it, and a nested enter of the same object, are errors
    that change nothing: the same object then runs a normal block that saves and resumes."""
    root = str(tmp_path / "root")
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    cp = ckpt.Checkpointer(root, model=model, optimizer=opt, interval=ckpt.Every(steps=2))

    def train(steps: int) -> None:
        for _ in range(steps):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()

    for call, name in ((cp.step_done, "step_done"), (cp.save, "save")):
        with pytest.raises(RuntimeError, match=rf"{name}\(\) outside the Checkpointer's `with` block"):
            call()
    assert cp.step == 0 and not os.path.exists(root)
    with cp:
        train(3)
        with pytest.raises(RuntimeError, match="already entered"), cp:
            pass
        train(1)
    assert cp.last_commit.step == 4
    with pytest.raises(RuntimeError, match="outside the Checkpointer's `with` block"):
        cp.step_done()
    with cp:  # the same object, again: it resumes
        assert cp.restored_step == 4
        train(2)
    assert cp.last_commit.step == 6


def test_a_counter_that_would_not_come_back_as_it_is_is_refused_where_it_is_set(tmp_path):
    root = tmp_path / "root"
    model = torch.nn.Linear(2, 2)
    with ckpt.Checkpointer(str(root), model=model, interval=None) as cp:
        for key, value, says in [
            ("step", 100, "is ckpt's own"),  # it replaced the real step on restore
            ("t", torch.tensor(1), "holds a Tensor"),
            ("s", {1, 2}, "holds a set"),
            ("d", {"a": {1: 2}}, "a dict key 1"),
            ("u", (1, object()), "holds a object"),
            (3, 1, "a counter's name is a string"),
        ]:
            with pytest.raises((TypeError, ValueError), match=says):
                cp.counters[key] = value
        with pytest.raises(TypeError, match="holds a object"):
            cp.counters.update({"y": 1, "x": object()})
        with pytest.raises(TypeError, match="holds a set"):
            cp.counters |= {"y": 1, "x": {1}}
        assert cp.counters == {}  # all or nothing
        cp.counters["best"] = (3, 0.5)  # comes back as [3, 0.5]
        cp.counters["tokens"] = 5
        cp.counters.update(epoch=2)
        cp.counters.setdefault("lr", [1e-3, {"warm": True}])
        cp.counters = {"step": 3}  # a plain dict: checked when a save starts, before it changes anything
        with pytest.raises(ValueError, match="is ckpt's own"):
            cp.save()
        assert not root.exists() or not list(root.glob("step-*"))
        cp.counters = {"tokens": 5, "epoch": 2, "lr": [1e-3, {"warm": True}], "best": (3, 0.5)}
        cp.save(blocking=True)
    with ckpt.Checkpointer(str(root), model=model, interval=None) as cp:
        assert cp.restored_step == 0 and cp.counters == {"tokens": 5, "epoch": 2, "lr": [1e-3, {"warm": True}], "best": [3, 0.5]}
        with pytest.raises(TypeError):
            cp.counters["x"] = object()  # still checked after a restore


class _Custom:
    def __init__(self, n: int) -> None:
        self.n = n


class _Holder:
    def __init__(self, value: object) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"v": self.value, "plain": [1, "a", {"b": None}], "t": torch.ones(2)}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["v"]


def test_an_object_a_restore_could_not_load_is_refused_at_the_save_not_found_at_the_restore(tmp_path):
    """Restores load pickled objects with weights_only=True: an object of a class torch does
    not allow saved fine and then failed every restore of every checkpoint holding it."""
    root = tmp_path / "root"
    with ckpt.Checkpointer(str(root), model=torch.nn.Linear(2, 2), extra={"h": _Holder(_Custom(7))}, interval=None) as cp:
        with pytest.raises(TypeError, match=r"extra\.h\.v is a _Custom, which a restore could not load.*add_safe_globals"):
            cp.save()
        # Inside any container, after others of its type passed; and one that cannot be pickled.
        holder = cp.state.extra["h"]
        for value, where, what in [
            ((torch.ones(1), 1), None, None),
            ((2, _Custom(1)), r"extra\.h\.v\.1", "_Custom"),
            (collections.OrderedDict(a=collections.OrderedDict(b=_Custom(1))), r"extra\.h\.v\.a\.b", "_Custom"),
            (threading.Lock(), r"extra\.h\.v", "lock"),
        ]:
            holder.value = value
            if where is None:
                cp.state.capture({}, 0)
                continue
            with pytest.raises(TypeError, match=rf"{where} is a {what}, which a restore could not load"):
                cp.save()
        assert not list(root.glob("step-*"))
        holder.value = _Custom(7)
        before = torch.serialization.get_safe_globals()
        torch.serialization.add_safe_globals([_Custom])  # allowed: saved, and restored
        try:
            cp.save(blocking=True)
            fresh = _Holder(None)
            with ckpt.Checkpointer(str(root), model=torch.nn.Linear(2, 2), extra={"h": fresh}, interval=None, lease=None):
                assert isinstance(fresh.value, _Custom) and fresh.value.n == 7
        finally:
            torch.serialization.clear_safe_globals()
            torch.serialization.add_safe_globals(before)


def test_every_cli_command_refuses_a_step_that_is_not_a_number_in_one_line(tmp_path):
    root = tmp_path / "root"
    train(root, 1)
    calls = [
        ["show", str(root), "--step", "../1"],
        ["verify", str(root), "--step", "-1"],
        ["rm", str(root), "--step", "/etc"],
        ["export", str(root), "--step", "step-0000000001", "--format", "torch", "--out", str(tmp_path / "x.pt")],
        ["cp", str(root), str(tmp_path / "dst"), "--step", "1/../2"],
        ["restore", str(root), "--to", str(tmp_path / "here"), "--step", "1.0"],
        ["load-test", str(root), "--world-size", "2", "--step", "²"],
    ]
    runs = [start_ckpt(*c) for c in calls]
    for c, r in zip(calls, runs, strict=True):
        assert "a step is a non-negative integer" in one_line_error(r.result()), c
    assert not (tmp_path / "dst").exists() and not (tmp_path / "here").exists() and not (tmp_path / "x.pt").exists()
    # diff takes ROOT:STEP: a tail that is not a step number is part of the root, not found.
    diff = cli("diff", f"{root}:1", f"{root}:../1")
    assert diff.returncode == 2 and "Traceback" not in diff.stderr
    # A manifest that names a file outside its directory is corrupt, and nothing copies it.
    doc = manifest_doc(root, 1)
    doc["files"]["../../outside"] = doc["files"]["__0_0.distcp"]
    write_manifest(root, 1, doc)
    verify = cli("verify", str(root))
    assert verify.returncode == 1 and "not a path inside the step directory" in verify.stdout
    copy = cli("cp", str(root), str(tmp_path / "dst"))
    assert "not a path inside the step directory" in one_line_error(copy, rc=1)  # no usable checkpoint, and why
    assert not (tmp_path / "outside").exists() and not (tmp_path / "dst" / step_dir(1) / "manifest.json").exists()


def test_a_mistyped_cli_option_is_named_but_its_value_never_echoed(tmp_path):
    """argparse says "unrecognized arguments: --storage-options key=..." with the value: one
    that is a credential must not reach the terminal (or a CI log)."""
    secret = "wJalrXUtnFEMIxK7MDENGbPxRfiCYzEXAMPLEKEY"
    for typo in (["--storage-options", f"aws_secret_access_key={secret}"], ["--storage-optoin", f"token={secret}"], [secret]):
        r = cli("ls", str(tmp_path), *typo)
        line = one_line_error(r)
        assert "unrecognized arguments" in line and secret not in r.stdout + r.stderr, line
        assert typo[0] in line or typo[0] == secret


def test_the_agent_refuses_requests_for_step_directories_that_are_not_one(tmp_path):
    spool, root = tmp_path / "spool", tmp_path / "root"
    manifest = {"step": 1, "world_size": 1, "created": 0.0, "files": {"__0_0.distcp": {"size": 1, "checksum": "xxh3_64:00", "rank": 0}}, "format": "ckpt", "format_version": 2}
    good = {"root": str(root), "storage_options": {}, "rel": "step-0000000001", "step": 1, "save_id": "s", "rank": 0, "world": 1, "files": ["__0_0.distcp"], "manifest": manifest, "started": 0.0}
    check_request(Request.from_doc(good))
    for rel in ("../step-0000000001", "step-0000000001/../..", "/etc", "step-1", "step-0000000002"):
        with pytest.raises(InvalidCheckpoint, match="not a step directory"):
            check_request(Request.from_doc({**good, "rel": rel}))
    request = spool / "jobs" / "0123456789abcdef" / "step-0000000001" / ".requests" / "rank-00000.json"
    request.parent.mkdir(parents=True)
    doc = {**good, "rel": "../../../../outside"}
    request.write_text(json.dumps(doc))
    Agent(Config(spool=str(spool), metrics_port=-1)).uploads.upload(str(request), Request.from_doc(doc))
    assert read_json(status_of(str(request)))["state"] == "failed"
    assert not root.exists() and not (tmp_path / "outside").exists()


# -- 5. listeners bind to loopback unless configured ----------------------------------------------
def test_metrics_and_the_agent_listen_on_loopback_unless_configured(tmp_path, monkeypatch):
    m = Metrics()
    try:
        m.serve(0)
        assert m.address[0] == "127.0.0.1"
    finally:
        m.close()
    monkeypatch.delenv("CKPT_METRICS_ADDR", raising=False)
    torch.manual_seed(0)
    with ckpt.Checkpointer(str(tmp_path / "root"), model=torch.nn.Linear(2, 2), interval=None, metrics_port=0, save_on_exit=False) as cp:
        assert cp.metrics.address[0] == "127.0.0.1"
    config = Config.load(["--spool", str(tmp_path / "spool"), "--metrics-port", "0"])
    assert config.metrics_addr == "127.0.0.1"
    a = Agent(config)
    try:
        a.serve()
        assert a._server is not None and a._server.server_address[0] == "127.0.0.1"
    finally:
        a.close()
    assert Spool(str(tmp_path / "spool")).agent() is None  # served, not run: no heartbeat


def test_request_headers_logged_as_bytes_are_masked_whoever_gave_the_credentials():
    """botocore logs the requests it sends with bytes header values; credentials from an
    instance role or ~/.aws are in neither the environment nor the storage options, so only
    the patterns can mask them."""
    from ckpt.redact import redact

    line = ("Sending http request: <AWSPreparedRequest headers={'X-Amz-Security-Token': b'IQoJb3JpZ2luX2VjTOKENVALUE', "
            "'Authorization': b'AWS4-HMAC-SHA256 Credential=AKIAROLEKEY/20261130/us-east-1/s3/aws4_request, Signature=abcdef0123'}>")
    masked = redact(line)
    for secret in ("IQoJb3JpZ2luX2VjTOKENVALUE", "AKIAROLEKEY", "abcdef0123"):
        assert secret not in masked, masked
