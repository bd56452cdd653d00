"""The VectorDBBench process: `python -m loadtests.vectordbbench.bench PLAN.json` runs the plan's tasks through
VectorDBBench's own runner and waits for them. The command (__main__.py) starts it with VectorDBBench's
environment (log and result folders) and captures its output.

VectorDBBench runs its work in spawned processes, which import this module again as their main module: the
top-level imports below register Switchyard and keep the run offline in each of them.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from . import offline, registry  # noqa: F401 - registry registers DB.Switchyard at import

offline.install()
log = logging.getLogger("vectordb_bench")
QUIET_WAIT_S = 300  # the most one system's leftover work may delay the next system's cases


def run(plan: dict) -> int:
    """Each system's tasks in turn, the machine quiet again between them: what one system leaves running after its
    searches (Switchyard's background pgvector index build, PostgreSQL's autovacuum) must not take the next's cores."""
    from vectordb_bench import interface

    from loadtests.benchkit import wait_for_quiet

    from .tasks import build_tasks

    runner = interface.benchmark_runner
    by_system: dict[str, list] = {}
    for task in build_tasks(plan):
        by_system.setdefault(task.db.value, []).append(task)
    for turn, (system, tasks) in enumerate(by_system.items()):
        if turn:
            load = wait_for_quiet(QUIET_WAIT_S)
            log.info(f"Machine quiet before {system}'s cases: {load:.2f} cores busy")
        runner.run(tasks, plan["task_label"])
        while runner.has_running():
            future = interface.global_result_future
            if future is not None and future.done() and future.exception() is not None:
                log.error(f"VectorDBBench's task process died: {future.exception()!r}")
                return 1
            time.sleep(1)
        if runner.latest_error:
            log.error(f"VectorDBBench did not run the tasks: {runner.latest_error}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(run(json.loads(Path(sys.argv[1]).read_text())))
