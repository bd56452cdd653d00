"""Long-running work (bulk loads, index builds, SSB generation) as jobs with progress.

A job's state lives in memory while it runs and in the `jobs` table, so GET /v1/jobs/{id} answers after
the fact and after a restart; a job that was running when the process died is marked failed at start-up.
At most `max_running` jobs run at once (they are heavy: disk, memory, every core); up to `max_queued` more wait,
and past that a new job is refused with 503 and Retry-After. A job that writes to disk is admitted through the
process's disk ledger (service/jobs/disk.py), which holds its estimate until the job ends.
DELETE /v1/jobs/{id} cancels a job: its next progress report raises JobCancelled inside the work (worker threads
included), which then cleans up as on any failure (SSB generation leaves no partial dataset; a bulk load keeps
the chunks it committed).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import asyncpg
import orjson

from service.admission.control import Shed
from service.jobs.disk import Claim, DiskLedger, DiskNeed

log = logging.getLogger("switchyard.jobs")

Progress = Callable[[int, int | None, str], None]
FLUSH_EVERY_S = 0.5


def failure_message(job: "Job", exc: Exception) -> str:
    """What a failed job tells its client: the reason when it is one of ours (bad input found while loading), else
    a stable message with an error id; a library's exception text goes only to the log."""
    from indexes.errors import EngineFailed, VectorError
    from olap.importer import SsbImportError
    from olap.queries import QueryParamError
    from service.database.postgres import database_unavailable
    from service.jobs.disk import disk_full
    from spatial.geoarrow import GeometryError

    if isinstance(exc, (VectorError, SsbImportError, QueryParamError, GeometryError)) \
            and not isinstance(exc, EngineFailed):
        log.warning("job %s (%s) failed: %s", job.id, job.kind, exc)
        return str(getattr(exc, "detail", exc))
    error_id = uuid.uuid4().hex[:16]
    log.error("job %s (%s) failed (error id %s)", job.id, job.kind, error_id, exc_info=exc)
    if disk_full(exc):
        return f"the disk filled up while the job ran; nothing past its last commit was kept (error id {error_id})"
    if database_unavailable(exc):
        return ("PostgreSQL became unavailable while the job ran; nothing past its last commit was kept "
                f"(error id {error_id})")
    return f"the job failed; quote error id {error_id} when reporting it (the service's log has the cause)"


def job_key(job_id: str) -> uuid.UUID | None:
    """A job's id in its one string form, hex with hyphens, in either case (RFC 9562: case-insensitive on input);
    None for any other (braces, a URN, no hyphens). Every lookup goes through it: an upper-case id once found a
    running job's stale row in the table, and could not cancel it."""
    try:
        key = uuid.UUID(job_id)
    except ValueError:
        return None
    return key if str(key) == job_id.lower() else None


class JobCancelled(Exception):
    """Raised inside a job's work, at its next progress report, once a client cancelled it."""


@dataclass
class Job:
    id: str
    kind: str
    subject: str | None
    state: str = "queued"
    done: int = 0
    total: int | None = None
    message: str | None = None
    result: dict[str, Any] | None = None
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    cancel_requested: bool = False
    task: asyncio.Task | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "subject": self.subject, "state": self.state, "done": self.done,
                "total": self.total, "message": self.message, "result": self.result,
                "created_at": self.created_at, "updated_at": self.updated_at}


