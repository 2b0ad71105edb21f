"""`ckpt cp`, `restore`, `diff`, `export` and `load-test`, run as a user runs them (a
subprocess) on checkpoints a real Checkpointer wrote: locally, and to and from the moto S3
server. Tensors come back bitwise; an interrupted copy resumes and commits only when whole.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.admin.export import read_export
from tests.support.cli import ckpt_cli
from tests.support.jobs import RANKS
from tests.support.launch import run

CLI = [sys.executable, "-m", "ckpt.cli.main"]


def cli(*args: object, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return ckpt_cli(*args, env=env, check=check)


def train(root: Path | str, steps: int = 10, seed: int = 0, extra: dict | None = None) -> torch.nn.Module:
    """A model trained `steps` steps with a checkpoint every 5; returns it."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16))
    opt = torch.optim.Adam(model.parameters())
    with ckpt.Checkpointer(str(root), model=model, optimizer=opt, interval=ckpt.Every(steps=5), extra=extra, restore="none") as cp:
        for _ in range(steps):
            model(torch.randn(8, 512)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            cp.step_done()
    return model


def files_of(root: Path, step: int) -> dict[str, bytes]:
    d = root / f"step-{step:010d}"
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


# -- cp and restore -----------------------------------------------------------------------------
def test_cp_to_s3_and_back_is_byte_for_byte_and_an_interrupted_copy_resumes(tmp_path, s3_root, s3_env):
    src = tmp_path / "src"
    train(src, 10)
    # Killed after its first file: the destination holds no commit.
    r = cli("cp", src, s3_root, env={"CKPT_FAULT": "copy_file:*:*"}, check=False)
    assert r.returncode == -9
    listed = cli("ls", s3_root, "--json")
    assert [c["state"] for c in json.loads(listed.stdout)] == ["incomplete"]
    # Again: the file that arrived is verified and kept, the rest copied, then the commit.
    r = cli("cp", src, s3_root)
    assert "1 files" in r.stdout and "1 already there (verified)" in r.stdout and "committed" in r.stdout
    assert "already there (the same checkpoint, every file of its size" in cli("cp", src, s3_root).stdout
    cli("verify", s3_root, "--deep")
    # Back to a local directory, a step asked for.
    r = cli("restore", s3_root, "--step", 10, "--to", tmp_path / "back")
    assert files_of(tmp_path / "back", 10) == files_of(src, 10)
    # A copy there with a file cut short or gone is the same checkpoint, repaired.
    (tmp_path / "back" / "step-0000000010" / "__0_0.distcp").write_bytes(b"cut")
    (tmp_path / "back" / "step-0000000010" / ".metadata").unlink()
    r = cli("restore", s3_root, "--step", 10, "--to", tmp_path / "back")
    assert "2 files" in r.stdout and "committed" in r.stdout, r.stdout
    assert files_of(tmp_path / "back", 10) == files_of(src, 10)
    # Never into the source root itself (its step directories would hold the copy).
    for inside in (src, src / "step-0000000005", src / "new"):
        r = cli("cp", src, inside, check=False)
        assert r.returncode == 2 and "is the source root or inside it" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (src / "new").exists() and not (src / "step-0000000005" / "step-0000000010").exists()
    r = cli("cp", s3_root, f"{s3_root}/sub/", check=False)
    assert r.returncode == 2 and "is the source root or inside it" in r.stderr, r.stderr
    # Another checkpoint of step 10 is never overwritten: one line, and the copy there intact.
    other = tmp_path / "other"
    train(other, 10, seed=1)
    r = cli("cp", other, tmp_path / "back", check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "another checkpoint of step 10" in r.stderr and "not overwriting it" in r.stderr, r.stderr
    assert files_of(tmp_path / "back", 10) == files_of(src, 10)


def test_a_copy_never_commits_a_corrupt_source(tmp_path):
    src = tmp_path / "src"
    train(src, 5)
    data = src / "step-0000000005" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    r = cli("cp", src, tmp_path / "dst", "--step", 5, check=False)
    assert r.returncode == 1 and "checksum" in r.stderr
    assert not (tmp_path / "dst" / "step-0000000005" / "manifest.json").exists()


# -- diff ---------------------------------------------------------------------------------------
def test_diff_names_what_differs_by_how_much_and_what_one_side_lacks(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    model = train(a, 10)
    train(b, 10, extra={"ema": torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)})
    same = cli("diff", f"{a}:10", f"{tmp_path / 'a'}:10")
    assert same.returncode == 0 and "0 different" in same.stdout
    # The same run one save apart: every trained tensor differs, by a known amount.
    r = cli("diff", f"{a}:5", f"{a}:10", "--json", check=False)
    assert r.returncode == 1
    report = json.loads(r.stdout)
    differ = {d["key"]: d for d in report["differ"]}
    five = read_export_model(tmp_path, a, 5)
    want = float((five["0.weight"].double() - model[0].weight.detach().double()).abs().max())
    assert differ["model.0.weight"]["max_abs"] == pytest.approx(want)
    assert '"step": 5' in differ["counters"]["why"] and '"step": 10' in differ["counters"]["why"]
    # Another run with an extra object: only on one side.
    r = cli("diff", a, b, check=False)
    assert r.returncode == 1 and "only in b: extra.ema" in r.stdout
    # A directory whose name ends in ':5' is a root, not a step of another one.
    shutil.copytree(a, tmp_path / "run:5")
    r = cli("diff", tmp_path / "run:5", f"{a}:10")
    assert r.returncode == 0 and "0 different" in r.stdout and f"a: {tmp_path / 'run:5'}/step-0000000010" in r.stdout, r.stdout


def test_diff_stopped_by_an_unexpected_error_is_no_answer_not_they_differ(tmp_path, monkeypatch, capsys):
    """diff's exit 1 means "they differ": an error no other handler knows (a bug, a tensor
    that cannot be compared) is exit 2, in one line, like a corrupt side."""
    from ckpt.cli import main as cli
    from ckpt.cli import whole
    a = tmp_path / "a"
    train(a, 10)

    def broken(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("cannot compare these")

    monkeypatch.setattr(whole, "_same_bits", broken)
    assert cli.main(["diff", f"{a}:5", f"{a}:10"]) == 2
    err = capsys.readouterr().err
    assert err == "ckpt: cannot compare these\n", err
    # Any other verb lets such an error through, with its traceback: a bug shows where it is.
    from ckpt.storage import catalog
    monkeypatch.setattr(catalog, "find", broken)
    with pytest.raises(RuntimeError, match="cannot compare"):
        cli.main(["cp", str(a), str(tmp_path / "b")])


def _strict(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def test_diff_takes_a_nan_on_both_sides_as_equal_and_every_json_output_is_strict(tmp_path):
    roots = [tmp_path / "a", tmp_path / "b"]
    for at, root in zip((0, 1), roots, strict=True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        with torch.no_grad():
            model.weight[0, at] = float("nan")
        with ckpt.Checkpointer(str(root), model=model, interval=None, metadata={"best_loss": float("inf")}, restore="none") as cp:
            cp.save(blocking=True)
    a, b = roots
    same = cli("diff", f"{a}:0", f"{a}:0", "--json")
    assert json.loads(same.stdout, parse_constant=_strict)["differ"] == []
    r = cli("diff", f"{a}:0", f"{b}:0", "--json", check=False)
    assert r.returncode == 1
    (weight,) = json.loads(r.stdout, parse_constant=_strict)["differ"]
    assert (weight["key"], weight["max_abs"], weight["elements"]) == ("model.weight", "inf", 2)  # a NaN on one side
    show = json.loads(cli("show", a, "--json").stdout, parse_constant=_strict)
    assert show["manifest"]["user"] == {"best_loss": "inf"}


def read_export_model(tmp_path: Path, root: Path, step: int) -> dict:
    out = tmp_path / f"model-{step}.safetensors"
    cli("export", root, "--step", step, "--format", "safetensors", "--out", out, "--model-only")
    return read_export(str(out))


# -- export -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["safetensors", "torch", "zarr"])
def test_export_round_trips_bitwise_and_casts_when_asked(tmp_path, fmt):
    root = tmp_path / "root"
    model = train(root, 10)
    out = tmp_path / ("export" + {"safetensors": ".safetensors", "torch": ".pt", "zarr": ""}[fmt])
    r = cli("export", root, "--format", fmt, "--out", out, "--model-only")
    assert "4 tensors" in r.stdout
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16))
    fresh.load_state_dict(read_export(str(out)))
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    if fmt == "safetensors":  # known by its bytes, whatever its name
        shutil.copy(out, tmp_path / "no-suffix")
        assert read_export(str(tmp_path / "no-suffix")).keys() == fresh.state_dict().keys()
    full = tmp_path / ("full" + out.suffix)
    cli("export", root, "--format", fmt, "--out", full, "--dtype", "bf16")
    got = read_export(str(full))
    assert torch.equal(got["model.2.weight"], model[2].weight.detach().to(torch.bfloat16))
    assert got["optim.state.0.weight.exp_avg"].dtype == torch.bfloat16  # optimizer state too
    assert got["optim.state.0.weight.step"].dtype == torch.float32 and got["optim.state.0.weight.step"] == 10  # not scalars


def test_a_zarr_export_writes_no_array_outside_its_directory_nor_one_inside_another(tmp_path, request):
    """A zarr array is the directory `--out/<tensor name>`, replaced if there. A module named
    like an absolute path (or a planted `.metadata`) must not make the export write, or
    delete, a directory elsewhere; two tensors whose arrays would nest are refused too."""
    # A module name holds no ".": the victim's path must not either (pytest's may: a user
    # named first.last).
    victim = Path(tempfile.mkdtemp(prefix="ckpt_victim_", dir="/tmp"))
    (victim / "keep.txt").write_text("mine")
    request.addfinalizer(lambda: shutil.rmtree(victim, ignore_errors=True))
    for name, module, says in [
        ("escape", str(victim / "escaped"), "cannot be a zarr array's path under --out"),  # arrays escaped.weight, escaped.bias
        ("nested", "x/y", "one inside the other"),
    ]:
        model = torch.nn.Module()
        model.register_parameter("x", torch.nn.Parameter(torch.ones(2)))
        model.add_module(module, torch.nn.Linear(2, 2))
        root = tmp_path / f"root-{name}"
        with ckpt.Checkpointer(str(root), model=model, interval=None, restore="none") as cp:
            cp.save(blocking=True)
        out = tmp_path / f"z-{name}"
        r = cli("export", root, "--format", "zarr", "--model-only", "--out", out, check=False)
        assert r.returncode != 0 and r.stderr.count("\n") == 1 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert not out.exists() or not any(out.iterdir())
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("fmt", ["zarr", "safetensors", "torch"])
def test_an_export_that_fails_part_way_leaves_nothing_at_its_out(tmp_path, monkeypatch, fmt):
    """An export that fails after some tensors were written (here: a corrupt block found on
    the way, one tensor read at a time) leaves neither `--out` nor its partial files: a zarr
    directory of half the arrays would read back as a complete, smaller checkpoint."""
    from ckpt.admin import export, tools
    from ckpt.storage import catalog
    from ckpt.storage.store import Store

    root = tmp_path / "root"
    train(root, 10)
    data = root / "step-0000000010" / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[-len(blob) // 8] ^= 0xFF  # late in the file: tensors before it are read and written first
    data.write_bytes(bytes(blob))
    one_at_a_time = tools.batches
    monkeypatch.setattr(tools, "batches", lambda md, keys: one_at_a_time(md, keys, limit=1))
    written = []
    real_zarr = export._write_zarr
    monkeypatch.setattr(export, "_write_zarr", lambda path, t: written.append(path) or real_zarr(path, t))
    store = Store(str(root))
    entry = catalog.find(store, 10)
    out = tmp_path / "exports" / ("x" + {"zarr": "", "safetensors": ".safetensors", "torch": ".pt"}[fmt])
    with pytest.raises(ckpt.InvalidCheckpoint, match="checksum mismatch"):
        export.export(store, entry, fmt, str(out), progress=False)
    assert fmt != "zarr" or written, "the corruption must come after some arrays were written"
    assert not out.exists() and (not out.parent.exists() or list(out.parent.iterdir()) == [])
    if fmt == "zarr":  # into a directory made beforehand: left as empty as it was
        out.mkdir(parents=True)
        with pytest.raises(ckpt.InvalidCheckpoint, match="checksum mismatch"):
            export.export(store, entry, fmt, str(out), progress=False)
        assert list(out.iterdir()) == [] and list(out.parent.iterdir()) == [out]


def test_a_zarr_export_into_an_empty_directory_or_a_link_to_one_lands_in_it_whole(tmp_path):
    root = tmp_path / "root"
    model = train(root, 10)
    (tmp_path / "made").mkdir()
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    for out, lands in ((tmp_path / "made", tmp_path / "made"), (tmp_path / "link", tmp_path / "target")):
        cli("export", root, "--format", "zarr", "--out", out, "--model-only")
        got = read_export(str(lands))
        assert got.keys() == model.state_dict().keys() and all(torch.equal(got[k], v) for k, v in model.state_dict().items())
        assert sorted(p.name for p in lands.iterdir()) == sorted(model.state_dict())  # no part directory left
    assert (tmp_path / "link").is_symlink()


def test_export_and_diff_refuse_bad_arguments_and_corrupt_files_in_one_line(tmp_path):
    root = tmp_path / "root"
    train(root, 10)
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "full_dir").mkdir()
    (tmp_path / "full_dir" / "notes.txt").write_text("mine")
    data_file = root / "step-0000000010" / "__0_0.distcp"
    data_bytes = data_file.read_bytes()
    for args, rc, says in [
        (["--format", "torch", "--dtype", "foo", "--out", tmp_path / "x.pt"], 2, "--dtype must be a floating dtype"),
        (["--format", "torch", "--out", tmp_path / "a_dir"], 2, "is a directory: a torch export is one file"),
        (["--format", "zarr", "--out", tmp_path / "a_file"], 2, "is a file: a zarr export is a directory"),
        # Never over what is there: a typo must not destroy a checkpoint's file, nor another file.
        (["--format", "torch", "--out", data_file], 2, "is inside the checkpoint root"),
        (["--format", "zarr", "--out", root / "z"], 2, "is inside the checkpoint root"),
        (["--format", "safetensors", "--out", tmp_path / "a_file"], 2, "exists; --force replaces it"),
        (["--format", "zarr", "--out", tmp_path / "full_dir"], 2, "a zarr export goes to a new or empty one"),
        (["--format", "zarr", "--out", ""], 2, "is not a directory name"),
        (["--format", "torch", "--out", f"{tmp_path}/new_dir/"], 2, "is not a file name"),
        (["--format", "torch", "--out", tmp_path / "a_file" / "x.pt"], 2, "a_file"),  # an OSError, in one line
    ]:
        r = cli("export", root, *args, check=False)
        assert (r.returncode, r.stderr.count("\n")) == (rc, 1) and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert (tmp_path / "a_file").read_text() == "x" and data_file.read_bytes() == data_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "a_file", "full_dir", "root"]
    cli("export", root, "--format", "torch", "--out", tmp_path / "a_file", "--force")  # replaced, whole
    assert set(read_export(str(tmp_path / "a_file"))) >= {"model.0.weight", "optim.state.0.weight.exp_avg"}
    data = root / "step-0000000010" / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    # export: a corrupt checkpoint is 1. diff: 1 is "they differ", so a corrupt side is 2 (no answer), as diff(1).
    for r, rc in ((cli("export", root, "--format", "torch", "--out", tmp_path / "y.pt", check=False), 1), (cli("diff", f"{root}:10", f"{root}:5", check=False), 2)):
        assert (r.returncode, r.stderr.count("\n")) == (rc, 1), r.stderr
        assert r.stderr.startswith(f"ckpt: {data}: checksum mismatch") and r.stderr.endswith("(corrupt file)\n"), r.stderr
    assert not (tmp_path / "y.pt").exists()


# -- load-test ----------------------------------------------------------------------------------
BIG_FSDP2 = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import ckpt
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024))
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.Adam(model.parameters())
with ckpt.Checkpointer(sys.argv[1], model=model, optimizer=opt, interval=None) as cp:
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    cp.step_done()
dist.destroy_process_group()
"""
RESTORE_FROM = """with ckpt.Checkpointer(sys.argv[1], model=model, optimizer=opt, interval=None) as cp:
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    cp.step_done()"""
RESTORE_TO = """with ckpt.Checkpointer(sys.argv[1], model=model, optimizer=opt, interval=None, save_on_exit=False) as cp:
    sys.stdout.write(f"READ {int(cp.metrics.read._value.get())}\\n")  # one write: no other line lands inside it
    sys.stdout.flush()"""


@pytest.mark.slow
def test_load_test_reports_what_each_rank_reads_on_another_world_size(tmp_path):
    """An FSDP2 checkpoint of 2 ranks (files over 2 MiB: block checksums): restored on 1 rank,
    that rank reads every byte; on 4, each reads its rows' blocks, about a third, exactly
    what a real restore on 4 ranks reads."""
    from tests.support.jobs import job

    root = tmp_path / "root"
    script = tmp_path / "big_fsdp2.py"
    script.write_text(BIG_FSDP2)
    job(tmp_path, script, root)
    manifest = json.loads((root / "step-0000000001" / "manifest.json").read_text())
    total = sum(f["size"] for name, f in manifest["files"].items() if not name.endswith(".index"))  # one rank reads no index
    one = json.loads(cli("load-test", root, "--world-size", 1, "--json").stdout)
    assert one["saved_on"] == RANKS and one["ranks"][0]["bytes"] == total
    four = json.loads(cli("load-test", root, "--world-size", 4, "--json").stdout)
    reads = [r["bytes"] for r in four["ranks"]]
    assert all(0.15 * total < b < 0.5 * total for b in reads), reads
    human = cli("load-test", root, "--world-size", 4).stdout
    assert "rank 3: reads" in human and "the slowest rank reads" in human
    # The plan is what a real restore on 4 FSDP2 ranks reads, byte for byte.
    restore = tmp_path / "restore_fsdp2.py"
    restore.write_text(BIG_FSDP2.replace(RESTORE_FROM, RESTORE_TO))
    for r in range(RANKS):
        (tmp_path / f"rank{r}.log").unlink()
    codes = run(4, restore, str(root), log_dir=tmp_path, timeout=180)
    logs = {r: (tmp_path / f"rank{r}.log").read_text() for r in range(4)}
    assert codes == [0] * 4, logs
    read = [int(re.search(r"^READ (\d+)", logs[r], re.M).group(1)) for r in range(4)]
    assert read == reads, (read, reads, {n: f["size"] for n, f in manifest["files"].items()})
