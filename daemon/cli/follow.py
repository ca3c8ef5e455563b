"""Following an operation: the live phase display, Ctrl-C held while it starts, cancel on interrupt."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

from gpusnap.daemon.cli.app import Ctx, checked
from gpusnap.daemon.cli.output import console, emit, moved, safe

if TYPE_CHECKING:
    from gpusnap.daemon.client import DaemonClient, OperationHandle
    from gpusnap.daemon.client.values import Operation, OperationEvent


@contextmanager
def phase_display(enabled: bool) -> Iterator[Callable[[OperationEvent], None]]:
    """A live phase display on a terminal; a no-op elsewhere. A phase shows the seconds it has run, and once it
    ended the seconds it took (as the operation recorded them: ``wait`` on an ended operation replays its phases
    at once, and they show what they took, not how long the replay took)."""
    if not enabled:
        yield lambda event: None
        return
    from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn
    from rich.text import Text

    from gpusnap.daemon.api.types import EventType as E

    class Seconds(ProgressColumn):
        def render(self, task: Task) -> Text:
            took = task.fields.get("took")
            return Text(f"{took if took is not None else task.elapsed or 0.0:.2f}s", style="progress.elapsed")

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description:<12}"),
        BarColumn(),
        TextColumn("{task.fields[moved]}"),
        Seconds(),
    )
    with Progress(*columns, console=console(stderr=True), transient=False) as progress:
        tasks: dict[str, Any] = {}

        def show(event: OperationEvent) -> None:
            phase = event.phase or ""
            if event.type == E.PHASE_STARTED:
                tasks[phase] = progress.add_task(phase, total=None, moved="", took=None)
            elif event.type == E.PROGRESS and phase in tasks:
                progress.update(
                    tasks[phase],
                    completed=event.bytes,
                    total=event.total_bytes or None,
                    moved=moved(event.bytes, event.total_bytes, event.bytes_per_second),
                )
            elif event.type in (E.PHASE_FINISHED, E.PHASE_FAILED) and phase in tasks:
                mark = "" if event.type == E.PHASE_FINISHED else " [red]failed[/red]"
                progress.update(
                    tasks[phase],
                    description=phase + mark,
                    completed=1,
                    total=1,
                    took=event.duration_seconds,
                    moved=moved(
                        event.bytes, event.bytes, event.bytes / event.duration_seconds if event.duration_seconds else 0
                    ),
                )
            elif event.type == E.ROLLBACK:
                from rich.markup import escape

                line = escape(safe(f"{phase}: {event.message or ''}"))
                progress.console.print(f"[yellow]rollback[/yellow] {line}")
            elif event.type == E.CANCEL_REQUESTED:
                from rich.markup import escape

                progress.console.print(f"[yellow]cancel[/yellow] {escape(safe(event.message or ''))}")

        yield show


class HeldInterrupt:
    """Ctrl-C while an operation is being started is noted, not raised: its id is not known yet, so it could
    be neither cancelled nor followed. :func:`follow` cancels it once the id is there."""

    def __init__(self) -> None:
        self.pending = False
        self._previous: Any = None
        # Only where Ctrl-C raises: a shell starts a background job with SIGINT ignored, and it stays so.
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is (
            signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._note)

    def _note(self, _signum: int, _frame: object) -> None:
        self.pending = True

    def release(self) -> None:
        """Ctrl-C raises KeyboardInterrupt again (idempotent)."""
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def start_held(fn: Callable[[], OperationHandle]) -> tuple[OperationHandle, HeldInterrupt]:
    """Start an operation with Ctrl-C held until :func:`follow` (or the caller) releases it."""
    held = HeldInterrupt()
    try:
        return checked(fn), held
    except BaseException:
        held.release()
        raise


def follow(
    client: DaemonClient,
    op_id: str,
    show_progress: bool,
    held: HeldInterrupt | None = None,
    on_event: Callable[[OperationEvent], None] | None = None,
) -> Operation:
    """Follow the operation to its end (live phases when ``show_progress``, or every event to ``on_event``); its
    error is raised if it failed, and Ctrl-C cancels it (:func:`cancel_and_wait`)."""
    from gpusnap.daemon.api.errors import ResourceExhaustedError
    from gpusnap.daemon.api.types import EventType
    from gpusnap.daemon.client import raise_if_failed

    try:
        if held is not None:
            held.release()
            if held.pending:
                raise KeyboardInterrupt
        try:
            with phase_display(show_progress and on_event is None) as show:
                show = on_event or show
                for event in client.watch(op_id):
                    show(event)
                    if event.type is EventType.OPERATION_FINISHED and event.operation is not None:
                        return raise_if_failed(event.operation)
            return client.wait(op_id)
        except ResourceExhaustedError as exc:
            if exc.reason not in STREAM_REFUSALS:
                raise
            # The operation runs whether or not it is followed: its outcome is what the command reports.
            click.echo(f"gpusnap: cannot follow {op_id} live ({exc.message}); checking on it instead", err=True)
            return poll(client, op_id)
    except KeyboardInterrupt:
        return cancel_and_wait(client, op_id)


STREAM_REFUSALS = ("TOO_MANY_STREAMS", "TOO_MANY_CALLS")
"""Reasons gpusnapd refuses a caller's Watch or Wait for (its own limits), not the operation."""
POLL_S = (0.2, 2.0)
"""First and longest pause between two GetOperation calls of :func:`poll`."""