class JobRunner:
    def __init__(self, pool: asyncpg.Pool, disk: DiskLedger, max_running: int = 2, max_queued: int = 16) -> None:
        self.pool = pool
        self.disk = disk
        self.running: dict[str, Job] = {}  # queued or running in this process
        self.tasks: set[asyncio.Task] = set()
        self.max_queued = max_queued
        self._slots = asyncio.Semaphore(max_running)

    async def recover(self) -> int:
        """Jobs left queued or running by a previous process will never finish: say so."""
        status = await self.pool.execute(
            "UPDATE jobs SET state = 'failed', message = 'interrupted: the service stopped while it ran; "
            "what it had committed is kept', updated_at = now() WHERE state IN ('queued', 'running')"
        )
        return int(status.split()[-1])

    async def start(self, kind: str, subject: str | None, work: Callable[[Progress], Awaitable[dict[str, Any]]],
                    cleanup: Callable[[], None] | None = None, disk: DiskNeed | None = None) -> Job:
        """Queue `work`; `cleanup` runs when the job ends, however it ends (cancelled while queued too). `disk`:
        what the job will write, claimed in the ledger (507 if it does not fit) until the job ends."""
        queued = sum(1 for job in self.running.values() if job.state == "queued")
        if queued >= self.max_queued:
            raise Shed(f"{queued} jobs are already waiting for a slot (SWITCHYARD_MAX_QUEUED_JOBS); the job was not "
                       "started", 10.0, reason="jobs_queued")
        claim = self.disk.claim(disk) if disk is not None else None
        try:
            job = Job(str(uuid.uuid4()), kind, subject)
            await self.pool.execute(
                "INSERT INTO jobs (id, kind, subject, state) VALUES ($1, $2, $3, 'queued')", uuid.UUID(job.id), kind,
                subject
            )
            self.running[job.id] = job
            job.task = asyncio.create_task(self._run(job, work, cleanup), name=f"job-{kind}-{job.id}")
        except BaseException:
            if claim is not None:
                self.disk.release(claim)
            raise
        self.tasks.add(job.task)
        job.task.add_done_callback(self.tasks.discard)
        if claim is not None:  # a done callback: it runs even for a task cancelled before its first step
            held: Claim = claim
            job.task.add_done_callback(lambda _task: self.disk.release(held))
        return job

    async def cancel(self, job_id: str) -> dict[str, Any] | None:
        """Cancel a queued or running job of this process (None if it has none by that id)."""
        key = job_key(job_id)
        job = self.running.get(str(key)) if key is not None else None
        if job is None or job.task is None:
            return None
        job.cancel_requested = True
        job.task.cancel()
        await asyncio.gather(job.task, return_exceptions=True)
        return job.as_dict()

    async def delete(self, job_id: str) -> bool:
        """Forget a finished job; False if there is none (a queued or running one is cancelled first)."""
        await self.cancel(job_id)
        if (key := job_key(job_id)) is None:
            return False
        status = await self.pool.execute("DELETE FROM jobs WHERE id = $1", key)
        return status.split()[-1] != "0"

    async def _run(self, job: Job, work: Callable[[Progress], Awaitable[dict[str, Any]]],
                   cleanup: Callable[[], None] | None) -> None:
        last_flush = 0.0
        loop = asyncio.get_running_loop()

        def progress(done: int, total: int | None, message: str) -> None:
            """Callable from the event loop or from a worker thread (index builds report from there)."""
            nonlocal last_flush
            if job.cancel_requested:
                raise JobCancelled(f"job {job.id} was cancelled")
            job.done, job.message, job.updated_at = done, message, time.time()
            if total is not None:
                job.total = total
            if time.monotonic() - last_flush > FLUSH_EVERY_S:
                last_flush = time.monotonic()
                loop.call_soon_threadsafe(self._flush_soon, job)

        try:
            async with self._slots:
                job.state = "running"
                await self._flush(job)
                job.result = await work(progress)
                job.state, job.message = "succeeded", "done"  # not the last step's "copying ... into PostgreSQL"
                job.done = job.total if job.total is not None else job.done
        except (asyncio.CancelledError, JobCancelled):
            if job.cancel_requested:
                job.state, job.message = "cancelled", "cancelled by a client; what it had committed is kept"
            else:
                job.state, job.message = "failed", "cancelled: the service is stopping"
                raise
        except Exception as exc:  # noqa: BLE001 - recorded on the job, which is what the client watches
            job.state, job.message = "failed", failure_message(job, exc)
        finally:
            job.updated_at = time.time()
            if cleanup is not None:
                cleanup()
            try:
                await asyncio.shield(self._flush(job, final=True))
            finally:
                self.running.pop(job.id, None)

    def _flush_soon(self, job: Job) -> None:
        task = asyncio.get_running_loop().create_task(self._flush(job))
        self.tasks.add(task)  # a strong reference until it is done
        task.add_done_callback(self.tasks.discard)

    async def _flush(self, job: Job, final: bool = False) -> None:
        """Write the job's state. Progress flushes run as their own tasks and may reach the database after the
        final one: they never overwrite a finished job's state."""
        try:
            await self.pool.execute(
                "UPDATE jobs SET state = $2, done = $3, total = $4, message = $5, result = $6, updated_at = now() "
                "WHERE id = $1 AND ($7 OR state NOT IN ('succeeded', 'failed', 'cancelled'))",
                uuid.UUID(job.id), job.state,
                job.done, job.total, job.message, orjson.dumps(job.result).decode() if job.result is not None else None,
                final,
            )
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
            log.warning("could not record progress of job %s", job.id)

    async def get(self, job_id: str) -> dict[str, Any] | None:
        if (key := job_key(job_id)) is None:
            return None
        if (job := self.running.get(str(key))) is not None:
            return job.as_dict()
        row = await self.pool.fetchrow("SELECT * FROM jobs WHERE id = $1", key)
        if row is None:
            return None
        return {"id": str(row["id"]), "kind": row["kind"], "subject": row["subject"], "state": row["state"],
                "done": row["done"], "total": row["total"], "message": row["message"],
                "result": orjson.loads(row["result"]) if row["result"] else None,
                "created_at": row["created_at"].timestamp(), "updated_at": row["updated_at"].timestamp()}

    async def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
