"""Just-in-time checkpoint: when the worker group fails, a surviving rank saves the last completed
step, so a worker SIGKILL costs at most one step instead of everything since the last periodic
checkpoint.

Invariants: a snapshot is taken holding :class:`StateGuard` (never in the middle of an update);
any survivor writes exactly what rank 0 would have written (:class:`AuthoritativeBuffers`); one
writer per step (claims); every save is bounded (:data:`SAVE_TIMEOUT_S`, then the process exits).
Triggers: a failing training loop (:meth:`JitCheckpointer.after_failure`) and a stop signal while
the training thread is stuck in a collective (:meth:`JitCheckpointer.on_signal`). Off with
``CheckpointConfig(jit_save=False)`` or ``ELASTIC_TRAINER_JIT_SAVE=0``. Design:
``docs/design/checkpointing.md``.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 -m elastic_trainer.examples.synthetic_cnn \
        --epochs 10 --checkpoint-dir /tmp/ckpt --checkpoint-every 1000 --throttle-ms 40 &
    sleep 8; kill -9 "$(pgrep -f synthetic_cnn | tail -1)"   # then: resumed from ... (a just-in-time checkpoint)
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from elastic_trainer.checkpoint import files as ckpt
from elastic_trainer.runtime import torch_compat
from elastic_trainer.runtime.failures import log_line

log = logging.getLogger(__name__)

TORCHRUN_STOP_WINDOW_S = 30.0
"""Seconds torchrun 2.13 waits between SIGTERM and SIGKILL (``PContext.close`` default timeout)."""
STALL_MIN_S = 1.0
"""After a stop signal, the shortest time without a step boundary that counts as a stall."""
STALL_MAX_S = 10.0
"""... and the longest (slow steps stretch it: :data:`STALL_STEPS` times the recent step time)."""
STALL_STEPS = 3.0
"""A stall lasts this many recent step durations (the graceful stop needs up to two steps)."""
SAVE_TIMEOUT_S = 15.0
"""Deadline of one JIT save (snapshot and write); past it the process exits."""
EXIT_MARGIN_S = 1.0
"""Kept free before torchrun's SIGKILL and the SIGTERM grace deadline."""
BACKSTOP_S = 0.5
"""The exit timer of a save fires this long after its deadline (every wait inside the save is
bounded by the deadline itself; the timer is for the calls that cannot be: a hung write)."""
EXIT_AFTER_SIGNAL = 128 + signal.SIGTERM
"""Exit code after a JIT save on the signal path (as after a graceful stop)."""


class JitSaveError(Exception):
    """A JIT snapshot cannot be taken (guard not acquired in time, state inconsistent)."""


@dataclass(frozen=True, slots=True)
class JitOutcome:
    """What a JIT save did."""

    saved: bool
    step: int | None
    path: str | None
    detail: str
    """Why it was skipped or failed, or what was written."""


# -- consistency -------------------------------------------------------------------------------------
class StateGuard:
    """The lock held around every change of the training state; a JIT snapshot holds it too.

    Also tracks step boundaries (for stall detection): :meth:`boundary` after every step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.consistent = True
        """False once an exception escaped an update: the state may be half-updated."""
        self.progress = threading.Event()
        """Set at every step boundary (and when a checkpoint write ends)."""
        self._durations: deque[float] = deque(maxlen=8)
        self._last_boundary: float | None = None

    @contextlib.contextmanager
    def update(self) -> Iterator[None]:
        """Main thread, around the update section; an exception marks the state inconsistent."""
        with self._lock:
            try:
                yield
            except BaseException:
                self.consistent = False
                raise

    @contextlib.contextmanager
    def hold(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the guard (no update can start or be in progress).

        Raises:
            JitSaveError: not acquired within ``timeout`` seconds (``None``: wait as long as needed).
        """
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise JitSaveError(f"the training thread stayed inside an optimizer update for {timeout:.1f} s")
        try:
            yield
        finally:
            self._lock.release()

    def boundary(self) -> None:
        """A step ended (main thread)."""
        now = time.monotonic()
        if self._last_boundary is not None:
            self._durations.append(now - self._last_boundary)
        self._last_boundary = now
        self.progress.set()

    @property
    def recent_step_s(self) -> float:
        """The longest of the last few step durations (0 before two boundaries)."""
        return max(self._durations, default=0.0)


