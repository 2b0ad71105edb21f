"""The kill sweep of issue 8: seeded trials, each killing one process of a 2-rank job (a rank,
its writer process, or the node agent) with SIGKILL at a random point of the save pipeline,
then checking that the next run restores the newest committed checkpoint, bit for bit what
that step held, and never a partial one.

    .venv/bin/python -m tests.support.torture --trials 40 --seed 1

prints the figures (trials, kills by phase, restores correct, data lost, time for the
surviving rank to turn a dead peer into an error) and writes them as JSON (`--out`). The test
suite runs a shorter sweep through `sweep()` (tests/system/test_torture.py).

Each trial is one run of tests/workers/torture_worker.py: it restores, reports what it
restored, trains six steps saving every two (keeping two, so retention deletes as it goes) and
is killed at the chosen point of one of those saves (CKPT_FAULT, ckpt/_faults.py). The next
trial's restore checks the one before; a last run without faults checks the last. In a third
of the trials a node agent (`ckpt agent`) uploads the ranks' files, and the victim may be the
agent itself.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import launch
from tests.support.cli import ckpt_cli

REPO = launch.REPO
WORKER = launch.WORKERS / "torture_worker.py"
RANKS, EVERY, STEPS = 2, 2, 6
# A rank whose peer died must fail on its own within this; past it the trial is a hang.
DIE_WITHIN_S = 60.0
RANK_TIMEOUT_S = 10.0  # the Checkpointer's timeout_s in the worker

# The points of ckpt/_faults.py, in pipeline order: (who dies, the hits to die at). A rule
# matches any step and kills at its nth hit in the process: the nth save of the run for the
# points hit once a save, the nth item of the first save for write_item, the nth deletion
# for retention, the nth chunk of that rank's uploads for agent_upload.
SAVES = list(range(1, STEPS // EVERY + 1))
PHASES = {
    "staging": ("rank", SAVES),
    "copying": ("rank", SAVES),  # the copier's batch (one a save here), its writer under way
    "write_item": ("rank", [1, 2, 3, 5, 8, 13]),
    "writer_process": ("writer", [1, 2]),  # not every save of a run reaches the same writer process
    "before_manifest": ("rank", SAVES),
    "after_manifest": ("rank", SAVES),
    "retention": ("rank0", [1, 2]),
}
AGENT_PHASES = {
    "after_handoff": ("rank", SAVES),
    "agent_upload": ("agent", [1, 2, 3]),
}


@dataclass
class Trial:
    index: int
    phase: str
    victim: str  # "rank0", "rank1", "writer0", "writer1", "agent"
    spec: str
    agent: bool
    fired: bool = False
    codes: list[int] = field(default_factory=list)
    reached: int | None = None  # the last step the killed run recorded
    detect_s: float | None = None  # victim's death -> the last survivor's exit
    committed_after: int | None = None  # the newest committed step once the trial ended
    restored: int | None = None  # what the next run restored
    ok: bool | None = None
    why: str = ""


class Agent:
    """A `ckpt agent` process on the sweep's spool (restarted when it died)."""

    def __init__(self, spool: Path, log: Path) -> None:
        self.spool, self.log, self.proc = spool, log, None

    def ensure(self, env: dict[str, str] | None = None) -> None:
        if self.proc is not None and self.proc.poll() is None and not env:
            return
        self.stop()
        from ckpt.node.spool import Spool

        (self.spool / "agent.json").unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckpt.cli.main", "agent", "--spool", str(self.spool), "--metrics-port", "0"],
            env={**_env(), **(env or {})}, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while Spool(str(self.spool)).agent() is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the agent did not start; see {self.log}")
            time.sleep(0.05)

    def settle(self, root: Path) -> None:
        """A live agent that has finished what the last trial handed off, as the ranks of a
        restart on its node wait for (a dead one is replaced first)."""
        from ckpt.node.handoff import Handoff
        from ckpt.storage.store import Store

        self.ensure()
        handoff = Handoff.find(str(self.spool), Store(str(root)), 0, None)
        if handoff is not None:
            handoff.wait_idle(60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    return {**env, "PYTHONPATH": str(REPO)}


def committed(root: Path) -> list[int]:
    from ckpt.storage import catalog
    from ckpt.storage.store import Store

    return sorted(e.step for e in catalog.scan(Store(str(root))) if e.state == catalog.COMMITTED)


def plans(rng: random.Random, trials: int, agent_share: float) -> list[Trial]:
    """Every phase in turn (shuffled each round, so a sweep of N phases' worth covers them
    all), a random victim and hit; the agent's phases with an agent, the others with one in
    `agent_share` of the trials."""
    out: list[Trial] = []
    names = sorted({**PHASES, **AGENT_PHASES})
    while len(out) < trials:
        for phase in rng.sample(names, len(names)):
            who, nths = {**PHASES, **AGENT_PHASES}[phase]
            rank = 0 if who == "rank0" else rng.randrange(RANKS)
            victim = {"rank": f"rank{rank}", "rank0": "rank0", "writer": f"writer{rank}", "agent": "agent"}[who]
            agent = phase in AGENT_PHASES or rng.random() < agent_share
            out.append(Trial(len(out), phase, victim, f"{phase}:{rank}:*:nth={rng.choice(nths)}", agent))
    return out[:trials]


def run_job(d: Path, root: Path, report: Path, env: dict[str, str], trial: Trial | None) -> list[int]:
    """The worker on 2 ranks; returns the exit codes. A victim's death is timed to the last
    survivor's exit: a dead peer must turn into an error, never a hang."""
    args = ["--root", str(root), "--record", str(d / "record"), "--report", str(report),
            "--steps", str(STEPS if trial else 0), "--every", str(EVERY), "--timeout", str(RANK_TIMEOUT_S)]
    procs = launch.start(RANKS, WORKER, *args, env=env, log_dir=d)
    died_at = None
    deadline = time.monotonic() + 180
    try:
        while any(p.poll() is None for p in procs):
            if died_at is None and any(p.returncode == -signal.SIGKILL for p in procs):
                died_at = time.monotonic()
            if died_at is not None and time.monotonic() - died_at > DIE_WITHIN_S:
                raise TimeoutError(f"a rank was still running {DIE_WITHIN_S:.0f} s after its peer died")
            if time.monotonic() > deadline:
                raise TimeoutError("the job ran for 180 s")
            time.sleep(0.02)
    finally:
        launch.kill_all(procs)
    if trial is not None and died_at is not None:
        trial.detect_s = time.monotonic() - died_at
    return [p.returncode for p in procs]


def check(report: Path, before: list[int]) -> tuple[bool, str, int | None]:
    """The restore of the run that wrote `report`: the newest committed step (as the root held
    it at the restore, and at least what it held when the last trial ended), its state on every
    rank equal to what was recorded for that step."""
    reps = [json.loads(Path(f"{report}.rank{r}.json").read_text()) for r in range(RANKS)]
    got = {r["restored_step"] for r in reps}
    if len(got) != 1:
        return False, f"the ranks restored different steps: {got}", None
    step = got.pop()
    newest = max(reps[0]["committed"], default=None)
    if step != newest:
        return False, f"restored step {step}, but the newest committed is {newest}", step
    if before and (step is None or step < before[-1]):
        return False, f"restored step {step}, older than step {before[-1]} committed before the restart", step
    if not all(r["hash_ok"] for r in reps):
        return False, f"step {step}: the restored state differs from what the step held when saved", step
    return True, "", step


def sweep(trials: int, seed: int, base: Path, agent_share: float = 1 / 3, log=print) -> dict:
    """Run `trials` seeded trials under `base`; returns the figures (see `figures`)."""
    rng = random.Random(seed)
    root, spool = base / "root", base / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    (base / "record").mkdir(exist_ok=True)
    agent = Agent(spool, base / "agent.log")
    done: list[Trial] = []
    prev: Trial | None = None
    todo = plans(rng, trials, agent_share)
    try:
        for i in range(trials + 1):  # the last run only checks the one before
            t = todo[i] if i < trials else None
            env = {"OMP_NUM_THREADS": "1"}
            if t is not None and t.agent:
                # A fresh agent when the last one died: it finishes what that one left
                # before the ranks restore (they wait for their node's agent).
                agent.ensure({"CKPT_FAULT": t.spec} if t.victim == "agent" else None)
                env["CKPT_SPOOL"] = str(spool)
            elif prev is not None and prev.agent:
                agent.settle(root)  # what a restart on that node would wait for, then no agent
                agent.stop()
            if t is not None and t.victim != "agent":
                env["CKPT_FAULT"] = t.spec
            report = base / f"report-{i}"
            before, began = committed(root), time.time()
            codes = run_job(base, root, report, env, t)
            if prev is not None:
                prev.ok, prev.why, prev.restored = check(report, before)
                log(f"trial {prev.index:3d}: {prev.spec:30s} fired={prev.fired!s:5s} reached {prev.reached} "
                    f"restored {prev.restored}: {'ok' if prev.ok else 'WRONG: ' + prev.why}")
            if t is None:
                break
            t.codes = codes
            if t.victim == "agent":
                t.fired = agent.proc is not None and agent.proc.poll() == -signal.SIGKILL
            else:
                t.fired = -signal.SIGKILL in codes or (t.victim.startswith("writer") and any(codes))
            t.reached = max((int(f.name.split("-")[1].split(".")[0]) for f in (base / "record").iterdir()
                             if not f.name.endswith(".tmp") and f.stat().st_mtime >= began), default=None)
            t.committed_after = max(committed(root), default=None)
            done.append(t)
            prev = t
    finally:
        agent.stop()
    deep = verify_deep(root)
    return figures(done, deep)


def verify_deep(root: Path) -> dict:
    """Every committed checkpoint the root still holds, read whole against its checksums."""
    r = ckpt_cli("verify", root, "--deep", env=_env())
    return {"rc": r.returncode, "out": (r.stdout + r.stderr)[-2000:]}


def figures(done: list[Trial], deep: dict) -> dict:
    fired = [t for t in done if t.fired]
    detect = [t.detect_s for t in done if t.detect_s is not None and t.victim.startswith("rank")]
    return {
        "trials": len(done),
        "kills": len(fired),
        "kills_by_phase": dict(Counter(t.phase for t in fired)),
        "kills_by_victim": dict(Counter(t.victim.rstrip("01") for t in fired)),
        "with_agent": sum(t.agent for t in done),
        "restores_correct": sum(bool(t.ok) for t in done),
        "restores_wrong": [{"trial": t.index, "phase": t.phase, "victim": t.victim, "why": t.why} for t in done if not t.ok],
        "data_lost_beyond_last_commit": sum(1 for t in done if t.restored is not None and t.committed_after is not None and t.restored < t.committed_after),
        "dead_rank_to_error_s": {"median": statistics.median(detect), "max": max(detect)} if detect else None,
        "steps_lost_per_kill": statistics.mean(t.reached - (t.restored or 0) for t in fired if t.reached is not None) if fired else None,
        "verify_deep_rc": deep["rc"],
        "verify_deep_tail": deep["out"],
        "trial_log": [t.__dict__ for t in done],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", default=None, help="work directory (default: a fresh one under /tmp)")
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    args = p.parse_args()
    import tempfile

    base = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-torture-"))
    began = time.monotonic()
    f = sweep(args.trials, args.seed, base)
    f["seconds"] = round(time.monotonic() - began)
    f["seed"] = args.seed
    print(json.dumps({k: v for k, v in f.items() if k != "trial_log"}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(f, indent=2))
    return 0 if f["restores_correct"] == f["trials"] and f["verify_deep_rc"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
