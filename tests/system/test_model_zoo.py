"""Every kind of model state in the zoo (tests/support/zoo.py) is saved as it was when `step_done()`
returned, whatever forward, backward and the optimizer do to it next (issue 37), and a run
SIGKILLed after step 7 resumes from its step-6 checkpoint to step 8 bit for bit as a run
that never stopped: plain on one process and FSDP2 on 2 ranks, with default options, and
for the kinds whose buffers forward changes, the other ways a save copies the state
(overlap=False; streamed from the live state over the host memory budget).

Each mode costs two rounds of tests/workers/zoo_worker.py, which runs the whole zoo in one process
per rank: the uninterrupted reference beside the run to kill, then the resumed run.

Not covered here: the agent hand-off (tests/agent/test_agent.py) and DeepSpeed
(tests/system/test_deepspeed.py).
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckpt.storage.store import step_dir_name
from tests.support.compare import assert_bitwise_equal
from tests.support.launch import WORKERS, kill_all, start, wait
from tests.support.zoo import KINDS, cases

pytestmark = pytest.mark.slow

RANKS = {"plain": 1, "fsdp2": 2}
CASES = cases()


def params() -> list:
    """(mode, case) for every case under every mode, ids `<mode>-<case>`."""
    return [pytest.param(mode, case, id=f"{mode}-{case}") for mode in RANKS for case in CASES]


class Zoo:
    """The three phases of the zoo under one mode, run on first use."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, mode: str) -> None:
        self.dir = tmp_path_factory.mktemp(f"zoo-{mode}")
        self.ranks = RANKS[mode]
        # The reference and the run to kill are independent: run side by side.
        for phases in (("reference", "killed"), ("resumed",)):
            jobs = {phase: self.start(mode, phase) for phase in phases}
            try:
                exits = {phase: wait(procs, timeout=300) for phase, procs in jobs.items()}
            finally:
                for procs in jobs.values():
                    kill_all(procs)  # the other job too, when one fails to finish
            for phase, codes in exits.items():
                want = -signal.SIGKILL if phase == "killed" else 0
                assert codes == [want] * self.ranks, f"{phase}: exit codes {codes}\n{self.logs(phase)}"
        self.results = {phase: [self.load(phase, r) for r in range(self.ranks)] for phase in ("reference", "killed", "resumed")}

    def start(self, mode: str, phase: str) -> list[subprocess.Popen]:
        (self.dir / phase).mkdir()
        return start(self.ranks, WORKERS / "zoo_worker.py", "--mode", mode, "--phase", phase, "--dir", str(self.dir), log_dir=self.dir / phase)

    def load(self, phase: str, rank: int) -> dict[str, Any]:
        # Written by the worker itself: a killed run writes it before its SIGKILL.
        return torch.load(self.dir / f"{phase}.rank{rank}.pt", weights_only=False)

    def logs(self, phase: str) -> str:
        return "\n".join(f"--- rank{r}\n" + (self.dir / phase / f"rank{r}.log").read_text()[-4000:] for r in range(self.ranks))

    def case(self, phase: str, rank: int, case: str) -> dict[str, Any]:
        got = self.results[phase][rank][case]
        assert "error" not in got, f"{phase} run, rank {rank}:\n{got.get('error')}"
        return got

    def saved(self, case: str, step: int, tmp_path: Path) -> dict[str, Any]:
        """Everything the killed run's checkpoint of `step` holds, read with DCP alone."""
        dcp_to_torch_save(self.dir / "root" / case / step_dir_name(step), tmp_path / f"{step}.pt")
        return torch.load(tmp_path / f"{step}.pt", weights_only=False)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    done: dict[str, Zoo] = {}

    def get(mode: str) -> Zoo:
        if mode not in done:
            done[mode] = Zoo(tmp_path_factory, mode)
        return done[mode]

    return get


@pytest.mark.parametrize(("mode", "case"), params())
def test_every_zoo_model_resumes_bitwise_after_sigkill(zoo, mode, case):
    kind = KINDS[CASES[case][0]]
    z = zoo(mode)
    for rank in range(z.ranks):
        z.case("killed", rank, case)
        want, got = z.case("reference", rank, case), z.case("resumed", rank, case)
        assert got["restored_step"] == 6
        assert_bitwise_equal(got[8], want[8], f"rank{rank}: after step 8")
        assert_bitwise_equal(got["rng"], want["rng"], f"rank{rank}: draws after step 8")
        assert got[8]["ties"] == [sorted(t) for t in kind.ties], "parameters tied in the model are one tensor after the restore"


@pytest.mark.parametrize(("mode", "case"), params())
def test_every_checkpoint_holds_the_state_when_its_step_done_returned(zoo, mode, case, tmp_path):
    kind = KINDS[CASES[case][0]]
    z = zoo(mode)
    for rank in range(z.ranks):
        z.case("killed", rank, case)
    for step in (3, 6):
        saved = z.saved(case, step, tmp_path)
        for rank in range(z.ranks):
            want = z.case("reference", rank, case)[step]
            for key in ("model", "optim", "scheduler", "extra"):
                assert_bitwise_equal(saved.get(key, {}), want[key], f"step {step}: {key}")
            assert_bitwise_equal(saved["rng"][f"rank_{rank}"]["torch"], want["rng"]["torch"], f"step {step}: rank {rank}'s torch RNG")
        assert not set(kind.unsaved) & set(saved["model"]), "non-persistent buffers are never saved"
        assert not set(kind.stateless) & set(saved["optim"]["state"]), "parameters no step reached have no optimizer state (if they do, the zoo's seeds no longer leave them idle)"