# -- buffers -------------------------------------------------------------------------------------------
def _persistent_buffer_slots(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """``(module, attribute, state_dict key)`` of every buffer that a state_dict holds."""
    keys = set(model.state_dict().keys())
    slots = []
    for module_name, module in model.named_modules():
        for attr, buffer in module.named_buffers(recurse=False):
            key = f"{module_name}.{attr}" if module_name else attr
            if buffer is not None and key in keys:
                slots.append((module, attr, key))
    return slots


_EXCHANGEABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                 torch.int16, torch.int8, torch.uint8, torch.bool)
"""Buffer dtypes that round-trip exactly through float64 (int64 up to 2**53: step counters)."""


_INT_HEADROOM = 2**50
"""A 64-bit integer buffer replaces DDP's broadcast only below this at the start (a counter moved
by one a forward would need 2**53 - 2**50 forwards to leave float64's exact range)."""


def replaces_buffer_broadcast(model: nn.Module) -> bool:
    """Whether rank 0's buffers riding on the control allreduce (``AuthoritativeBuffers(apply=True)``)
    can stand in for DDP's forward-time buffer broadcast: every buffer DDP would broadcast is one a
    state_dict holds (the others do not ride), with a dtype that rides exactly (64-bit integers:
    holding values well inside float64's exact range now), and there is one."""
    persistent = {id(module._buffers[attr]) for module, attr, _ in _persistent_buffer_slots(model)}
    buffers = [b for _, b in model.named_buffers()]

    def rides(b: torch.Tensor) -> bool:
        if id(b) not in persistent or b.dtype not in _EXCHANGEABLE:
            return False
        return b.dtype != torch.int64 or b.numel() == 0 or int(b.abs().max()) < _INT_HEADROOM

    return bool(buffers) and all(rides(b) for b in buffers)


