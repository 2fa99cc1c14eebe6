"""One thread owns the model: it runs the scheduler and answers each request through the callback it came with.

HTTP handlers never touch the model (its KV cache and the scheduler are not thread-safe); they `submit` a job with a
`reply` callback and may `cancel` it. Both go through one inbox the engine thread drains between steps, so a job
joins the batch at the next step and a cancelled one leaves before it. `reply` is called on the engine thread with
each Output, or once with an exception (QueueFull, or a failed step), and must not block.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable

from moerun.serve.scheduler import Job, Output, Scheduler

Reply = Callable[[Output | Exception], None]
log = logging.getLogger("moerun.serve")


class Engine:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._inbox: queue.SimpleQueue[tuple[str, int, Job | None, Reply | None]] = queue.SimpleQueue()
        self._tickets = itertools.count()
        self._job_of: dict[int, int] = {}  # ticket -> scheduler job id
        self._replies: dict[int, tuple[int, Reply]] = {}  # scheduler job id -> (ticket, reply)
        self._pending: list[Output] = []  # the last step's outputs, sent once the next step is launched
        self.cancelled = 0  # jobs dropped before they finished (their clients went away)
        self.status = self._status()  # replaced, never mutated, so that other threads may read it
        self._thread = threading.Thread(target=self._run, name="moerun-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(("stop", -1, None, None))
        self._thread.join()

    def submit(self, job: Job, reply: Reply) -> int:
        """Queue a job; a ticket to cancel it with. Thread-safe."""
        ticket = next(self._tickets)
        self._inbox.put(("add", ticket, job, reply))
        return ticket

    def cancel(self, ticket: int) -> None:
        """Thread-safe; a finished or unknown ticket is ignored."""
        self._inbox.put(("cancel", ticket, None, None))

    def _run(self) -> None:
        while True:
            for command in self._commands():
                if not self._apply(*command):
                    self._reply()
                    return
            if self.scheduler.busy:
                self._step()
            self.status = self._status()

    def _status(self) -> dict[str, int]:
        return {**self.scheduler.counts(), "cancelled": self.cancelled}

    def _commands(self) -> list[tuple[str, int, Job | None, Reply | None]]:
        """What the inbox holds; with nothing to run, waits for the first command instead of spinning (while the
        scheduler holds prompts back for more to come, at most until it lets them go)."""
        commands = []
        if not self.scheduler.busy:
            commands.append(self._inbox.get())
        elif not self.scheduler.running and (held := self.scheduler.held_s()):
            try:
                commands.append(self._inbox.get(timeout=held))
            except queue.Empty:
                pass
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, verb: str, ticket: int, job: Job | None, reply: Reply | None) -> bool:
        if verb == "stop":
            return False
        if verb == "add":
            try:
                job_id = self.scheduler.add(job)
            except Exception as e:  # QueueFull
                reply(e)
                return True
            self._job_of[ticket] = job_id
            self._replies[job_id] = (ticket, reply)
        elif ticket in self._job_of:
            job_id = self._job_of.pop(ticket)
            self._replies.pop(job_id)
            self.scheduler.cancel(job_id)
            self.cancelled += 1
        return True

    def _step(self) -> None:
        """One scheduler step. The previous step's outputs go to their requests once this step is on its way on the
        device (`Scheduler.step`'s `launched`), so that the HTTP side's work on them runs while the GPU does instead
        of between two steps; they go at once when no step follows."""
        try:
            outputs = self.scheduler.step(launched=self._reply)
        except Exception as e:  # a bug or a device error: fail the jobs in flight, keep serving
            log.exception("engine step failed; dropping the requests in flight")
            self._reply()
            for job_id in self.scheduler.reset():
                self._finish(job_id)[1](e)
            return
        self._pending = outputs
        if not self.scheduler.busy:
            self._reply()

    def _reply(self) -> None:
        """Send the outputs held back; those of a job cancelled meanwhile are dropped."""
        pending, self._pending = self._pending, []
        for out in pending:
            if out.job in self._replies:
                reply = self._finish(out.job)[1] if out.finish_reason else self._replies[out.job][1]
                reply(out)

    def _finish(self, job_id: int) -> tuple[int, Reply]:
        ticket, reply = self._replies.pop(job_id)
        del self._job_of[ticket]
        return ticket, reply
