"""Fault injection for the torture tests: kill this process at a named point of a save.

`CKPT_FAULT=<point>:<rank>:<step>` (several separated by commas) SIGKILLs the process when
rank <rank> reaches <point> while saving step <step>; `*` matches any rank or step.
`<point>:<rank>:<step>:sleep=<seconds>` stalls there instead (a slow store; a line on stderr
says when), `<point>:<rank>:<step>:burn=<seconds>` computes there in Python for that long (a
save's background work that takes CPU and the GIL from the training loop: serialization,
checksums), and
`<point>:<rank>:<step>:nth=<k>` kills on the k-th time the rule matches in this process (a
point deeper into a file, a later chunk), and `<point>:<rank>:<step>:raise` raises
`RuntimeError` at `capture`, `prepare`, `staging` or `copying` (a failure the process lives
through: a state_dict() that raises, no shared memory, a device error in a copy; at the other
points it would leave the ranks in different collectives). Points: `capture` (on the training
thread, a save begun, its state not captured yet), `prepare` (on the training thread, the
state captured, its host buffers not set up yet), `staging` (in the background save, the
copies left to it not made yet), `copying` (in the copier's thread, after each batch of those
copies, the writer under way), `write_item` (between two items of a data file),
`writer_process` (in the writer process, before it writes a data file), `before_manifest`
(all data files and `.metadata` durable, the manifest not yet written), `after_manifest`,
`retention` (rank 0 deleting an old checkpoint, `<step>` the deleted one: its manifest gone,
its files not yet); with a node agent, `after_handoff` (this rank's files handed off to the
agent) and, in the agent, `agent_upload` (a chunk of a rank's file written to the root, the
upload not complete) and `agent_durable` (a rank's marker written, the commit not tried). Unset in production: one dict lookup.
"""

from __future__ import annotations

import os
import signal
import sys
import time

_hits: dict[str, int] = {}  # rule -> times matched, for nth=


def fault_point(point: str, rank: int, step: int) -> None:
    spec = os.environ.get("CKPT_FAULT")
    if not spec:
        return
    for rule in spec.split(","):
        p, r, s, action = (rule.strip().split(":") + ["", "", ""])[:4]
        if p == point and r in ("*", str(rank)) and s in ("*", "", str(step)):
            if action.startswith("sleep="):
                # Said first, so that a test can act while the process is held here.
                print(f"ckpt fault: {point} of rank {rank} at step {step}: sleeping {action.removeprefix('sleep=')} s", file=sys.stderr, flush=True)
                time.sleep(float(action.removeprefix("sleep=")))
                continue
            if action.startswith("burn="):
                end = time.perf_counter() + float(action.removeprefix("burn="))
                while time.perf_counter() < end:
                    sum(range(1000))  # the GIL held as Python code holds it: released every switch interval
                continue
            if action == "raise":
                raise RuntimeError(f"ckpt fault: {point} of rank {rank} at step {step}")
            _hits[rule] = _hits.get(rule, 0) + 1
            if not action.startswith("nth=") or _hits[rule] == int(action.removeprefix("nth=")):
                os.kill(os.getpid(), signal.SIGKILL)