class AuthoritativeBuffers:
    """Rank 0's module buffers after the last completed step, held by every rank.

    They ride on the step's control allreduce (one collective per step, as without JIT). After a
    step's last forward (the backward does not change buffers), :meth:`capture` copies this
    rank's buffers as float64 and returns the contribution to append to the control tensor: rank
    0's values, ``-0.0`` from every other rank (``x + -0.0 == x`` bit for bit in IEEE
    arithmetic, ``+0.0`` and ``-0.0`` included, so the sum is rank 0's values exactly). Once that
    allreduce has completed, the update section calls :meth:`commit` with its result; a saver
    holding the guard calls :meth:`snapshot` and gets the buffers of exactly the step the
    weights are at.

    With ``apply=True`` :meth:`commit` also writes rank 0's values into this rank's module
    buffers: what DDP's forward-time buffer broadcast would do at the next forward, which the
    runtime then turns off (:func:`replaces_buffer_broadcast`). One collective per step fewer,
    and the buffers travel on a collective that an abort can end (``runtime/abortable.py``).
    """

    def __init__(self, model: nn.Module, *, rank: int, world_size: int, apply: bool = False) -> None:
        self._slots = _persistent_buffer_slots(model)
        self._rank = rank
        self._world_size = world_size
        self._apply = apply and rank != 0 and world_size > 1  # rank 0's own values come back unchanged
        self._applied_views: dict[int, list[torch.Tensor]] = {}  # reduced tensor's data_ptr -> its views
        self._layout: list[tuple[str, torch.dtype, torch.Size, int]] = []
        self._own: torch.Tensor | None = None  # this rank's buffers of the step in progress, float64
        self._views: list[torch.Tensor] = []  # _own cut into the buffers' shapes
        self._live: list[torch.Tensor] = []  # the buffer tensors _views were laid out for
        self._negative_zeros = torch.empty(0, dtype=torch.float64)
        self._own_committed: torch.Tensor | None = None  # where _commit_own keeps _own (reused)
        self._committed: torch.Tensor | None = None  # the buffers of the last completed step
        self._committed_layout: list[tuple[str, torch.dtype, torch.Size, int]] = []
        self._source = "none"
        unsupported = sorted({str(getattr(m, a).dtype) for m, a, _ in self._slots} - {str(d) for d in _EXCHANGEABLE})
        self.exchange = world_size > 1 and not unsupported
        if world_size > 1 and unsupported:
            log.warning("buffers of dtype %s cannot ride on the control allreduce: a just-in-time checkpoint "
                        "written by a rank other than 0 holds that rank's own buffers", ", ".join(unsupported))

    @property
    def enabled(self) -> bool:
        return bool(self._slots)

    def capture(self, *, identical: bool = False) -> torch.Tensor | None:
        """Copy this rank's buffers; returns its float64 contribution to the control allreduce
        (``None``: nothing to exchange; pass ``None`` to :meth:`commit` then).

        With ``identical=True`` (at the start: every rank loaded the same checkpoint, or was
        seeded alike) the copy is committed at once as the buffers of the current step.
        """
        if not self.enabled:
            return None
        live = [getattr(module, attr) for module, attr, _ in self._slots]
        if len(live) != len(self._live) or any(a is not b for a, b in zip(live, self._live, strict=False)):
            self._relayout(live)  # first step, or a module replaced a buffer
        # One kernel launch for all buffers (dtype conversion included); the copy is reused
        # from step to step: the control allreduce gets a copy of it (torch.cat), never the
        # tensor itself, and commit() keeps the reduced control tensor, not this one.
        try:
            torch_compat.foreach_copy_(self._views, live)
        except RuntimeError:  # a buffer was resized in place
            self._relayout(live)
            torch_compat.foreach_copy_(self._views, live)
        if identical:
            self._commit_own("rank0")
            return None
        if not self.exchange:
            return None
        return self._own if self._rank == 0 else self._negative_zeros

    def commit(self, reduced: torch.Tensor | None) -> None:
        """Inside the update section, after the step's control allreduce completed: ``reduced``
        is its buffer part (rank 0's values; kept, not copied: the control tensor is not reused),
        or ``None`` when :meth:`capture` returned ``None`` (this rank's own copy is kept)."""
        if not self.enabled:
            return
        if reduced is not None:
            self._committed, self._committed_layout, self._source = reduced, self._layout, "rank0"
            if self._apply:
                self._write_live(reduced)
        else:
            exact = self._rank == 0 or self._world_size == 1
            self._commit_own("rank0" if exact else "local")

    def _write_live(self, reduced: torch.Tensor) -> None:
        # The control channel alternates between two tensors: their views are cut once per layout.
        views = self._applied_views.get(reduced.data_ptr())
        if views is None:
            views, offset = [], 0
            for _, _, shape, numel in self._layout:
                views.append(reduced[offset : offset + numel].view(shape))
                offset += numel
            self._applied_views[reduced.data_ptr()] = views
        with torch.no_grad():
            torch_compat.foreach_copy_(self._live, views)

    def _commit_own(self, source: str) -> None:
        # Copied into a second buffer kept from step to step, not cloned: no allocation per step.
        # Overwriting the buffer that a snapshot read is safe: this runs inside the update
        # section (or before training starts), snapshot() runs holding the same guard and
        # returns copies, and on CUDA the saver's reads end (stream synchronised) before it
        # releases the guard (see device_snapshot). A relayout allocates a new buffer, so the
        # previous step's stays intact until this commit replaces it.
        if self._own is None or self._own_committed is None:
            raise RuntimeError("buffers committed before any were captured")
        self._own_committed.copy_(self._own)
        self._committed, self._committed_layout, self._source = self._own_committed, self._layout, source

    def _relayout(self, live: list[torch.Tensor]) -> None:
        self._live = live
        self._applied_views = {}
        self._layout = [(key, t.dtype, t.shape, t.numel()) for (_, _, key), t in zip(self._slots, live, strict=True)]
        layout = self._layout
        self._own = torch.empty(sum(n for *_, n in layout), dtype=torch.float64, device=live[0].device)
        self._views, offset = [], 0
        for _, _, shape, numel in layout:
            self._views.append(self._own[offset : offset + numel].view(shape))
            offset += numel
        self._negative_zeros = torch.full_like(self._own, -0.0)
        # A new tensor, never the old one resized: _committed may still be the old one (the last
        # completed step's buffers, in the old layout) until the step in progress commits.
        self._own_committed = torch.empty_like(self._own)

    def snapshot(self) -> tuple[dict[str, torch.Tensor], str]:
        """Buffers of the last completed step (caller holds the guard), and where they come from:
        ``"rank0"`` (what rank 0 would have saved) or ``"local"`` (dtypes that cannot be
        exchanged, saved by another rank).

        The tensors are copies (``clone``, also where the dtype is already float64): the next
        update overwrites the committed buffer in place."""
        if not self.enabled or self._committed is None:
            return {}, "none"
        out, offset, flat = {}, 0, self._committed
        for key, dtype, shape, numel in self._committed_layout:
            out[key] = flat[offset : offset + numel].to(dtype).reshape(shape).clone()
            offset += numel
        return out, self._source


