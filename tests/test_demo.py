"""The main job of the README, end to end, so that it never rots."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_demo_kills_a_rank_resumes_and_matches_the_uninterrupted_run(tmp_path):
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "killed with SIGKILL" in out.stdout
    assert "bit for bit: True" in out.stdout
    # Only committed checkpoints are left, and the newest is the last step.
    assert (tmp_path / "demo" / "run" / "step-0000000120" / "manifest.json").exists()