def poll(client: DaemonClient, op_id: str) -> Operation:
    """Ask for the operation until it has ended (pauses growing from ``POLL_S[0]`` to ``POLL_S[1]`` s); its
    error is raised if it failed. For when the daemon refuses to stream its events to this caller."""
    from gpusnap.daemon.api.types import OperationState
    from gpusnap.daemon.client import raise_if_failed

    pause = POLL_S[0]
    while True:
        op = client.get_operation(op_id)
        if op.state is not OperationState.RUNNING:
            return raise_if_failed(op)
        time.sleep(pause)
        pause = min(pause * 2, POLL_S[1])


def cancel_and_wait(client: DaemonClient, op_id: str) -> Operation:
    """Ctrl-C: cancel the operation, say at once what that does (it stops now, or once its phase ends, or it is too
    late: ``cancel_note``), and wait for its end; a second Ctrl-C leaves it to gpusnapd. Returns the operation if it
    ended well all the same (too late to cancel)."""
    try:
        note = client.cancel(op_id).cancel_note
        click.echo(
            f"gpusnap: interrupted: {safe(note or 'cancelling ' + op_id)} (Ctrl-C again to stop waiting)", err=True
        )
        return client.wait(op_id)  # raises CancelledError once rolled back (exit 130)
    except KeyboardInterrupt:
        click.echo(f"gpusnap: operation {op_id} goes on in gpusnapd: follow it with `gpusnap wait {op_id}`", err=True)
        sys.exit(130)


def print_event(event: OperationEvent, as_json: bool) -> None:
    """One event of ``wait --events``: a JSON object on one line (JSON Lines), or a line of text: its time, phase,
    type, and bytes, rate and message where it has them."""
    if as_json:
        import json

        from gpusnap.daemon.cli.render import plain

        click.echo(json.dumps(plain(event)), nl=True)
        return
    from gpusnap.daemon.api.types import EventType as E

    what = event.type.value.replace("_", " ")
    if event.type is E.PROGRESS:
        moving = moved(event.bytes, event.total_bytes, event.bytes_per_second)
    else:  # a phase's bytes at its average rate
        average = event.bytes / event.duration_seconds if event.duration_seconds else 0.0
        moving = moved(event.bytes, event.bytes, average)
        if event.duration_seconds:
            moving = f"{moving} in {event.duration_seconds:.2f} s".strip()
    phase = "" if event.type is E.OPERATION_FINISHED else event.phase or "-"
    line = " ".join(filter(None, [event.time.astimezone().strftime("%H:%M:%S.%f")[:-5], phase, what, moving]))
    click.echo(safe(f"{line}: {event.message}" if event.message else line))


def run_operation(obj: Ctx, start: Callable[[DaemonClient], OperationHandle]) -> Operation:
    """Start an operation and follow it to its end (live phases on a terminal); exits on failure."""
    with obj.client() as client:
        handle, sigint = start_held(lambda: start(client))
        return checked(lambda: follow(client, handle.id, obj.live, sigint))


def detached(obj: Ctx, op_id: str) -> None:
    """``--detach``: print the started operation's id (``{"operation": …}`` with ``-o json``)."""
    if obj.output == "json":
        from gpusnap.daemon.cli.documents import Detached

        emit(Detached(operation=op_id))
    else:
        click.echo(op_id)