def device_snapshot(build: Callable[[], Any], device: torch.device, after: torch.cuda.Event | None) -> Any:
    """CPU copy (``checkpoint.snapshot_to_cpu``) of the payload that ``build`` returns.

    On CUDA ``build`` and the copy run on a side stream that waits only for ``after`` (the end of
    the last update), not for work queued since (a hung collective); device work that ``build``
    queues (:meth:`AuthoritativeBuffers.snapshot`'s copies) is ordered after that update, and all
    of it has finished when this returns (the caller still holds the guard, so the next update
    cannot overwrite what was read).
    """
    if device.type != "cuda":
        return ckpt.snapshot_to_cpu(build())
    stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        copy = ckpt.snapshot_to_cpu(build())
        stream.synchronize()
    return copy


# -- deadlines ---------------------------------------------------------------------------------------
class ExitTimer:
    """Ends the process with ``code`` unless cancelled within ``seconds`` (a save must never hang)."""

    def __init__(self, seconds: float, code: int, why: str, exit_fn: Callable[[int], Any] = os._exit) -> None:
        self._cancelled = threading.Event()
        self._seconds, self._code, self._why, self._exit = seconds, code, why, exit_fn
        self._thread = threading.Thread(target=self._run, name="jit-deadline", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._cancelled.set()

    def _run(self) -> None:
        if self._cancelled.wait(max(0.0, self._seconds)):
            return
        log.error("%s did not finish within %.1f s; exiting now", self._why, self._seconds)
        flush_logs()
        self._exit(self._code)


def flush_logs() -> None:
    """Flush the root logger's handlers (before an exit that skips interpreter teardown)."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()


# -- the saver ---------------------------------------------------------------------------------------
class JitCheckpointer:
    """Saves the last completed step once, from whichever thread asks first.

    Args:
        guard: the trainer's :class:`StateGuard`.
        directory: the shared checkpoint directory.
        rank: recorded in the claim file.
        step: returns the number of completed steps (called holding the guard).
        payload: returns a host-memory copy of the state after that step (holding the guard).
        write: writes ``(step, payload)`` as a JIT checkpoint; returns its path.
        drain: waits up to the given seconds for this process's own checkpoint writes.
        stop_deadline: the graceful stop's deadline (``time.monotonic()``), if a signal set one.
        exit_fn: ends the process (tests inject a fake).
        enabled: ``False`` makes every method a no-op.
    """

    def __init__(
        self,
        *,
        guard: StateGuard,
        directory: str | None,
        rank: int,
        step: Callable[[], int],
        payload: Callable[[], dict[str, Any]],
        write: Callable[[int, dict[str, Any]], str],
        drain: Callable[[float], None] = lambda timeout: None,
        stop_deadline: Callable[[], float | None] = lambda: None,
        exit_fn: Callable[[int], Any] = os._exit,
        enabled: bool = True,
    ) -> None:
        self.guard = guard
        self.directory = directory
        self.enabled = enabled and directory is not None
        self._rank = rank
        self._step, self._payload, self._write, self._drain = step, payload, write, drain
        self._stop_deadline = stop_deadline
        self._exit = exit_fn
        self._save_lock = threading.Lock()
        self._outcome: JitOutcome | None = None
        self._armed = False
        self._stood_down = False
        self._busy = 0
        self._signal_at: float | None = None
        self._monitor: threading.Thread | None = None

    # -- trainer side (main thread) ---------------------------------------------------------------
    def arm(self) -> None:
        """Training started: the state now is a completed step (the one resumed from, or 0)."""
        self._armed = True
        self.guard.progress.set()

    def stand_down(self) -> None:
        """The ranks agreed to stop (or training ended): the graceful path owns the exit."""
        self._stood_down = True
        self.guard.progress.set()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """A checkpoint is being taken: not a stall, however long the write takes."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            self.guard.progress.set()

    def after_failure(self, exc: BaseException) -> JitOutcome | None:
        """Trigger (a): the training loop raised (a peer died). Saves within :data:`SAVE_TIMEOUT_S`.

        A failed checkpoint write is not retried here: the same disk would fail the same way.
        """
        if not self.enabled:
            return None
        if isinstance(exc, ckpt.CheckpointError):
            log.info("no just-in-time save after a checkpoint error (%s)", log_line(exc))
            return None
        log.warning("training failed (%s); saving the last completed step just in time", log_line(exc))
        return self.save(f"after {log_line(exc)}", deadline=time.monotonic() + SAVE_TIMEOUT_S)

    # -- signal side (wakeup thread) ------------------------------------------------------------------
    def on_signal(self, signum: int) -> None:
        """Trigger (b): a stop signal arrived (called at once, even while the main thread is
        blocked). Starts watching for step boundaries."""
        if not self.enabled or self._signal_at is not None:
            return
        self._signal_at = time.monotonic()
        self.guard.progress.clear()
        self._monitor = threading.Thread(target=self._watch, args=(signum,), name="jit-stall-monitor", daemon=True)
        self._monitor.start()

    def stall_timeout(self) -> float:
        return min(STALL_MAX_S, max(STALL_MIN_S, STALL_STEPS * self.guard.recent_step_s))

    def _watch(self, signum: int) -> None:
        name = signal.Signals(signum).name
        while not self._stood_down:
            timeout = self.stall_timeout()
            if self.guard.progress.wait(timeout):
                self.guard.progress.clear()
                continue
            if self._stood_down:
                return
            if self._busy or not self._armed:
                continue
            log.warning("%s received and no step boundary for %.1f s (blocked in a collective?): saving the last "
                        "completed step just in time, then exiting", name, timeout)
            deadline = self._signal_deadline()
            self.save(f"{name}, main thread stalled {timeout:.1f} s", deadline=deadline)
            self._drain(max(0.0, deadline - time.monotonic()))
            flush_logs()
            self._exit(EXIT_AFTER_SIGNAL)
            return

    def _signal_deadline(self) -> float:
        now = time.monotonic()
        if self._signal_at is None:
            raise RuntimeError("signal deadline asked for before any signal arrived")
        deadline = min(now + SAVE_TIMEOUT_S, self._signal_at + TORCHRUN_STOP_WINDOW_S - EXIT_MARGIN_S)
        stop = self._stop_deadline()
        if stop is not None:
            deadline = min(deadline, stop - EXIT_MARGIN_S)
        return max(deadline, now + 0.5)

    # -- the save -----------------------------------------------------------------------------------
    def save(self, reason: str, *, deadline: float) -> JitOutcome:
        """Save the last completed step unless done already; idempotent and thread-safe.

        Ends the process (exit code 1) if the save is still running at ``deadline``.
        """
        if not self.enabled:
            return JitOutcome(saved=False, step=None, path=None, detail="just-in-time saving is off")
        timer = ExitTimer(deadline + BACKSTOP_S - time.monotonic(), 1, "the just-in-time checkpoint", self._exit)
        try:
            acquired = self._save_lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
            if not acquired:
                return JitOutcome(saved=False, step=None, path=None, detail="another save is still running")
            try:
                if self._outcome is None:
                    self._outcome = self._save(reason, deadline)
                return self._outcome
            finally:
                self._save_lock.release()
        finally:
            timer.cancel()

    def _save(self, reason: str, deadline: float) -> JitOutcome:
        started = time.monotonic()
        if self.directory is None:
            raise RuntimeError("just-in-time save requested without a checkpoint directory")
        claim: ckpt.StepClaim | None = None
        step: int | None = None
        try:
            with self.guard.hold(timeout=deadline - started):
                if not self._armed:
                    return self._skip(None, "training had not started")
                if not self.guard.consistent:
                    return self._skip(None, "the failure happened inside an optimizer update; the state is inconsistent")
                step = self._step()
                if (newest := ckpt.newest_step(self.directory)) is not None and newest >= step:
                    return self._skip(step, f"a checkpoint of step {newest} exists")
                claim = ckpt.try_claim(self.directory, step, rank=self._rank, kind="jit")
                if claim is None:
                    holder = ckpt.read_claim(self.directory, step)
                    if ckpt.held_by_this_process(holder):
                        self._drain(max(0.0, deadline - time.monotonic()))
                    return self._skip(step, f"step {step} is being written by {holder or 'another writer'}")
                # Re-check with the claim held: a writer may have finished this step and
                # released its claim between the check above and ours.
                if (newest := ckpt.newest_step(self.directory)) is not None and newest >= step:
                    return self._skip(step, f"a checkpoint of step {newest} exists")
                payload = self._payload()
            path = self._write(step, payload)
        except Exception as exc:  # noqa: BLE001 - reported; the process is going down anyway
            log.error("just-in-time save of step %s failed: %s", step, log_line(exc))
            return JitOutcome(saved=False, step=step, path=None, detail=f"failed: {log_line(exc)}")
        finally:
            if claim is not None:
                claim.release()
        took = time.monotonic() - started
        log.warning("just-in-time checkpoint of step %d written to %s in %.2f s (%s)", step, path, took, reason)
        return JitOutcome(saved=True, step=step, path=path, detail=f"written in {took:.2f} s ({reason})")

    @staticmethod
    def _skip(step: int | None, why: str) -> JitOutcome:
        log.info("just-in-time save skipped: %s", why)
        return JitOutcome(saved=False, step=step, path=None, detail=why)
